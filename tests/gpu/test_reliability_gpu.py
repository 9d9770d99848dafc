"""Reliability on the GPU: bad input writes nothing, checked mode never writes outside the cache and
counts exactly, the first-use self-test falls back on a (injected) mismatch, and 10,000 graph
replays with changing inputs stay exact without memory growth."""

from __future__ import annotations

import json
import warnings

import attn_prologue as ap
import pytest
import torch
from attn_prologue import dispatch, ops, reference, selftest
from attn_prologue.errors import InputError, ScratchError
from attn_prologue.variants import ArchFamily, generated, parse_name

from ..support.bad_inputs import (
    BOUND_OVERLAPS,
    BS,
    CASES,
    CUDA_ONLY,
    IN_PLACE_OVERLAPS,
    KV_ARGS,
    KV_OVERLAPS,
    OVERLAPS,
    D,
    H,
    N,
    P,
    snapshot,
    unchanged,
    valid,
    valid_kv,
)

pytestmark = pytest.mark.gpu


def call(args):
    ap.qnorm_rope_kv_insert(
        args["q_in"],
        args["kv"],
        args["q_out"],
        args["k_cache"],
        args["slot_mapping"],
        args["positions"],
        args["cos_sin_cache"],
        args["eps"],
        args["block_size"],
        args["cache_format"],
    )


@pytest.mark.parametrize("name", sorted({**CASES, **CUDA_ONLY}))
def test_bad_input_on_gpu_raises_and_writes_nothing(name):
    edit, error = {**CASES, **CUDA_ONLY}[name]
    args = valid("cuda")
    call(args)  # the valid call binds the kernel first (the fast path is then what is tested)
    args = valid("cuda")
    edit(args)
    before = snapshot(args)
    with pytest.raises(error):
        call(args)
    torch.cuda.synchronize()
    assert unchanged(before, args) == []


BOUND_ARGS = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")


def _bound_cases() -> list[str]:
    """The bad-input cases that only change what a bound op takes per call."""
    names = []
    for name, (edit, _) in sorted({**CASES, **CUDA_ONLY}.items()):
        a = valid("cpu")
        b = dict(a)
        edit(b)
        if all(k in BOUND_ARGS for k in b if b[k] is not a[k]):
            names.append(name)
    return names


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_overlapping_buffers_are_refused_where_arguments_are_validated(name):
    """The first call of a shape validates everything, overlap between written buffers and inputs
    included, before anything is written (a fresh runtime: no fast path cached)."""
    edit, error = OVERLAPS[name]
    args = valid("cuda")
    edit(args)
    before = snapshot(args)
    with pytest.raises(error, match="overlaps|apart|smaller than"):
        ops.qnorm_rope_kv_insert(
            *(args[k] for k in ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")),
            args["eps"], args["block_size"], args["cache_format"], runtime=dispatch.Runtime(),
        )  # fmt: skip
    torch.cuda.synchronize()
    assert unchanged(before, args) == []


QKV_ARGS = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
            "cache_format")  # fmt: skip


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_overlap_on_the_fast_path_of_a_cached_shape_raises_and_writes_nothing(name):
    """The second call of a shape takes its fast path, whose per-call check refuses an overlap (a
    written buffer with itself, with the other or with an input) before anything is written."""
    edit, error = OVERLAPS[name]
    rt = dispatch.Runtime()
    args = valid("cuda")
    ops.qnorm_rope_kv_insert(*(args[k] for k in QKV_ARGS), runtime=rt)  # validates and caches the shape
    args = valid("cuda")
    edit(args)
    before = snapshot(args)
    with pytest.raises(error, match="overlaps|apart|smaller than"):
        ops.qnorm_rope_kv_insert(*(args[k] for k in QKV_ARGS), runtime=rt)
    torch.cuda.synchronize()
    assert len(rt.calls) == 1, "the call did not reach the cached shape's fast path"
    assert unchanged(before, args) == []


@pytest.mark.parametrize("name", sorted(KV_OVERLAPS))
def test_kv_overlap_on_the_fast_path_raises_and_writes_nothing(name):
    edit, error = KV_OVERLAPS[name]
    rt = dispatch.Runtime()
    args = valid_kv("cuda")
    ops.kv_rope_insert(*(args[k] for k in KV_ARGS[:-1]), norm_weight=args["norm_weight"], runtime=rt)
    args = valid_kv("cuda")
    edit(args)
    before = snapshot(args)
    with pytest.raises(error, match="overlaps|smaller than"):
        ops.kv_rope_insert(*(args[k] for k in KV_ARGS[:-1]), norm_weight=args["norm_weight"], runtime=rt)
    torch.cuda.synchronize()
    assert len(rt.calls) == 1 and unchanged(before, args) == []


