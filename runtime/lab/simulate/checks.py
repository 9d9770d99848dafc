"""The checks after the pool pass of `simulate`: the needles' cache entries and q_out rows against
the reference, the blocks no table holds still zero, and across ranks the TP group's cache bytes and
a one-process run with every query head."""

from __future__ import annotations

import torch

from ... import codecs, reference
from ...ops import qnorm_rope_kv_insert
from .engine import BlockAllocator, Plan, blocks_for
from .layers import BF16


def _used_blocks(alloc: BlockAllocator) -> list[int]:
    return sorted(b for table in alloc.tables.values() for b in table)


def untouched_blocks_zero(kv_all: torch.Tensor, alloc: BlockAllocator, chunk: int = 1024) -> bool:
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


def check_needles(opts, needles, prompt_lens, arena, kv_all, alloc, nb, fmt, device) -> dict:
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


def check_across_ranks(
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
