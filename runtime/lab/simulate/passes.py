"""The two passes of `simulate`: the bound op with its scratch pool (then the checks, checks.py), and
the old allocating op under the same memory budget. On CUDA the layers run the kernels; on the CPU
the pool pass runs the package's reference behind the bound op's contract (layers.py). Each rank
plays its DP group's schedule with every step padded to the token count all ranks agreed on
(ranks.py); a process alone is the world of one (Solo)."""

from __future__ import annotations

import gc
import time

import torch

from ...formats import get_format
from ...ops import qnorm_rope_kv_insert
from ...scratch import ScratchPool
from .checks import check_across_ranks, check_needles, untouched_blocks_zero
from .engine import CACHE_FORMAT, BlockAllocator, Plan, SimOptions, padded_q_bytes
from .harness import MEM_KEYS, Arena, Progress, fill_inputs, in_reservation, make_budget, mem_stats, size_kv
from .layers import BF16, StepInputs, layer_ops
from .ranks import ALONE
from .report import gib, size


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device, budget) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget.restore()


def pool_pass(opts: SimOptions, plan: Plan, device, peers=ALONE) -> dict:
    """Steps 1-4 of the package docstring, with the bound op and its scratch pool."""
    peers.barrier()  # ranks sharing a GPU measure its memory only once all have freed theirs
    needed = peers.max(plan.needed_blocks)
    budget = make_budget(opts, device, needed)
    pool = ScratchPool()
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _pool_pass_body(opts, plan, device, budget, pool, peers, needed)
    finally:
        pool.release()
        _release(device, budget)


