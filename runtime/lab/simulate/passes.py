"""The two passes of `simulate`: the bound op with its scratch pool (then the checks), and the old
allocating op under the same memory budget. On CUDA the layers run the kernels; on the CPU the pool
pass runs the package's reference behind the bound op's contract (ReferenceOp). Each rank plays its
DP group's schedule with every step padded to the token count all ranks agreed on (ranks.py); a
process alone is the world of one (Solo)."""

from __future__ import annotations

import gc
import time

import torch

from ... import codecs, reference, validate
from ...api import bind
from ...formats import get_format
from ...ops import qnorm_rope_kv_insert
from ...scratch import ScratchPool
from .engine import (
    CACHE_FORMAT,
    BlockAllocator,
    Plan,
    SimOptions,
    Step,
    blocks_for,
    padded_q_bytes,
    step_slots_positions,
)
from .harness import MEM_KEYS, Arena, Progress, fill_inputs, in_reservation, make_budget, mem_stats, size_kv
from .ranks import ALONE
from .report import gib, size

BF16 = torch.bfloat16


class ReferenceOp:
    """A bound op on CPU tensors: the kernels' argument checks, then the PyTorch reference writing
    a view of the pool's buffer claimed for H live heads, pads never written (zero-once)."""

    def __init__(self, opts: SimOptions, pool: ScratchPool, device):
        self.opts, self.pool, self.device = opts, pool, device
        for mb in range(opts.micro_batches):
            pool.claim(
                opts.heads,
                padded_heads=opts.padded_heads,
                head_dim=opts.head_dim,
                micro_batch=mb,
                device=device,
            )

    def __call__(self, q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, *, micro_batch: int = 0):
        o = self.opts
        q_out = self.pool.view(
            q_in.shape[0],
            padded_heads=o.padded_heads,
            head_dim=o.head_dim,
            micro_batch=micro_batch,
            device=self.device,
        )
        args = (
            q_in,
            kv,
            q_out,
            k_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            o.eps,
            o.block_size,
            CACHE_FORMAT,
        )
        validate.check_qkv(*args)
        reference.qnorm_rope_kv_insert(*args, write_pad_heads=False)
        return q_out


def layer_ops(opts: SimOptions, pool: ScratchPool, device) -> list:
    if device.type != "cuda":
        return [ReferenceOp(opts, pool, device) for _ in range(opts.layers)]
    return [
        bind(
            num_heads=opts.heads,
            padded_heads=opts.padded_heads,
            head_dim=opts.head_dim,
            rope_dim=opts.rope_dim,
            cache_format=CACHE_FORMAT,
            dtype=BF16,
            block_size=opts.block_size,
            pool=pool,
            micro_batches=opts.micro_batches,
            eps=opts.eps,
            device=device,
        )
        for _ in range(opts.layers)
    ]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device, budget) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget.restore()


class StepInputs:
    """Step si's rows in the arena: the rank's real tokens first, then pad rows up to the agreed N
    (position 0, and no slot: slot_mapping holds the real rows only, so len(slot_mapping) < N)."""

    def __init__(self, arena: Arena, step: Step | None, n: int, alloc: BlockAllocator):
        self.real = step.num_tokens if step is not None else 0
        if step is not None:
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            arena.slots[: self.real].copy_(slots_cpu)
            arena.positions[: self.real].copy_(pos_cpu)
        arena.positions[self.real : n].zero_()
        self.slots, self.positions = arena.slots[: self.real], arena.positions[:n]
        self.q, self.kv = arena.q[:n], arena.kv[:n]
        self.kind = step.kind if step is not None else "pad"


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
        for buf in buffers:
            for r0 in range(0, buf.shape[0], 256):  # in slices: no large temporary under a tight budget
                pads = pads and not bool(buf[r0 : r0 + 256, h:].view(torch.int16).any())
    res["pool_pads_zero"] = pads
    res["block_tables"] = {"blocks_used": nb - alloc.num_free, "blocks_needed": plan.needed_blocks}
    res["blocks_outside_tables_zero"] = _untouched_blocks_zero(kv_all, alloc)
    if opts.query_heads is not None and not failed:
        res.update(_check_across_ranks(opts, plan, arena, kv_all, alloc, nb, fmt, device, peers))
    return res


def _used_blocks(alloc: BlockAllocator) -> list[int]:
    return sorted(b for table in alloc.tables.values() for b in table)


