"""`simulate --tp N --dp N`: the simulation as the ranks of one torch.distributed job.

Ways in, one program (runner.run on every rank):
- `--spawn`: this process starts tp x dp local ranks itself (torch.multiprocessing, start method
  spawn) and hosts their rendezvous: a TCPStore on a port the OS picks (port 0), so there is no
  port to guess and none to race for;
- torchrun, or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK (LOCAL_WORLD_SIZE), MASTER_ADDR
  and MASTER_PORT: every process is one rank, joined through env://;
- tp x dp = 1 with neither: the world of one, in this process (no process group).

Backends: nccl when every local rank has a GPU of its own; gloo on the CPU, and for ranks sharing a
GPU (NCCL cannot put two ranks on one device; gloo's broadcast and all_reduce take CUDA tensors).
Ranks sharing a GPU without --memory-budget-gb get equal shares of its free memory, so one rank's
KV cache does not take what another needs.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...errors import AttnPrologueError, InputError
from ..provenance import provenance
from . import runner
from .engine import SimOptions, SimulationError, check_options, on_cpu
from .ranks import Ranks, Solo

# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on a shared host, a program that uses it can
# take every GPU there out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off(env=None) -> None:
    """Set the NO_MULTICAST variables where absent (never unset or override one)."""
    env = os.environ if env is None else env
    for k, v in NO_MULTICAST.items():
        env.setdefault(k, v)


@dataclass(frozen=True)
class Launch:
    """How the ranks were started: recorded in the result file's topology and provenance."""

    launcher: str  # "spawn", "torchrun" or "in-process"
    backend: str | None
    world: int
    local_world: int
    argv: tuple[str, ...]  # the command line that started the run (the spawning process's)
    command: str