def _pool_pass_body(opts, plan: Plan, device, budget, pool: ScratchPool, peers, needed: int) -> dict:
    schedule, needles, where = plan.schedule, plan.needles, plan.where
    cuda = device.type == "cuda"
    fmt = get_format(CACHE_FORMAT)
    h, p, d, bs, L = opts.heads, opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = {}
    # 1. profile: reserve the scratch pool, then the model's other buffers
    reserved = pool.reserve(
        max_tokens=opts.max_num_batched_tokens,
        padded_heads=p,
        head_dim=d,
        dtype=BF16,
        micro_batches=opts.micro_batches,
        device=device,
    )
    res["reserved_bytes"] = int(pool.reserved_bytes)
    if opts.progress:
        print(
            f"[pool] scratch pool: reserved {reserved} bytes ({size(reserved)}) = {opts.micro_batches} micro-batches x "
            f"{opts.max_num_batched_tokens} tokens x P={p} x D={d} x 2",
            flush=True,
        )
    arena = Arena(opts, plan.max_pos, device)
    pool.lock()
    ops = layer_ops(opts, pool, device)
    buffers = [
        pool.buffer(padded_heads=p, head_dim=d, dtype=BF16, micro_batch=mb, device=device)
        for mb in range(opts.micro_batches)
    ]
    q_gen, kv_gen = peers.generators(device, opts.seed)
    if cuda:
        # warm-up on a one-block dummy cache (every row skipped): loads every token-count bucket the
        # padded schedule uses
        fill_inputs(arena.q, arena.kv, q_gen, kv_gen)
        dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
        for n in sorted(set(plan.padded_tokens)):
            for mb in range(opts.micro_batches):
                ops[0](
                    arena.q[:n],
                    arena.kv[:n],
                    dummy,
                    arena.slots[:n],
                    arena.positions[:n],
                    arena.cos_sin,
                    micro_batch=mb,
                )
        torch.cuda.synchronize(device)
        del dummy
    # 2. size the KV cache in what is left (zeroed: blocks no table holds must stay zero)
    kv_info = size_kv(opts, budget, needed, "pool", peers)
    res["kv"] = kv_info
    nb = kv_info["num_blocks"]
    kv_all = torch.zeros((L, nb, kv_info["block_bytes"]), dtype=torch.uint8, device=device)
    caches = [kv_all[layer] for layer in range(L)]
    if cuda:
        for layer, b in enumerate(ops):  # bind each layer to its cache (the full check runs once, here)
            for mb in range(opts.micro_batches):
                b(
                    arena.q[:1],
                    arena.kv[:1],
                    caches[layer],
                    arena.slots[:1],
                    arena.positions[:1],
                    arena.cos_sin,
                    micro_batch=mb,
                )
        torch.cuda.synchronize(device)
    q_gen, kv_gen = peers.generators(device, opts.seed)
    alloc = BlockAllocator(nb, bs, seed=opts.seed)
    total_tokens = plan.total_tokens

    # 3. the schedule: nothing may allocate from here on
    stats0 = mem_stats(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    planned = torch.cuda.memory_allocated(device) if cuda else 0
    prog = Progress("pool", len(plan.padded_tokens), total_tokens, opts.progress)
    oom = None
    done = padded_rows = calls = outside = 0
    agreed: list[int] = []
    t0 = time.perf_counter()
    si = layer = 0
    while True:
        step = schedule[si] if si < len(schedule) else None
        n, failed = peers.agree_step(step.num_tokens if step is not None else 0, oom is not None)
        if failed or n == 0:
            break
        agreed.append(n)
        try:
            rows = StepInputs(arena, step, n, alloc)
            mb = si % opts.micro_batches
            hits = where.get(si, {})
            for layer in range(L):
                fill_inputs(rows.q, rows.kv, q_gen, kv_gen)
                out = ops[layer](
                    rows.q, rows.kv, caches[layer], rows.slots, rows.positions, arena.cos_sin, micro_batch=mb
                )
                calls += 1
                outside += not in_reservation(out, buffers[mb])
                for ni, row in hits.get(layer, ()):
                    arena.needle_q[ni].copy_(rows.q[row])
                    arena.needle_kv[ni].copy_(rows.kv[row])
                    arena.needle_qout[ni].copy_(out[row])
            _sync(device)
            done += rows.real
            padded_rows += n - rows.real
            prog.update(si + 1, done, rows.kind, n)
        except torch.cuda.OutOfMemoryError as exc:
            oom = dict(
                step=si + 1, layer=layer, message=str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
            )
        si += 1
    _sync(device)
    seconds = time.perf_counter() - t0
    stats1 = mem_stats(device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    res.update(
        tokens=done,
        tokens_scheduled=total_tokens,
        steps=len(schedule),
        prefill_steps=sum(1 for s in schedule if s.kind == "prefill"),
        decode_steps=sum(1 for s in schedule if s.kind == "decode"),
        steps_run=len(agreed),
        layer_calls=calls,
        seconds=seconds,
        oom=oom,
        stopped_by_another_rank=failed and oom is None,
        padded_tokens=agreed,
        padded_tokens_expected=list(plan.padded_tokens),
        padding_agreed=agreed == list(plan.padded_tokens),
        padded_rows=padded_rows,
        memory_before=stats0,
        memory_after=stats1,
        allocations_after_lock=None if stats0 is None else {k: stats1[k] - stats0[k] for k in MEM_KEYS},
        pool_views={"calls": calls, "outside_reservation": outside},
        reserved_bytes_after=int(pool.reserved_bytes),
        planned_bytes=int(planned) if cuda else None,
        peak_bytes=int(peak) if cuda else None,
        unplanned_peak_bytes=int(peak - planned) if cuda else None,
        headroom_bytes=budget.headroom(),
    )
    res["no_allocation_after_lock"] = (
        (stats0 is None or stats0 == stats1) and outside == 0 and res["reserved_bytes_after"] == reserved
    )

    # 4. checks (allocation is allowed again); every rank decides alike from what all agreed on
    if needles and not failed:
        res.update(check_needles(opts, needles, plan.prompt_lens, arena, kv_all, alloc, nb, fmt, device))
    else:
        res.update(
            recall=0,
            needles=len(needles),
            needle_parts={},
            mismatches=[],
            decode_needles=0,
            q_exact=0,
            q_close=0,
            needle_pads_zero=0,
        )
    pads = True
    if p > h:
        for buf in buffers:
            for r0 in range(0, buf.shape[0], 256):  # in slices: no large temporary under a tight budget
                pads = pads and not bool(buf[r0 : r0 + 256, h:].view(torch.int16).any())
    res["pool_pads_zero"] = pads
    res["block_tables"] = {"blocks_used": nb - alloc.num_free, "blocks_needed": plan.needed_blocks}
    res["blocks_outside_tables_zero"] = untouched_blocks_zero(kv_all, alloc)
    if opts.query_heads is not None and not failed:
        res.update(check_across_ranks(opts, plan, arena, kv_all, alloc, nb, fmt, device, peers))
    return res


def allocating_pass(opts: SimOptions, plan: Plan, device, peers=ALONE) -> dict:
    """Step 5 of the package docstring: the old op, a fresh padded Q tensor per layer call."""
    peers.barrier()
    needed = peers.max(plan.needed_blocks)
    budget = make_budget(opts, device, needed)
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _allocating_pass_body(opts, plan, device, budget, peers, needed)
    finally:
        _release(device, budget)


def _allocating_pass_body(opts: SimOptions, plan: Plan, device, budget, peers, needed: int) -> dict:
    schedule = plan.schedule
    fmt = get_format(CACHE_FORMAT)
    p, d, bs, L = opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = dict(padded_q_bytes_max=padded_q_bytes(opts))
    arena = Arena(opts, plan.max_pos, device)  # the same model buffers; no pool
    q_gen, kv_gen = peers.generators(device, opts.seed)
    fill_inputs(arena.q, arena.kv, q_gen, kv_gen)
    dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
    q_tmp = torch.empty((1, p, d), dtype=BF16, device=device)
    qnorm_rope_kv_insert(
        arena.q[:1],
        arena.kv[:1],
        q_tmp,
        dummy,
        arena.slots[:1],
        arena.positions[:1],
        arena.cos_sin,
        opts.eps,
        bs,
    )
    torch.cuda.synchronize(device)
    del dummy, q_tmp
    kv_info = size_kv(opts, budget, needed, "allocating", peers)
    res["kv"] = kv_info
    nb = kv_info["num_blocks"]
    kv_all = torch.empty((L, nb, kv_info["block_bytes"]), dtype=torch.uint8, device=device)
    caches = [kv_all[layer] for layer in range(L)]
    alloc = BlockAllocator(nb, bs, seed=opts.seed)
    total_tokens = plan.total_tokens
    torch.cuda.synchronize(device)
    stats0 = mem_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    planned = torch.cuda.memory_allocated(device)
    headroom = budget.headroom()
    prog = Progress("allocating", len(plan.padded_tokens), total_tokens, opts.progress)
    oom = None
    done = 0
    t0 = time.perf_counter()
    si = layer = n = 0
    while True:
        step = schedule[si] if si < len(schedule) else None
        n, failed = peers.agree_step(step.num_tokens if step is not None else 0, oom is not None)
        if failed or n == 0:
            break
        try:
            rows = StepInputs(arena, step, n, alloc)
            for layer in range(L):
                fill_inputs(rows.q, rows.kv, q_gen, kv_gen)
                q_out = torch.empty((n, p, d), dtype=BF16, device=device)  # what the old op did per call
                qnorm_rope_kv_insert(
                    rows.q,
                    rows.kv,
                    q_out,
                    caches[layer],
                    rows.slots,
                    rows.positions,
                    arena.cos_sin,
                    opts.eps,
                    bs,
                )
                del q_out  # attention has consumed it
            torch.cuda.synchronize(device)
            done += rows.real
            prog.update(si + 1, done, rows.kind, n)
        except torch.cuda.OutOfMemoryError as exc:
            msg = str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
            oom = dict(
                step=si + 1,
                steps=len(plan.padded_tokens),
                layer=layer,
                tokens=n,
                real_tokens=step.num_tokens if step is not None else 0,
                requested_bytes=padded_q_bytes(opts, n),
                message=msg,
            )
            if opts.progress:
                print(
                    f"[allocating] torch.cuda.OutOfMemoryError at step {si + 1}/{len(plan.padded_tokens)}, layer "
                    f"{layer}: a [{n}, {p}, {d}] Q tensor ({gib(padded_q_bytes(opts, n))}) with {gib(headroom)} of headroom",
                    flush=True,
                )
        si += 1
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    stats1 = mem_stats(device)
    extra = int(peak - planned)
    res.update(
        outcome="oom" if oom else ("stopped" if failed else "fit"),
        oom=oom,
        stopped_by_another_rank=failed and oom is None,
        tokens=done,
        seconds=seconds,
        planned_bytes=int(planned),
        peak_bytes=int(peak),
        unplanned_peak_bytes=extra,
        headroom_bytes=int(headroom),
        allocations={k: stats1[k] - stats0[k] for k in MEM_KEYS},
    )
    if oom:
        # what it needed beyond what the engine had left, measured at the failing request
        res["needed_beyond_budget_bytes"] = int(extra + oom["requested_bytes"] - headroom)
        res["exceeded_budget"] = True
    else:
        res["needed_beyond_budget_bytes"] = int(extra - headroom)
        res["exceeded_budget"] = extra > headroom
        # the largest kv_fraction under which the measured extra would still have fit
        free = kv_info["free_bytes"]
        res["max_kv_fraction_that_fits"] = max(0.0, 1.0 - extra / free) if free else 0.0
    return res