@pytest.mark.parametrize("name", sorted(BOUND_OVERLAPS))
def test_overlap_into_a_bound_op_raises_and_writes_nothing(name):
    """An input inside the op's scratch buffer or inside k_cache (the same k_cache object as the
    last call's), or a new k_cache or cos_sin_cache that overlaps, is refused before any write."""
    edit, error = BOUND_OVERLAPS[name]
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1)
    pool.lock()
    op = ap.bind(num_heads=H, padded_heads=P, head_dim=D, block_size=BS, pool=pool)
    args = valid("cuda")
    op(*[args[k] for k in BOUND_ARGS])
    buffer = pool.buffer(padded_heads=P, head_dim=D)
    args = valid("cuda") | {
        "k_cache": args["k_cache"],
        "cos_sin_cache": args["cos_sin_cache"],
    }  # same objects
    edit(args, buffer)
    before = dict(snapshot(args), q_scratch=buffer.clone())
    with pytest.raises(error, match="overlaps|smaller than|alias"):
        op(*[args[k] for k in BOUND_ARGS])
    torch.cuda.synchronize()
    assert unchanged(before, dict(args, q_scratch=buffer)) == []


@pytest.mark.parametrize("name", sorted(IN_PLACE_OVERLAPS))
def test_overlap_with_q_in_written_in_place_raises_and_writes_nothing(name):
    edit, error = IN_PLACE_OVERLAPS[name]
    op = ap.bind(num_heads=H, head_dim=D, block_size=BS)
    args = valid("cuda")
    op(*[args[k] for k in BOUND_ARGS])
    args = valid("cuda") | {"k_cache": args["k_cache"], "cos_sin_cache": args["cos_sin_cache"]}
    edit(args)
    before = snapshot(args)
    with pytest.raises(error, match="overlaps"):
        op(*[args[k] for k in BOUND_ARGS])
    torch.cuda.synchronize()
    assert unchanged(before, args) == []


@pytest.mark.parametrize("name", _bound_cases())
def test_bad_input_to_bound_op_raises_and_writes_nothing(name):
    """The bound op's per-call path checks little itself (the compiled function checks the rest):
    with the cache of its last call, every bad argument still raises before anything is written."""
    edit, error = {**CASES, **CUDA_ONLY}[name]
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1)
    pool.lock()
    op = ap.bind(num_heads=H, padded_heads=P, head_dim=D, block_size=BS, pool=pool)
    args = valid("cuda")
    op(*[args[k] for k in BOUND_ARGS])
    edit(args)
    buffer = pool.buffer(padded_heads=P, head_dim=D)
    buffer.fill_(float("nan"))
    before = dict(snapshot(args), q_scratch=buffer.clone())
    with pytest.raises(error):
        op(*[args[k] for k in BOUND_ARGS])
    torch.cuda.synchronize()
    assert unchanged(before, dict(args, q_scratch=buffer)) == []


def test_bound_op_refuses_too_many_tokens_and_unknown_micro_batch():
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N - 1, padded_heads=P, head_dim=D, micro_batches=1)
    pool.lock()
    op = ap.bind(num_heads=H, padded_heads=P, head_dim=D, block_size=BS, pool=pool)
    args = valid("cuda")
    small = {
        k: (v[: N - 1] if k in ("q_in", "kv", "slot_mapping", "positions") else v) for k, v in args.items()
    }
    op(*[small[k] for k in BOUND_ARGS])  # fits; binds the cache
    buffer = pool.buffer(padded_heads=P, head_dim=D)
    buffer.fill_(float("nan"))
    before = dict(snapshot(args), q_scratch=buffer.clone())
    with pytest.raises(ScratchError):
        op(*[args[k] for k in BOUND_ARGS])
    for mb in (1, -1):
        with pytest.raises(InputError):
            op(*[small[k] for k in BOUND_ARGS], micro_batch=mb)
    torch.cuda.synchronize()
    assert unchanged(before, dict(args, q_scratch=buffer)) == []


