"""One rank's simulation, start to end: check the options, plan, run both passes, and report (alone,
or gathered from every rank onto rank 0, which prints and writes the result file)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..provenance import device_facts, provenance
from . import report
from .engine import SimOptions, SimulationError, check_options, make_plan
from .passes import allocating_pass, pool_pass
from .ranks import ALONE


def resolve_device(opts: SimOptions) -> torch.device:
    """opts.device, default the current CUDA device ("cpu": the reference path)."""
    device = torch.device(opts.device) if opts.device else torch.device("cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SimulationError("simulate needs a CUDA GPU (or --device cpu for the reference path)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def run(opts: SimOptions, peers=None, topology: dict | None = None, origin: dict | None = None) -> dict:
    """Run the simulation on this rank (peers: ranks.Ranks, or alone); returns (and with
    opts.json_path, on rank 0, writes) the result document. `topology` describes the ranks for the
    report; `origin` is rank 0's provenance when a launcher knows it better (its own command line)."""
    peers = peers or ALONE
    check_options(opts)
    device = resolve_device(opts)
    opts = replace(opts, progress=opts.progress and peers.rank == 0)  # one rank talks
    plan = make_plan(opts, peers.dp_rank)
    if peers.rank == 0:
        origin = origin or provenance(device=device)
    else:
        origin = {"device": device_facts(device)}
    if opts.progress:
        prompts, schedule = plan.prompt_lens or [0], plan.schedule
        if topology:
            world = topology["world"]
            where = f"{world} rank{'s' if world > 1 else ''} (TP {opts.tp} x DP {opts.dp}), rank 0 on {origin['device']['name']}"
            mine = f" ({len(plan.prompt_lens)} on rank 0)"
        else:
            where, mine = origin["device"]["name"], ""
        print(
            f"simulate on {where}: {opts.seqs} sequences{mine}, prompts "
            f"{min(prompts)}..{max(prompts)} tokens, {len(schedule)} steps ({sum(s.kind == 'prefill' for s in schedule)} "
            f"prefill, {opts.decode_steps} decode), {opts.layers} layers, H={opts.heads} P={opts.padded_heads} "
            f"D={opts.head_dim}, max_num_batched_tokens={opts.max_num_batched_tokens}, {len(plan.needles)} needles"
            + (
                f", memory budget {report.gib(opts.memory_budget_bytes)}"
                if opts.memory_budget_bytes is not None
                else ""
            ),
            flush=True,
        )
    t0 = time.perf_counter()
    pool = pool_pass(opts, plan, device, peers)
    allocating = (
        allocating_pass(opts, plan, device, peers) if opts.allocating and device.type == "cuda" else None
    )
    seconds = time.perf_counter() - t0
    doc = report.document(opts, plan, pool, allocating, seconds, origin)
    if topology is None:
        results, text = doc, report.summary
    else:
        docs = peers.gather(doc)
        results = report.ranks_document(
            docs, topology, docs[0]["provenance"], max(d["seconds"] for d in docs)
        )
        text = report.ranks_summary
    if peers.rank == 0:
        if opts.progress:
            print()
            print(text(results), flush=True)
        if opts.json_path:
            report.write(results, opts.json_path)
            if opts.progress:
                print(f"\nresults written to {opts.json_path}")
    return results
