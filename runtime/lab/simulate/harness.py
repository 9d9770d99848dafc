"""The harness of `simulate`: the memory budget (a cap on the CUDA caching allocator; on the CPU, a
cache sized to the schedule), the model's fixed buffers, the KV-cache sizing the ranks agree on,
allocator counters, the pool-view check and progress lines."""

from __future__ import annotations

import gc
import math
import time

import torch

from ...formats import get_format
from .engine import CACHE_FORMAT, SimOptions, SimulationError
from .ranks import ALONE
from .report import gib, size

MEM_KEYS = ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries", "num_ooms")


def mem_stats(device) -> dict | None:
    """The CUDA caching allocator's counters; None on the CPU, which has no such allocator to count."""
    if device.type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    return {k: int(s.get(k, 0)) for k in MEM_KEYS}


def in_reservation(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` lies inside `buffer`'s storage: what a pool that allocates nothing hands out."""
    lo = buffer.data_ptr()
    hi = lo + buffer.numel() * buffer.element_size()
    start = view.data_ptr()
    return (
        view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and lo <= start
        and start + view.numel() * view.element_size() <= hi
    )


class Budget:
    """The memory budget: a cap on the caching allocator (set_per_process_memory_fraction), so a
    request beyond it is a real torch.cuda.OutOfMemoryError, and free memory as an engine sees it."""

    def __init__(self, budget_bytes: int | None, device):
        self.device = device
        self.limit = None
        if budget_bytes is not None:
            gc.collect()
            torch.cuda.empty_cache()
            total = torch.cuda.mem_get_info(device)[1]
            self.limit = torch.cuda.memory_reserved(device) + int(budget_bytes)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit / total), device)

    def restore(self) -> None:
        if self.limit is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def free_for_kv(self) -> int:
        """torch.cuda.mem_get_info's free memory (after returning cached blocks), capped by the budget."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        if self.limit is not None:
            free = min(free, self.limit - torch.cuda.memory_reserved(self.device))
        return max(0, int(free))

    def headroom(self) -> int:
        """The largest allocation that could succeed now: a new segment (free device memory, capped by
        the budget less what is reserved) or the largest free block of a segment already reserved. Not
        the sum of the free blocks: a process's earlier tensors leave reserved segments partly used,
        and their free blocks, however many, do not make one large tensor."""
        torch.cuda.synchronize(self.device)
        fresh = torch.cuda.mem_get_info(self.device)[0]
        if self.limit is not None:
            fresh = min(fresh, self.limit - torch.cuda.memory_reserved(self.device))
        index = torch.device(self.device).index
        index = torch.cuda.current_device() if index is None else index
        cached = max(
            (b["size"] for seg in torch.cuda.memory_snapshot() if seg["device"] == index
             for b in seg["blocks"] if b["state"] == "inactive"),
            default=0,
        )  # fmt: skip
        return max(0, int(fresh), int(cached))


class HostBudget:
    """The CPU's stand-in for Budget: there is no device memory to size a KV cache from, so it gets
    twice the blocks the schedule needs (the shuffled block allocator still scatters a sequence's
    blocks) and nothing is capped."""

    def __init__(self, opts: SimOptions, needed_blocks: int):
        layer_block = opts.layers * get_format(CACHE_FORMAT).block_bytes(opts.head_dim, opts.block_size)
        # what size_kv's kv_fraction of it turns into 2 x needed blocks (one more block for rounding)
        self.free = math.ceil(2 * max(1, needed_blocks) * layer_block / opts.kv_fraction) + layer_block

    def restore(self) -> None:
        pass

    def free_for_kv(self) -> int:
        return self.free

    def headroom(self) -> None:
        return None


def make_budget(opts: SimOptions, device, needed_blocks: int):
    return (
        Budget(opts.memory_budget_bytes, device) if device.type == "cuda" else HostBudget(opts, needed_blocks)
    )


class Arena:
    """Fixed-size model buffers allocated before the pool is locked; steps use views of them."""

    def __init__(self, opts: SimOptions, max_pos: int, device):
        t, h, p, d, r = (
            opts.max_num_batched_tokens,
            opts.heads,
            opts.padded_heads,
            opts.head_dim,
            opts.rope_dim,
        )
        bf16 = torch.bfloat16
        self.q = torch.empty((t, h, d), dtype=bf16, device=device)
        self.kv = torch.empty((t, d), dtype=bf16, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros((t,), dtype=torch.int64, device=device)
        # real RoPE angles (theta 10000), float32 [max_pos, R]: R/2 cos columns then R/2 sin columns
        inv_freq = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64, device=device) / r)
        ang = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat((ang.cos(), ang.sin()), dim=1).to(torch.float32).contiguous()
        del inv_freq, ang
        k = max(1, opts.needles)
        self.needle_q = torch.zeros((k, h, d), dtype=bf16, device=device)
        self.needle_kv = torch.zeros((k, d), dtype=bf16, device=device)
        self.needle_qout = torch.full((k, p, d), float("nan"), dtype=bf16, device=device)


def _fmt_time(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    return f"{int(s // 60)}m{s % 60:04.1f}s"


class Progress:
    """One line per step: on long schedules at most one a second, the first and last always."""

    def __init__(self, label: str, steps: int, tokens: int, enabled: bool):
        self.label, self.steps, self.tokens, self.enabled = label, steps, tokens, enabled
        self.t0 = time.perf_counter()
        self.last = -1.0

    def update(self, k: int, tokens_done: int, kind: str, n: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        el = now - self.t0
        if k != self.steps and k != 1 and now - self.last < 1.0 and self.steps > 60:
            return
        self.last = now
        eta = el * (self.tokens - tokens_done) / max(1, tokens_done)
        print(
            f"[{self.label}] step {k}/{self.steps} {kind:7s} N={n:6d}  tokens {tokens_done}/{self.tokens}"
            f"  elapsed {_fmt_time(el)}  ETA {_fmt_time(eta)}",
            flush=True,
        )


def _sized_from(opts: SimOptions, free: int) -> str:
    if opts.device == "cpu":  # HostBudget: no device memory to measure
        return "twice the schedule's blocks (no device memory on the CPU)"
    return f"{opts.kv_fraction:.2f} x {gib(free)} free"


def size_kv(opts: SimOptions, budget, needed_blocks: int, label: str, peers=ALONE) -> dict:
    """KV-cache blocks for every layer in kv_fraction of the free memory, the fewest any rank can
    hold (engines size every rank's cache alike: an all_reduce MIN); refuses a cache the schedule's
    sequences do not fit in. needed_blocks is what every rank checks against (the ranks' MAX), so
    every rank refuses or none does."""
    fmt = get_format(CACHE_FORMAT)
    block_bytes = fmt.block_bytes(opts.head_dim, opts.block_size)
    free = budget.free_for_kv()
    measured = int(opts.kv_fraction * free) // (opts.layers * block_bytes)
    num_blocks = peers.min(measured)
    info = dict(
        free_bytes=free,
        num_blocks_measured=measured,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        kv_bytes=num_blocks * block_bytes * opts.layers,
        capacity_tokens=num_blocks * opts.block_size,
    )
    if opts.progress:
        print(
            f"[{label}] KV cache: {_sized_from(opts, free)} -> {num_blocks} blocks x "
            f"{opts.block_size} = {info['capacity_tokens']} tokens per layer, {opts.layers} layers, "
            f"{size(info['kv_bytes'])} ({needed_blocks} blocks needed by the schedule)",
            flush=True,
        )
    if num_blocks < needed_blocks:
        raise SimulationError(
            f"[{label}] the KV cache holds {num_blocks} blocks but the schedule needs {needed_blocks}: "
            f"lower --seqs/--prompt-len or raise --memory-budget-gb/--kv-fraction"
        )
    return info


def fill_inputs(q, kv, q_gen, kv_gen) -> None:
    q.normal_(generator=q_gen)
    kv.normal_(generator=kv_gen)