@pytest.mark.parametrize("entry", ["function", "torch op", "bound op", "kv-only"])
def test_out_of_range_ids_are_skipped_by_default_on_every_entry_point(entry):
    """No flag: slots at and far past the cache's end, negative positions and positions past the
    table are skipped (KV) or zeroed (Q) and counted; guard regions around the cache and every byte
    the reference (which skips the same way) does not write are unchanged."""
    d, bs, blocks, guard, h, n = 512, 64, 8, 2, 8, 48
    g = torch.Generator(device="cuda").manual_seed(91)
    whole = torch.randint(
        0, 256, (blocks + 2 * guard, bs * 584), generator=g, device="cuda", dtype=torch.uint8
    )
    want_whole = whole.clone()
    k_cache, want_cache = whole[guard : guard + blocks], want_whole[guard : guard + blocks]
    q_in = torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
    kv = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    theta = torch.rand(128, 32, generator=g, device="cuda")
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    slots = torch.randperm(blocks * bs, generator=g, device="cuda")[:n].contiguous()
    pos = torch.randint(0, 128, (n,), generator=g, device="cuda")
    bad_slots = {1: blocks * bs, 4: 2**36}
    bad_pos = {6: 128, 9: -1, 12: -(2**40)}
    for i, v in bad_slots.items():
        slots[i] = v
    for i, v in bad_pos.items():
        pos[i] = v
    q_out = torch.full((n, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    q_src = q_in.clone()  # the bound op writes Q in place (P == H)
    want_q = q_src.clone() if entry == "bound op" else q_out.clone()
    err = dispatch.default_runtime().errors_buffer(q_in.device)
    err.zero_()
    if entry == "function":
        ap.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs)
    elif entry == "torch op":
        torch.ops.attn_prologue.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs)
    elif entry == "bound op":
        q_out = ap.bind(num_heads=h, head_dim=d, block_size=bs)(q_in, kv, k_cache, slots, pos, cs)
    else:
        ap.kv_rope_insert(kv, k_cache, slots, pos, cs, bs)
    torch.cuda.synchronize()
    kv_rows, q_tokens = err.tolist()
    assert kv_rows == len(bad_slots) + len(bad_pos)
    assert q_tokens == (0 if entry == "kv-only" else len(bad_pos))
    if entry == "kv-only":
        reference.kv_rope_insert(kv, want_cache, slots, pos, cs, bs)
    else:
        reference.qnorm_rope_kv_insert(q_src, kv, want_q, want_cache, slots, pos, cs, 1e-6, bs)
        assert torch.equal(q_out.view(torch.int16), want_q.view(torch.int16))
        assert not q_out[list(bad_pos)].any()  # Q rows of out-of-range positions are zeros
    assert torch.equal(whole, want_whole)  # guards, skipped rows and the written records


def test_checked_mode_guard_regions_and_exact_count():
    """The cache is a view in the middle of a larger buffer; out-of-range slots and positions must
    leave the guard regions (and the cache) untouched apart from the valid rows."""
    d, bs, blocks, guard = 512, 64, 8, 3
    g = torch.Generator(device="cuda").manual_seed(77)
    whole = torch.randint(
        0, 256, (blocks + 2 * guard, bs * 584), generator=g, device="cuda", dtype=torch.uint8
    )
    before = whole.clone()
    k_cache = whole[guard : guard + blocks]
    n = 64
    q_in = torch.randn(n, 8, d, generator=g, device="cuda").bfloat16()
    kv = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    q_out = torch.zeros(n, 8, d, device="cuda", dtype=torch.bfloat16)
    theta = torch.rand(256, 32, generator=g, device="cuda")
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    slots = torch.randperm(blocks * bs, generator=g, device="cuda")[:n].contiguous()
    pos = torch.randint(0, 256, (n,), generator=g, device="cuda")
    bad_slots = {2: blocks * bs, 5: blocks * bs + guard * bs - 1, 11: 10**9}
    bad_pos = {7: 256, 13: 10**6, 17: -5}
    for i, v in bad_slots.items():
        slots[i] = v
    for i, v in bad_pos.items():
        pos[i] = v
    err = dispatch.default_runtime().errors_buffer(q_in.device)
    err.zero_()
    ops.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs, checked=True)
    torch.cuda.synchronize()
    assert err.tolist() == [len(bad_slots) + len(bad_pos), len(bad_pos)]
    assert torch.equal(whole[:guard], before[:guard]) and torch.equal(
        whole[guard + blocks :], before[guard + blocks :]
    )
    ok = torch.ones(n, dtype=torch.bool, device="cuda")
    ok[list(bad_slots) + list(bad_pos)] = False
    want = before[guard : guard + blocks].clone()
    good = ok.nonzero().flatten()
    vals = reference.kv_values(kv[good], pos[good], cs)
    reference.insert_kv(want, ap.get_format("fp8_ds_mla"), vals, slots[good], bs)
    assert torch.equal(k_cache, want)


