"""The native fast path on the GPU: every entry point's C path writes the reference's bytes, on the
stream it is called on, under CUDA-graph capture, and refuses what the Python path refuses.

Each case calls an entry point twice on fresh poisoned outputs: the first call validates and makes
the shape's plan (Python), the second runs the plan (C) with the Python validation made to fail if
it is reached, so a plan that refused or was never made fails the test instead of passing through
the Python path."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue import native, torch_op, validate
from attn_prologue.errors import InputError
from attn_prologue.scratch import ScratchPool

from .cases import Case, clone_outputs, compare, describe_mismatch, make_inputs, run_reference

pytestmark = pytest.mark.gpu

CASES = [
    Case(n=5, h=8, p=16),
    Case(n=37, h=16, p=16, in_place=True),
    Case(n=9, h=4, p=8, head_dim=128, cache_format="fp8_token", q_fp8=True),
    Case(n=20, h=8, p=8, head_dim=128, cache_format="mxfp4", negative_every=3, slot_dtype="int32"),
    Case(n=300, h=8, p=8, cache_format="nvfp4_dsv4", page_align=576),
    Case(n=33, op="kv", cache_format="mxfp8", block_size=256, slot_dtype="int32"),
    Case(n=64, op="kv", cache_format="nvfp4_v41", compress_ratio=4, max_pos=512),
    Case(n=17, op="kv_norm", head_dim=128, cache_format="fp8_token", m=12),
]


@pytest.fixture(scope="module", autouse=True)
def native_kernels():
    assert native.fastpath() is not None, "the native fast path did not build or load here"
    assert torch_op.load_native_kernels(build=True) is not None or torch_op.cuda_kernels() == "C++"
    assert torch_op.cuda_kernels() == "C++"


class PythonPathReached(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise PythonPathReached("the call left the native path for the Python validation")


def _one_call(x, c):
    if c.op == "qkv":
        ap.qnorm_rope_kv_insert(x.q_in, x.kv, x.q_out, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache,
                                1e-6, c.block_size, c.cache_format, x.kv_scale, x.q_scale)  # fmt: skip
    else:
        ap.kv_rope_insert(x.kv, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, c.block_size,
                          c.cache_format, x.norm_weight, 1e-6, x.kv_scale, compress_ratio=c.compress_ratio)  # fmt: skip


def _torch_op(x, c):
    if c.op == "qkv":
        torch.ops.attn_prologue.qnorm_rope_kv_insert(
            x.q_in, x.kv, x.q_out, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, 1e-6, c.block_size,
            c.cache_format, x.kv_scale, x.q_scale)  # fmt: skip
    else:
        torch.ops.attn_prologue.kv_rope_insert(
            x.kv, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, c.block_size, c.cache_format,
            x.norm_weight, 1e-6, x.kv_scale, "", c.compress_ratio)  # fmt: skip


def _check(got, want):
    diff = compare(got, want)
    assert all(v == 0 for v in diff.values()), describe_mismatch(got, want)


@pytest.mark.parametrize("entry", ["one-call", "torch op"])
@pytest.mark.parametrize("c", CASES, ids=str)
def test_second_call_runs_the_native_plan_and_matches_the_reference(c, entry, monkeypatch):
    call = _one_call if entry == "one-call" else _torch_op
    x = make_inputs(c)
    want = run_reference(x)
    first = clone_outputs(x)
    call(first, c)  # validates, makes the plan
    torch.cuda.synchronize()
    _check(first, want)
    slow_before = dict(torch_op.SLOW_CALLS)
    monkeypatch.setattr(validate, "check_qkv", _refuse)
    monkeypatch.setattr(validate, "check_kv", _refuse)
    second = clone_outputs(x)
    call(second, c)
    torch.cuda.synchronize()
    _check(second, want)
    assert dict(torch_op.SLOW_CALLS) == slow_before, "the torch op took its Python path"


def _bind(x, c, pool=None):
    if c.op == "qkv":
        return ap.bind(num_heads=c.h, padded_heads=c.p, head_dim=c.head_dim, cache_format=c.cache_format,
                       block_size=c.block_size, pool=pool, kv_scale=x.kv_scale, q_scale=x.q_scale)  # fmt: skip
    return ap.bind_kv(head_dim=c.head_dim, cache_format=c.cache_format, block_size=c.block_size,
                      norm_weight=x.norm_weight, kv_scale=x.kv_scale, compress_ratio=c.compress_ratio)  # fmt: skip


@pytest.mark.parametrize("c", CASES, ids=str)
def test_bound_ops_run_the_native_plan_and_match_the_reference(c, monkeypatch):
    x = make_inputs(c)
    want = run_reference(x)
    pool = None
    if c.op == "qkv" and not c.in_place:
        pool = ScratchPool()
        pool.reserve(max_tokens=c.n + 8, padded_heads=c.p, head_dim=c.head_dim, micro_batches=1,
                     dtype=torch.float8_e4m3fn if c.q_fp8 else torch.bfloat16)  # fmt: skip
    op = _bind(x, c, pool)
    got = clone_outputs(x)  # one cache (and q_in) for both calls, as in serving: reset in between
    for _ in range(2):
        got.extra["k_storage"].copy_(x.extra["k_storage"])
        if c.op == "qkv":
            if c.in_place:
                got.q_in.copy_(x.q_in)
            else:
                got.q_out.copy_(x.q_out)
            out = op(got.q_in, got.kv, got.k_cache, got.slot_mapping, got.positions, got.cos_sin_cache)
            if not c.in_place:
                assert out.shape[0] == c.n
                got.q_out[: c.n].copy_(out)  # the scratch view, next to the reference's q_out
        else:
            op(got.kv, got.k_cache, got.slot_mapping, got.positions, got.cos_sin_cache)
        torch.cuda.synchronize()
        _check(got, want)
        assert op._fast is not None, "no native plan after the first call"
        monkeypatch.setattr(validate, "check_qkv", _refuse)  # the second call: the plan only...
        monkeypatch.setattr(validate, "check_kv", _refuse)
        monkeypatch.setattr(op, "_full_check", _refuse)  # ...no new full check either


@pytest.mark.parametrize("entry", ["one-call", "torch op", "bound op"])
def test_native_calls_run_on_the_callers_stream(entry):
    """On a side stream busy for ~50 ms, q_in is refilled and the op called: a kernel launched on
    another stream would read the old q_in."""
    c = Case(n=8, h=8, p=8)
    x = make_inputs(c)
    op = _bind(x, c) if entry == "bound op" else None
    run = {"one-call": lambda y: _one_call(y, c), "torch op": lambda y: _torch_op(y, c),
           "bound op": lambda y: op(y.q_in, y.kv, y.k_cache, y.slot_mapping, y.positions, y.cos_sin_cache)}[entry]  # fmt: skip
    run(clone_outputs(x))  # the first call makes the plan
    fresh = torch.randn_like(x.q_in, dtype=torch.float32).to(x.q_in.dtype)
    got = clone_outputs(x)
    if entry == "bound op":
        got.q_in = got.q_out = x.q_in.clone()  # in place: q_out is q_in
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        got.q_in.copy_(fresh)
        run(got)
    side.synchronize()
    x.q_in = fresh.clone()
    if entry == "bound op":
        x.case = Case(n=8, h=8, p=8, in_place=True)
        x.q_out = x.q_in
    _check(got, run_reference(x))


@pytest.mark.parametrize("entry", ["one-call", "torch op", "bound op"])
def test_native_calls_capture_into_a_cuda_graph(entry):
    c = Case(n=16, h=8, p=8)
    x = make_inputs(c)
    got = clone_outputs(x)
    if entry == "bound op":  # in place: q_out is q_in
        got.q_in = got.q_out = x.q_in.clone()
    op = _bind(x, c) if entry == "bound op" else None
    run = {"one-call": lambda: _one_call(got, c), "torch op": lambda: _torch_op(got, c),
           "bound op": lambda: op(got.q_in, got.kv, got.k_cache, got.slot_mapping, got.positions, got.cos_sin_cache)}[entry]  # fmt: skip
    keep = got.q_in.clone()
    run()  # plan made outside the capture
    got.q_in.copy_(keep)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    x.extra["k_storage"].copy_(got.extra["k_storage"])  # what the warm-up call left in the cache
    for seed in range(3):
        fresh = make_inputs(Case(n=16, h=8, p=8, seed=seed + 1))
        got.q_in.copy_(fresh.q_in)
        got.kv.copy_(fresh.kv)
        graph.replay()
        torch.cuda.synchronize()
        x.q_in, x.kv = fresh.q_in.clone(), fresh.kv.clone()
        if entry == "bound op":
            x.case, x.q_out = Case(n=16, h=8, p=8, in_place=True), x.q_in
        want = run_reference(x)
        assert (got.extra["k_storage"] == want.extra["k_storage"]).all()
        assert (got.q_out.view(torch.uint8) == want.q_out.view(torch.uint8)).all()
        x.extra["k_storage"].copy_(got.extra["k_storage"])  # the next replay starts from this cache


def test_bound_kv_refuses_an_input_inside_its_cache_and_writes_nothing():
    c = Case(n=8, op="kv")
    x = make_inputs(c)
    op = _bind(x, c)
    op(x.kv, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache)  # plan made
    assert op._fast is not None
    inside = x.k_cache.view(-1)[: x.kv.numel() * 2].view(torch.bfloat16).view(x.kv.shape)
    before = x.extra["k_storage"].clone()
    with pytest.raises(InputError, match="overlaps"):
        op(inside, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache)
    torch.cuda.synchronize()
    assert torch.equal(before, x.extra["k_storage"])