def torchrun_env(env=None) -> dict | None:
    """Rank, world size, local rank and local world size from a launcher's variables, if set."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return dict(
        rank=rank,
        world=world,
        local_rank=int(env.get("LOCAL_RANK", rank)),
        local_world=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def choose_backend(opts: SimOptions, local_world: int) -> str:
    """opts.backend, checked; by default nccl when each local rank has a GPU of its own, else gloo."""
    if on_cpu(opts):
        return "gloo"
    if opts.device is not None and torch.device(opts.device).index is not None and local_world > 1:
        raise InputError(
            f"device {opts.device}: ranks take GPUs by local rank (choose GPUs with CUDA_VISIBLE_DEVICES)"
        )
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SimulationError("simulate needs a CUDA GPU (or --device cpu for the reference path)")
    if opts.backend == "nccl" and local_world > gpus:
        raise InputError(
            f"nccl cannot put two ranks on one GPU: {local_world} local ranks, {gpus} GPU(s); "
            f"--backend gloo lets ranks share a GPU"
        )
    return opts.backend or ("nccl" if local_world <= gpus else "gloo")


def rank_device(opts: SimOptions, local_rank: int) -> torch.device:
    return (
        torch.device("cpu") if on_cpu(opts) else torch.device("cuda", local_rank % torch.cuda.device_count())
    )


def run_in_process(opts: SimOptions) -> dict:
    """tp x dp = 1 without a launcher: the world of one, reported as a run across ranks."""
    check_options(opts)
    launch = Launch("in-process", None, 1, 1, tuple(sys.argv), shlex.join(sys.orig_argv))
    device = runner.resolve_device(opts)
    return runner.run(opts, Solo(), _topology(opts, launch, [str(device)], 1, [opts.memory_budget_bytes]))


def run_spawned(opts: SimOptions) -> dict:
    """Start tp x dp ranks on this host and wait for them; returns rank 0's result document. A
    rank's typed error is raised here as a SimulationError naming the rank; any other failure of a
    rank propagates with that rank's traceback (torch.multiprocessing's ProcessRaisedException)."""
    if torchrun_env() is not None:
        raise InputError(
            "--spawn starts the ranks itself: it cannot run under torchrun (drop one of the two)"
        )
    check_options(opts)
    world = opts.tp * opts.dp
    backend = choose_backend(opts, world)
    keep_multicast_off()  # the ranks inherit this environment
    launch = Launch("spawn", backend, world, world, tuple(sys.argv), shlex.join(sys.orig_argv))
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="simulate-ranks-") as tmp:
        try:
            mp.start_processes(
                _spawned_rank,
                args=(opts, launch, store.port, tmp),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            errors = sorted(Path(tmp).glob("rank*.error.json"), key=lambda p: int(p.name[4:].split(".")[0]))
            if errors:
                e = json.loads(errors[0].read_text())
                raise SimulationError(f"rank {e['rank']}: {e['type']}: {e['message']}") from None
            raise
        return json.loads((Path(tmp) / "results.json").read_text())


def _spawned_rank(index: int, opts: SimOptions, launch: Launch, port: int, tmp: str) -> None:
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)

        def join() -> None:
            dist.init_process_group(
                launch.backend, store=store, rank=index, world_size=launch.world, timeout=timeout
            )

        results = _rank_main(opts, launch, index, join)
        if index == 0:
            (Path(tmp) / "results.json").write_text(json.dumps(results, default=str))
    except AttnPrologueError as exc:  # the parent reports it as one line, naming the rank
        error = {"rank": index, "type": type(exc).__name__, "message": str(exc)}
        (Path(tmp) / f"rank{index}.error.json").write_text(json.dumps(error))
        raise


def run_torchrun(opts: SimOptions) -> dict:
    """This process as one rank of a job torchrun started; returns the result document (every rank
    gets it; rank 0 prints and writes it)."""
    env = torchrun_env()
    if env["world"] != opts.tp * opts.dp:
        raise InputError(
            f"the launcher started {env['world']} processes, but --tp {opts.tp} x --dp {opts.dp} = {opts.tp * opts.dp}"
        )
    check_options(opts)
    backend = choose_backend(opts, env["local_world"])
    keep_multicast_off()  # read by NCCL when the process group makes its communicators
    launch = Launch(
        "torchrun", backend, env["world"], env["local_world"], tuple(sys.argv), shlex.join(sys.orig_argv)
    )
    timeout = datetime.timedelta(seconds=opts.timeout_s)

    def join() -> None:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)

    return _rank_main(opts, launch, env["local_rank"], join)


def _rank_main(opts: SimOptions, launch: Launch, local_rank: int, join) -> dict:
    device = rank_device(opts, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: NCCL binds to the current device
    else:  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world))
    join()
    try:
        peers = Ranks(opts.tp, opts.dp, opts.timeout_s)
        opts = replace(opts, device=str(device))
        sharing = sum(1 for r in range(launch.local_world) if rank_device(opts, r) == device)
        most = peers.max(sharing)  # decided alike on every rank: shared_budget is a collective
        if device.type == "cuda" and most > 1 and opts.memory_budget_bytes is None:
            opts = replace(opts, memory_budget_bytes=shared_budget(peers, device, sharing))
        devices = peers.gather(str(device))
        budgets = peers.gather(opts.memory_budget_bytes)
        topology = _topology(opts, launch, devices, most, budgets)
        origin = None
        if peers.rank == 0:
            origin = provenance(device=device)
            origin.update(argv=list(launch.argv), command=launch.command)
        return runner.run(opts, peers, topology, origin)
    finally:
        dist.destroy_process_group()


def shared_budget(peers, device, sharing: int, share: float = 0.9) -> int:
    """An equal share of the GPU's free memory for each of `sharing` ranks on it, measured once every
    rank's CUDA context exists (the smallest any rank saw)."""
    torch.zeros(1, device=device)  # this rank's context
    peers.barrier()
    return int(share * peers.min(torch.cuda.mem_get_info(device)[0]) / sharing)


def _topology(opts: SimOptions, launch: Launch, devices: list[str], sharing: int, budgets: list) -> dict:
    return dict(
        tp=opts.tp,
        dp=opts.dp,
        world=launch.world,
        launcher=launch.launcher,
        backend=launch.backend,
        local_world=launch.local_world,
        devices=list(devices),
        ranks_per_device=sharing,
        memory_budget_bytes=budgets,
        query_heads=opts.query_heads,
        heads_per_rank=opts.heads,
        padded_heads=opts.padded_heads,
        environment={k: os.environ.get(k) for k in NO_MULTICAST},
    )