def call_on(runtime, args):
    ops.qnorm_rope_kv_insert(
        *(args[k] for k in ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")),
        args["eps"], args["block_size"], args["cache_format"], runtime=runtime,
    )  # fmt: skip


def test_self_test_fallback_with_injected_fault(monkeypatch, tmp_path):
    # "always": SM90 variants have no distinct fallback, so the machinery is exercised on themselves
    monkeypatch.setenv(selftest.ENV_MODE, "always")
    monkeypatch.setenv(selftest.ENV_FAULT, "1")
    records = selftest.Records(tmp_path)
    rt = dispatch.Runtime(selftest_records=records)
    args = valid("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call_on(rt, args)
    msgs = [str(w.message) for w in caught if issubclass(w.category, selftest.SelfTestWarning)]
    assert msgs and "FAILED" in msgs[0] and "Falling back" in msgs[0]
    # the bound (fallback) kernel is correct
    ref = valid("cuda")
    reference.qnorm_rope_kv_insert(
        *(ref[k] for k in ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")),
        1e-6, ref["block_size"],
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(args["k_cache"], ref["k_cache"])
    # a verdict on an injected fault holds for this process (no second test) and is never recorded
    assert not (tmp_path / selftest.RECORD_NAME).exists()
    monkeypatch.setattr(selftest, "run", lambda *a, **k: pytest.fail("self-test ran again in this process"))
    call_on(dispatch.Runtime(selftest_records=records), valid("cuda"))


def test_a_self_test_verdict_is_recorded_for_later_processes(monkeypatch, tmp_path):
    monkeypatch.setenv(selftest.ENV_MODE, "always")
    monkeypatch.delenv(selftest.ENV_FAULT, raising=False)
    call_on(dispatch.Runtime(selftest_records=selftest.Records(tmp_path)), valid("cuda"))
    record = json.loads((tmp_path / selftest.RECORD_NAME).read_text())
    entries = [e for env in record.values() for e in env.values()]
    assert entries and all(e["ok"] and e["use"].endswith(("_sm90", "_portable")) for e in entries)
    monkeypatch.setattr(
        selftest, "run", lambda *a, **k: pytest.fail("self-test ran again despite the record")
    )
    call_on(dispatch.Runtime(selftest_records=selftest.Records(tmp_path)), valid("cuda"))


@pytest.mark.parametrize("name", sorted(n for n in generated() if parse_name(n).arch is ArchFamily.SM90))
def test_self_test_passes_on_every_sm90_variant(name, tmp_path):
    """The self-test's inputs (random rows and the edge rows: zeros, subnormals, below the amax floor,
    UE8M0 boundaries, every E2M1 tie, +-Inf, NaN) give no false alarm on a path the rest of the
    suite verifies: every SM90 module passes it, run through the dispatcher's own arena."""
    rt = dispatch.Runtime(selftest_records=selftest.Records(tmp_path))
    v = parse_name(name)
    launcher = rt.launcher(v, v.arch.default_config, 0)
    ok, detail = selftest.run(launcher, rt.errors_buffer(0), rt.selftest_arena(0))
    assert ok, detail
    assert "edge cases" in detail


def test_endurance_10000_graph_replays():
    h, p, n, d, bs = 16, 64, 128, 512, 64
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=n, padded_heads=p, head_dim=d, micro_batches=1)
    pool.lock()
    op = ap.bind(num_heads=h, padded_heads=p, block_size=bs, pool=pool)
    g = torch.Generator(device="cuda").manual_seed(5)
    theta = torch.rand(4096, 32, generator=g, device="cuda") * 6.28
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    q_in = torch.randn(n, h, d, generator=g, device="cuda").bfloat16()
    kv = torch.randn(n, d, generator=g, device="cuda").bfloat16()
    slots = torch.randperm(32 * bs, generator=g, device="cuda")[:n].contiguous()
    pos = torch.randint(0, 4096, (n,), generator=g, device="cuda")
    k_cache = torch.zeros(32, bs * 584, dtype=torch.uint8, device="cuda")
    op(q_in, kv, k_cache, slots, pos, cs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = op(q_in, kv, k_cache, slots, pos, cs)
    torch.cuda.synchronize()
    stats0 = None
    checks = 0
    for i in range(10_000):
        q_in.normal_(generator=g)
        kv.normal_(generator=g)
        pos.random_(0, 4096, generator=g)
        graph.replay()
        if i % 1000 == 999:
            want_q = torch.zeros(n, p, d, dtype=torch.bfloat16, device="cuda")
            want_cache = torch.zeros_like(k_cache)
            reference.qnorm_rope_kv_insert(q_in, kv, want_q, want_cache, slots, pos, cs, 1e-6, bs)
            torch.cuda.synchronize()
            assert torch.equal(q_out.view(torch.int16), want_q.view(torch.int16)), f"replay {i}"
            assert torch.equal(k_cache, want_cache), f"replay {i}"
            checks += 1
            del want_q, want_cache
            if stats0 is None:  # after the first check: the reference's temporaries are cached by then
                torch.cuda.synchronize()
                stats0 = torch.cuda.memory_stats()
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    assert checks == 10
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.allocated"):
        assert stats1[key] == stats0[key], key
