"""The two passes of `simulate` on the GPU: the bound op with its scratch pool (then the needle
checks), and the old allocating op under the same memory budget."""

from __future__ import annotations

import gc
import time

import torch

from ... import codecs, reference
from ...api import bind
from ...formats import get_format
from ...scratch import ScratchPool
from ...torch_op import qnorm_rope_kv_insert
from .engine import CACHE_FORMAT, BlockAllocator, Plan, SimOptions, padded_q_bytes, step_slots_positions
from .harness import MEM_KEYS, Arena, Budget, Progress, fill_inputs, mem_stats, size_kv
from .report import gib


def pool_pass(opts: SimOptions, plan: Plan, device) -> dict:
    """Steps 1-4 of the package docstring, with the bound op and its scratch pool."""
    budget = Budget(opts.memory_budget_bytes, device)
    pool = ScratchPool()
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _pool_pass_body(opts, plan, device, budget, pool)
    finally:
        pool.release()
        gc.collect()
        torch.cuda.empty_cache()
        budget.restore()


def _pool_pass_body(opts: SimOptions, plan: Plan, device, budget: Budget, pool: ScratchPool) -> dict:
    schedule, needles, where = plan.schedule, plan.needles, plan.where
    fmt = get_format(CACHE_FORMAT)
    h, p, d, bs, L = opts.heads, opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = {}
    # 1. profile: reserve the scratch pool, then the model's other buffers
    reserved = pool.reserve(
        max_tokens=opts.max_num_batched_tokens,
        padded_heads=p,
        head_dim=d,
        dtype=torch.bfloat16,
        micro_batches=opts.micro_batches,
        device=device,
    )
    res["reserved_bytes"] = int(pool.reserved_bytes)
    if opts.progress:
        print(
            f"[pool] scratch pool: reserved {reserved} bytes ({gib(reserved)}) = {opts.micro_batches} micro-batches x "
            f"{opts.max_num_batched_tokens} tokens x P={p} x D={d} x 2",
            flush=True,
        )
    arena = Arena(opts, plan.max_pos, device)
    pool.lock()
    bound = [
        bind(
            num_heads=h,
            padded_heads=p,
            head_dim=d,
            rope_dim=opts.rope_dim,
            cache_format=CACHE_FORMAT,
            dtype=torch.bfloat16,
            block_size=bs,
            pool=pool,
            micro_batches=opts.micro_batches,
            eps=opts.eps,
            device=device,
        )
        for _ in range(L)
    ]
    # warm-up on a one-block dummy cache (every row skipped): loads every token-count bucket the schedule uses
    gen = torch.Generator(device=device)
    gen.manual_seed(opts.seed)
    fill_inputs(arena.q, arena.kv, gen)
    dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
    for n in sorted({s.num_tokens for s in schedule}):
        for mb in range(opts.micro_batches):
            bound[0](
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
    # 2. size the KV cache in what is left
    kv_info = size_kv(opts, budget, plan.needed_blocks, "pool")
    res["kv"] = kv_info
    nb = kv_info["num_blocks"]
    kv_all = torch.empty((L, nb, kv_info["block_bytes"]), dtype=torch.uint8, device=device)
    caches = [kv_all[layer] for layer in range(L)]
    for layer, b in enumerate(bound):  # bind each layer to its cache (the full check runs once, here)
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
    gen.manual_seed(opts.seed)
    alloc = BlockAllocator(nb, bs, seed=opts.seed)
    total_tokens = plan.total_tokens

    # 3. the schedule: nothing may allocate from here on
    stats0 = mem_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    planned = torch.cuda.memory_allocated(device)
    prog = Progress("pool", len(schedule), total_tokens, opts.progress)
    oom = None
    done = 0
    t0 = time.perf_counter()
    si = layer = 0
    try:
        for si, step in enumerate(schedule):
            n = step.num_tokens
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            slots, positions = arena.slots[:n], arena.positions[:n]
            slots.copy_(slots_cpu)
            positions.copy_(pos_cpu)
            q, kv = arena.q[:n], arena.kv[:n]
            mb = si % opts.micro_batches
            hits = where.get(si, {})
            for layer in range(L):
                fill_inputs(q, kv, gen)
                out = bound[layer](q, kv, caches[layer], slots, positions, arena.cos_sin, micro_batch=mb)
                for ni, row in hits.get(layer, ()):
                    arena.needle_q[ni].copy_(q[row])
                    arena.needle_kv[ni].copy_(kv[row])
                    arena.needle_qout[ni].copy_(out[row])
            torch.cuda.synchronize(device)
            done += n
            prog.update(si + 1, done, step)
    except torch.cuda.OutOfMemoryError as exc:
        oom = dict(
            step=si + 1, layer=layer, message=str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
        )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats1 = mem_stats(device)
    peak = torch.cuda.max_memory_allocated(device)
    res.update(
        tokens=done,
        tokens_scheduled=total_tokens,
        steps=len(schedule),
        prefill_steps=sum(1 for s in schedule if s.kind == "prefill"),
        decode_steps=sum(1 for s in schedule if s.kind == "decode"),
        layer_calls=len(schedule) * L,
        seconds=seconds,
        oom=oom,
        memory_before=stats0,
        memory_after=stats1,
        allocations_after_lock={k: stats1[k] - stats0[k] for k in MEM_KEYS},
        planned_bytes=int(planned),
        peak_bytes=int(peak),
        unplanned_peak_bytes=int(peak - planned),
        headroom_bytes=budget.headroom(),
    )
    res["no_allocation_after_lock"] = all(stats1[k] == stats0[k] for k in MEM_KEYS)

    # 4. checks (allocation is allowed again)
    if needles and oom is None:
        res.update(_check_needles(opts, needles, plan.prompt_lens, arena, kv_all, alloc, nb, fmt, device))
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
        for mb in range(opts.micro_batches):
            buf = pool.buffer(padded_heads=p, head_dim=d, dtype=torch.bfloat16, micro_batch=mb, device=device)
            for r0 in range(0, buf.shape[0], 256):  # in slices: no large temporary under a tight budget
                pads = pads and not bool(buf[r0 : r0 + 256, h:].view(torch.int16).any())
    res["pool_pads_zero"] = pads
    res["block_tables"] = {"blocks_used": nb - alloc.num_free, "blocks_needed": plan.needed_blocks}
    return res


def _check_needles(opts, needles, prompt_lens, arena, kv_all, alloc, nb, fmt, device) -> dict:
    """Decode the needles' cache entries and compare them (and their q_out rows) with the reference."""
    h, d, bs, L = opts.heads, opts.head_dim, opts.block_size, opts.layers
    k = len(needles)
    pos = torch.tensor([nd.pos for nd in needles], dtype=torch.int64, device=device)
    # slots in the [L * num_blocks, block_bytes] view of the whole cache
    gslots = torch.tensor(
        [(nd.layer * nb + alloc.table(nd.seq)[nd.pos // bs]) * bs + nd.pos % bs for nd in needles],
        dtype=torch.int64,
        device=device,
    )
    flat = kv_all.view(L * nb, kv_all.shape[2])
    got_d, got_s = codecs.read_records(flat, fmt, d, bs, gslots)
    vals = reference.kv_values(arena.needle_kv[:k], pos, arena.cos_sin)
    want_d, want_s = codecs.encode_tokens(fmt, vals)
    nq, tail = fmt.dims(d)
    nope = (got_d[:, :nq] == want_d[:, :nq]).all(1)
    rope = (got_d[:, nq:] == want_d[:, nq:]).all(1)
    scale = (got_s == want_s).all(1)
    exact = nope & rope & scale
    mism = [
        dict(
            seq=needles[i].seq,
            pos=needles[i].pos,
            layer=needles[i].layer,
            nope_ok=bool(nope[i]),
            rope_ok=bool(rope[i]),
            scale_ok=bool(scale[i]),
        )
        for i in range(k)
        if not bool(exact[i])
    ]
    # q_out of the needles' rows, captured right after their layer's call
    want_q = reference.q_values(arena.needle_q[:k], pos, arena.cos_sin, opts.eps).to(torch.bfloat16)
    got_q = arena.needle_qout[:k, :h]
    q_exact = (got_q.view(torch.int16) == want_q.view(torch.int16)).flatten(1).all(1)
    q_close = torch.isclose(got_q.float(), want_q.float(), rtol=1e-2, atol=1e-2).flatten(1).all(1)
    if arena.needle_qout.shape[1] > h:
        pads = (arena.needle_qout[:k, h:].view(torch.int16) == 0).flatten(1).all(1)
    else:
        pads = torch.ones(k, dtype=torch.bool, device=device)
    return dict(
        recall=int(exact.sum()),
        needles=k,
        needle_parts=dict(nope_e4m3=int(nope.sum()), rope_bf16=int(rope.sum()), scale_ue8m0=int(scale.sum())),
        mismatches=mism[:10],
        decode_needles=sum(1 for nd in needles if nd.pos >= prompt_lens[nd.seq]),
        q_exact=int(q_exact.sum()),
        q_close=int(q_close.sum()),
        needle_pads_zero=int(pads.sum()),
    )


def allocating_pass(opts: SimOptions, plan: Plan, device) -> dict:
    """Step 5 of the package docstring: the old op, a fresh padded Q tensor per layer call."""
    budget = Budget(opts.memory_budget_bytes, device)
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _allocating_pass_body(opts, plan, device, budget)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        budget.restore()


def _allocating_pass_body(opts: SimOptions, plan: Plan, device, budget: Budget) -> dict:
    schedule = plan.schedule
    fmt = get_format(CACHE_FORMAT)
    p, d, bs, L = opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = dict(padded_q_bytes_max=padded_q_bytes(opts))
    arena = Arena(opts, plan.max_pos, device)  # the same model buffers; no pool
    gen = torch.Generator(device=device)
    gen.manual_seed(opts.seed)
    fill_inputs(arena.q, arena.kv, gen)
    dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
    q_tmp = torch.empty((1, p, d), dtype=torch.bfloat16, device=device)
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
    kv_info = size_kv(opts, budget, plan.needed_blocks, "allocating")
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
    prog = Progress("allocating", len(schedule), total_tokens, opts.progress)
    oom = None
    done = 0
    t0 = time.perf_counter()
    si = layer = n = 0
    try:
        for si, step in enumerate(schedule):
            n = step.num_tokens
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            slots, positions = arena.slots[:n], arena.positions[:n]
            slots.copy_(slots_cpu)
            positions.copy_(pos_cpu)
            q, kv = arena.q[:n], arena.kv[:n]
            for layer in range(L):
                fill_inputs(q, kv, gen)
                q_out = torch.empty(
                    (n, p, d), dtype=torch.bfloat16, device=device
                )  # what the old op did per call
                qnorm_rope_kv_insert(
                    q, kv, q_out, caches[layer], slots, positions, arena.cos_sin, opts.eps, bs
                )
                del q_out  # attention has consumed it
            torch.cuda.synchronize(device)
            done += n
            prog.update(si + 1, done, step)
    except torch.cuda.OutOfMemoryError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
        oom = dict(
            step=si + 1,
            steps=len(schedule),
            layer=layer,
            tokens=n,
            requested_bytes=padded_q_bytes(opts, n),
            message=msg,
        )
        if opts.progress:
            print(
                f"[allocating] torch.cuda.OutOfMemoryError at step {si + 1}/{len(schedule)}, layer {layer}: "
                f"a [{n}, {p}, {d}] Q tensor ({gib(padded_q_bytes(opts, n))}) with {gib(headroom)} of headroom",
                flush=True,
            )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    stats1 = mem_stats(device)
    extra = int(peak - planned)
    res.update(
        outcome="oom" if oom else "fit",
        oom=oom,
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