def _untouched_blocks_zero(kv_all: torch.Tensor, alloc: BlockAllocator, chunk: int = 1024) -> bool:
    """Whether every block that no block table holds is still all zero (nothing was written outside
    the sequences' blocks: pad rows, skipped slots). In chunks of blocks: no large temporary."""
    nb = kv_all.shape[1]
    used = torch.zeros(nb, dtype=torch.bool)
    used[_used_blocks(alloc)] = True
    for b0 in range(0, nb, chunk):
        written = kv_all[:, b0 : b0 + chunk].any(2).any(0).bool().cpu()
        if bool((written & ~used[b0 : b0 + chunk]).any()):
            return False
    return True


def _needle_records(kv_all, needles, alloc, nb, fmt, head_dim, block_size, device):
    """Data and scale record bytes of the needles' cache entries (in the [L * num_blocks, block_bytes]
    view of the whole cache)."""
    L = kv_all.shape[0]
    gslots = torch.tensor(
        [
            (nd.layer * nb + alloc.table(nd.seq)[nd.pos // block_size]) * block_size + nd.pos % block_size
            for nd in needles
        ],
        dtype=torch.int64,
        device=device,
    )
    return codecs.read_records(kv_all.view(L * nb, kv_all.shape[2]), fmt, head_dim, block_size, gslots)


def _check_needles(opts, needles, prompt_lens, arena, kv_all, alloc, nb, fmt, device) -> dict:
    """Decode the needles' cache entries and compare them (and their q_out rows) with the reference."""
    h, d, bs = opts.heads, opts.head_dim, opts.block_size
    k = len(needles)
    pos = torch.tensor([nd.pos for nd in needles], dtype=torch.int64, device=device)
    got_d, got_s = _needle_records(kv_all, needles, alloc, nb, fmt, d, bs, device)
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
    want_q = reference.q_values(arena.needle_q[:k], pos, arena.cos_sin, opts.eps).to(BF16)
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


def _check_across_ranks(
    opts, plan: Plan, arena, kv_all, alloc, nb, fmt, device, peers, chunk: int = 256
) -> dict:
    """What a rank must share with the others: (1) its cache bytes equal to every other rank of its
    TP group (they hold the same tokens in the same slots); (2) its needles equal to a one-process
    run, with every query head, of the same tokens (the op is row-independent, so running the
    needles' rows alone is running those tokens). Collectives here are TP-group-local; every rank of
    a group reaches them alike (same tables, same needles)."""
    h, d, bs = opts.heads, opts.head_dim, opts.block_size
    out: dict = {}
    tables = {s: alloc.table(s) for s in sorted(alloc.tables)}
    k = len(plan.needles)
    # what each rank holds, seen by all: a group whose ranks disagree skips the collectives that
    # would need them to agree (byte compare: the same blocks; gather: the same needle count)
    group = [peers.gather((tables, k))[r] for r in peers.tp_ranks]
    if peers.tp > 1:
        same = all(t == tables for t, _ in group)
        mismatched = compared = 0
        if same:
            used = torch.tensor(_used_blocks(alloc), dtype=torch.int64, device=device)
            for layer in range(kv_all.shape[0]):  # a layer's chunk of blocks at a time: small temporaries
                for b0 in range(0, used.numel(), chunk):
                    blocks = kv_all[layer].index_select(0, used[b0 : b0 + chunk])
                    mismatched += peers.tp_mismatches(blocks)
                    compared += blocks.shape[0]
        out["tp_cache"] = dict(tables_equal=same, blocks_compared=compared, mismatched_bytes=mismatched)
    full = dict(needles=k, q_equal=0, records_equal=0)
    if k and all(n == k for _, n in group):
        q_full = torch.cat(peers.tp_gather(arena.needle_q[:k].contiguous()), dim=1)  # [k, query_heads, D]
        q_out = torch.empty_like(q_full)  # P = H: a one-process run with every head pads nothing
        cache = torch.zeros((blocks_for(k, bs), kv_all.shape[2]), dtype=torch.uint8, device=device)
        slots = torch.arange(k, dtype=torch.int64, device=device)
        pos = torch.tensor([nd.pos for nd in plan.needles], dtype=torch.int64, device=device)
        qnorm_rope_kv_insert(
            q_full, arena.needle_kv[:k], q_out, cache, slots, pos, arena.cos_sin, opts.eps, bs
        )
        shard = q_out[:, peers.tp_rank * h : (peers.tp_rank + 1) * h]
        q_equal = (shard.view(torch.int16) == arena.needle_qout[:k, :h].view(torch.int16)).flatten(1).all(1)
        got_d, got_s = _needle_records(kv_all, plan.needles, alloc, nb, fmt, d, bs, device)
        want_d, want_s = codecs.read_records(cache, fmt, d, bs, slots)
        records = (got_d == want_d).all(1) & (got_s == want_s).all(1)
        full.update(q_equal=int(q_equal.sum()), records_equal=int(records.sum()))
    out["full_head"] = full
    return out


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
