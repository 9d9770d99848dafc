"""`simulate`: play a serving engine on one GPU and check the op under load (docs/serving.md).

1. Profile: reserve the padded-Q scratch pool for max_num_batched_tokens (two micro-batches).
2. Size a paged fp8_ds_mla KV cache for every layer that fills `kv_fraction` of the memory still
   free after the pool and the input activations (one tensor, split into per-layer views).
3. Run a schedule: chunked prefills of several long prompts (a step mixes chunks of several
   sequences), then decode steps; every layer's bound op runs with real slot mappings from a block
   table; micro-batches alternate between steps.
4. Check: no allocation after the pool is locked, no OOM, needle recall (sampled cache entries
   decoded after the schedule, compared bit for bit with the reference), q_out and pad heads.
5. The same schedule with the old allocating op (a fresh [N, P, D] Q tensor per layer call) under
   the same memory budget, the KV cache sized without the pool: it runs out of memory, or the
   extra memory it needed is measured.

engine.py is the engine model (options, prompt lengths, scheduler, block allocator, slot mappings,
needles, memory arithmetic): it needs no GPU and is tested on the CPU. harness.py and passes.py run
it on the GPU, report.py writes the result document and the table; `run(SimOptions(...))` does it all.
"""

from __future__ import annotations

import time

import torch

from ..provenance import provenance
from . import report
from .engine import (
    BlockAllocator,
    Chunk,
    Needle,
    Plan,
    SimOptions,
    SimulationError,
    Step,
    allocating_failure_budget,
    blocks_for,
    build_schedule,
    input_arena_bytes,
    locate_needles,
    make_plan,
    max_position,
    padded_q_bytes,
    pool_bytes,
    prompt_lengths,
    select_needles,
    step_slots_positions,
)
from .harness import MEM_KEYS
from .passes import allocating_pass, pool_pass
from .report import summary

__all__ = [
    "MEM_KEYS",
    "BlockAllocator",
    "Chunk",
    "Needle",
    "Plan",
    "SimOptions",
    "SimulationError",
    "Step",
    "allocating_failure_budget",
    "blocks_for",
    "build_schedule",
    "input_arena_bytes",
    "locate_needles",
    "max_position",
    "padded_q_bytes",
    "make_plan",
    "pool_bytes",
    "prompt_lengths",
    "run",
    "select_needles",
    "step_slots_positions",
    "summary",
]


def run(opts: SimOptions) -> dict:
    """Run the simulation on a CUDA device (opts.device, default the current one); returns (and with
    opts.json_path writes) the result document."""
    if not torch.cuda.is_available():
        raise SimulationError("simulate needs a CUDA GPU")
    if opts.padded_heads < opts.heads:
        raise SimulationError(f"padded_heads={opts.padded_heads} < heads={opts.heads}")
    if not 0 < opts.kv_fraction < 1:
        raise SimulationError(f"kv_fraction must be in (0, 1), got {opts.kv_fraction}")
    device = torch.device(opts.device) if opts.device else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    plan = make_plan(opts)
    origin = provenance(device=device)
    if opts.progress:
        prompts, schedule = plan.prompt_lens, plan.schedule
        print(
            f"simulate on {origin['device']['name']}: {opts.seqs} sequences, prompts {min(prompts)}..{max(prompts)} "
            f"tokens, {len(schedule)} steps ({sum(s.kind == 'prefill' for s in schedule)} prefill, {opts.decode_steps} decode), "
            f"{opts.layers} layers, H={opts.heads} P={opts.padded_heads} D={opts.head_dim}, max_num_batched_tokens="
            f"{opts.max_num_batched_tokens}, {len(plan.needles)} needles"
            + (
                f", memory budget {report.gib(opts.memory_budget_bytes)}"
                if opts.memory_budget_bytes is not None
                else ""
            ),
            flush=True,
        )
    t0 = time.perf_counter()
    pool = pool_pass(opts, plan, device)
    allocating = allocating_pass(opts, plan, device) if opts.allocating else None
    results = report.document(opts, plan, pool, allocating, time.perf_counter() - t0, origin)
    if opts.progress:
        print()
        print(summary(results), flush=True)
    if opts.json_path:
        report.write(results, opts.json_path)
        if opts.progress:
            print(f"\nresults written to {opts.json_path}")
    return results
