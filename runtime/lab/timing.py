"""How the lab times things: device time per call under CUDA-graph replay (callers rotate input sets
so the L2 is cold), host time per call in a back-to-back loop, and the copy yardstick (the faster
of the SM copy kernels and cudaMemcpy moving the same bytes)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .. import dispatch


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


# Each timed replay is queued behind a GPU spin of this many cycles (about 50 us at the H100's and
# H200's 1.98 GHz), and the host queues every replay before it waits for any: the host stays ahead of
# the GPU, so an interval holds the graph's GPU time only. The lab's method before (lead=False) had the
# host launch each replay after the last one finished: that launch (graph.replay(), several us) fell
# inside the interval, 1/calls_per_graph of it on every call, and on a host busy with the tuner's
# compiles a config could time twice as slow as it runs (tools/timing_lead.py measures both methods).
LEAD_CYCLES = 100_000


def graph_time_us(
    fns: list[Callable[[], None]], replays: int = 30, calls_per_graph: int = 20, *, lead: bool = True
) -> dict:
    """Capture `calls_per_graph` calls cycling through fns (one per input set) in a CUDA graph and
    time its replays with events (lead: queued behind spins, above). Returns the median and spread
    per call in microseconds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fns[i % len(fns)]()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(LEAD_CYCLES)
        a.record()
        graph.replay()
        b.record()
        if not lead:
            b.synchronize()
        events.append((a, b))
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1000 / calls_per_graph for a, b in events]
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


def host_time_us(call: Callable[[], object], calls: int = 2000, warmup: int = 100) -> float:
    """Host wall time per call of `call` issued back to back: the median of 5 timed loops."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_fns(nbytes: int, sets: int, kind: str = "sm") -> list[Callable[[], None]]:
    """Device-to-device copies moving nbytes in total (nbytes/2 read + nbytes/2 written): an SM copy
    (128-bit loads/stores; `kind` names one of copy_kernel.COPY_KINDS or is a CopyKind key), or
    "memcpy", torch's copy_."""
    half = max(64, nbytes // 2 // 64 * 64)
    bufs = [
        (
            torch.empty(half // 4, dtype=torch.int32, device="cuda"),
            torch.empty(half // 4, dtype=torch.int32, device="cuda"),
        )
        for _ in range(sets)
    ]
    for s, _ in bufs:
        s.random_(-(2**31), 2**31 - 1)
    if kind == "memcpy":
        return [lambda s=s, d=d: d.copy_(s) for s, d in bufs]
    # imported here: the DSL takes about a second to import, and the CPU-only users of the lab
    # (the targets checker, the tests) never time a copy
    from . import copy_kernel

    fn = copy_kernel.compiled(dispatch.default_runtime().device().target, kind)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    max_ctas = copy_kernel.CopyKind.from_key(kind).ctas_per_sm * sms  # (a persistent kind's grid cap)
    return [lambda s=s, d=d: fn(s, d, max_ctas) for s, d in bufs]


COPY_KINDS = ("sm", "sm1", "memcpy")  # copy_kernel.COPY_KINDS, then torch's copy_


def copy_time_us(nbytes: int, sets: int, replays: int, calls: int) -> dict:
    """The fastest of the SM copy kernels and cudaMemcpy for these bytes (the bandwidth ceiling):
    its times, its kind, and every kind's median ("kinds_us")."""
    best, kinds = None, {}
    for kind in COPY_KINDS:
        t = graph_time_us(copy_fns(nbytes, sets, kind), replays=replays, calls_per_graph=calls)
        t["kind"] = kind
        kinds[kind] = t["median_us"]
        if best is None or t["median_us"] < best["median_us"]:
            best = t
    return {**best, "kinds_us": kinds}
