"""Overlap between what the op writes and anything else is refused on every path, before anything is
written: the pure-int check the fast paths run (overlap.disjoint) agrees with the full validation's
check_disjoint, the fast paths' byte ranges are the full validation's, and the one-call functions'
and bound ops' fast paths (run on CPU with a stub kernel) refuse an overlapping call of a shape they
have already validated. The GPU side of the same: tests/gpu/test_reliability_gpu.py."""

from __future__ import annotations

import random

import attn_prologue.torch_op  # noqa: F401  (registers torch.ops.attn_prologue)
import pytest
import torch
from attn_prologue import ops, overlap, validate
from attn_prologue.errors import InputError

from .support.bad_inputs import (
    BOUND_OVERLAPS,
    BS,
    IN_PLACE_OVERLAPS,
    KV_ARGS,
    KV_OVERLAPS,
    OVERLAPS,
    H,
    N,
    P,
    snapshot,
    unchanged,
    valid,
    valid_kv,
)
from .support.stub_kernels import StubRuntime, stub_bind

pytestmark = pytest.mark.tvm_ffi  # CI runs this file under every pinned TVM-FFI (.ci/run)

QKV_ARGS = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
            "cache_format")  # fmt: skip
BOUND_ARGS = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")


# ---- the check on ints ----------------------------------------------------------------------------
def test_disjoint_on_ints():
    w, v = (100, 200), (300, 400)
    assert overlap.disjoint(*w, *v, ((0, 100), (200, 300), (400, 500), (0, 0)))  # touching is apart
    assert overlap.disjoint(*w, *v, ((0, 1000), (0, 1000))[:0])
    assert overlap.disjoint(*w, 0, 0, ((300, 400),))  # (0, 0): no second written buffer
    assert overlap.disjoint(*w, *v, ((0, 50), (10, 60)))  # inputs may overlap each other
    for bad in ((0, 101), (199, 250), (150, 160), (0, 1000), (250, 301), (399, 401)):
        assert not overlap.disjoint(*w, *v, ((0, 50), bad)), bad
    assert not overlap.disjoint(100, 301, *v, ())  # the written buffers overlap each other
    assert not overlap.disjoint(*v, *w, ((150, 151),))  # whichever is given first


def _random_view(buf: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A random strided view (1-3 dims, some empty, some with zero or overlapping strides)."""
    while True:
        dims = rng.randint(1, 3)
        shape = [rng.choice((0, 1, 1, 2, 3, 5)) for _ in range(dims)]
        stride = [rng.choice((0, 1, 2, 3, 7, 16, 40)) for _ in range(dims)]
        span = sum((s - 1) * st for s, st in zip(shape, stride) if s) + 1
        if span <= buf.numel():
            return buf.as_strided(shape, stride, rng.randrange(0, buf.numel() - span + 1))


def test_disjoint_agrees_with_check_disjoint_on_random_views():
    """The fast paths' verdict on byte ranges is check_disjoint's, over random views of shared buffers
    (two written, three inputs), empty and self-overlapping views included."""
    rng = random.Random(17)
    bufs = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    outcomes = set()
    for _ in range(3000):
        views = [_random_view(rng.choice(bufs), rng) for _ in range(5)]
        written = dict(zip(("a", "b"), views[:2]))
        inputs = dict(zip(("x", "y", "z"), views[2:]))
        try:
            overlap.check_disjoint(written, inputs)
            expected = True
        except InputError:
            expected = False
        ranges = [overlap.byte_range(t) for t in views]
        assert overlap.disjoint(*ranges[0], *ranges[1], tuple(ranges[2:])) == expected, views
        outcomes.add(expected)
    assert outcomes == {True, False}


# ---- the fast paths' byte ranges are the full validation's ----------------------------------------
def _qkv_disjoint(a: dict) -> bool:
    n, h, d = a["q_in"].shape
    n_out, p, _ = a["q_out"].shape
    kb, kw = a["k_cache"].shape
    tensors = [a[k] for k in QKV_ARGS[:7]]
    return ops.qkv_disjoint(*tensors, None, None, n, h, d, n_out, p, N, kb, kw, BS * 584)


def _validates(call) -> bool:
    try:
        call()
    except InputError:
        return False
    return True


@pytest.mark.parametrize("name", ["valid", "in place", *sorted(OVERLAPS)])
def test_qkv_fast_path_check_equals_the_full_validation(name):
    a = valid("cpu")
    if name == "in place":
        a["q_in"] = a["q_out"] = a["q_out"][:, :H].contiguous()
    elif name != "valid":
        OVERLAPS[name][0](a)
    full = _validates(lambda: validate.check_qkv(*(a[k] for k in QKV_ARGS)))
    assert full == (name in ("valid", "in place"))
    assert _qkv_disjoint(a) == full


@pytest.mark.parametrize("name", ["valid", *sorted(KV_OVERLAPS)])
def test_kv_fast_path_check_equals_the_full_validation(name):
    a = valid_kv("cpu")
    if name != "valid":
        KV_OVERLAPS[name][0](a)
    full = _validates(
        lambda: validate.check_kv(*(a[k] for k in KV_ARGS[:-1]), norm_weight=a["norm_weight"], eps=a["eps"])
    )
    assert full == (name == "valid")
    kb, kw = a["k_cache"].shape
    tensors = [a[k] for k in ("kv", "norm_weight", "k_cache", "slot_mapping", "positions", "cos_sin_cache")]
    assert ops.kv_disjoint(*tensors, None, N, 512, N, N, kb, kw, BS * 584) == full


# ---- the CPU entry points (torch ops: validation, then the reference) --------------------------------
@pytest.mark.parametrize("name", sorted(KV_OVERLAPS))
def test_kv_torch_op_on_cpu_refuses_overlap_and_writes_nothing(name):
    a = valid_kv("cpu")
    KV_OVERLAPS[name][0](a)
    before = snapshot(a)
    with pytest.raises(InputError, match="overlaps|smaller than"):
        torch.ops.attn_prologue.kv_rope_insert(*(a[k] for k in KV_ARGS), a["eps"])
    assert unchanged(before, a) == []


# ---- the fast paths, wired: a stub kernel on CPU ---------------------------------------------------
def _count_full_checks(monkeypatch) -> list:
    seen = []
    for name in ("check_qkv", "check_kv"):
        real = getattr(validate, name)
        monkeypatch.setattr(validate, name, lambda *a, _real=real, **k: (seen.append(1), _real(*a, **k))[1])
    return seen


@pytest.mark.parametrize("name", sorted(OVERLAPS))
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_one_call_fast_path_refuses_overlap_and_launches_nothing(name, native):
    rt = StubRuntime(native=native)
    args = valid("cpu")
    ops.qnorm_rope_kv_insert(*(args[k] for k in QKV_ARGS), runtime=rt)  # validates, caches the shape
    assert rt.kernel.calls == 1 and len(rt.calls) == 1
    assert (next(iter(rt.calls.values())).native is not None) == native
    args = valid("cpu")
    OVERLAPS[name][0](args)
    before = snapshot(args)
    with pytest.raises(InputError, match="overlaps|apart|smaller than"):
        ops.qnorm_rope_kv_insert(*(args[k] for k in QKV_ARGS), runtime=rt)
    assert rt.kernel.calls == 1, "the kernel was launched"
    assert len(rt.calls) == 1, "the call did not reach the cached shape's fast path"
    assert unchanged(before, args) == []


@pytest.mark.parametrize("name", sorted(KV_OVERLAPS))
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_kv_fast_path_refuses_overlap_and_launches_nothing(name, native):
    rt = StubRuntime(native=native)
    args = valid_kv("cpu")
    ops.kv_rope_insert(*(args[k] for k in KV_ARGS[:-1]), norm_weight=args["norm_weight"], runtime=rt)
    assert rt.kernel.calls == 1 and len(rt.calls) == 1
    assert (next(iter(rt.calls.values())).native is not None) == native
    args = valid_kv("cpu")
    KV_OVERLAPS[name][0](args)
    before = snapshot(args)
    with pytest.raises(InputError, match="overlaps|smaller than"):
        ops.kv_rope_insert(*(args[k] for k in KV_ARGS[:-1]), norm_weight=args["norm_weight"], runtime=rt)
    assert rt.kernel.calls == 1 and len(rt.calls) == 1
    assert unchanged(before, args) == []


def _bound(in_place: bool, native: bool = False):
    rt = StubRuntime(native=native)
    heads = dict(num_heads=H) if in_place else dict(num_heads=H, padded_heads=P, max_tokens=N)
    return stub_bind(runtime=rt, block_size=BS, **heads), rt.kernel


@pytest.mark.parametrize("name", sorted(BOUND_OVERLAPS))
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_bound_op_refuses_overlap_and_launches_nothing(name, native):
    op, kernel = _bound(in_place=False, native=native)
    args = valid("cpu")
    op(*(args[k] for k in BOUND_ARGS))
    assert (op._fast is not None) == native
    scratch = op.pool.buffer(padded_heads=P, head_dim=512)
    args = valid("cpu") | {"k_cache": args["k_cache"], "cos_sin_cache": args["cos_sin_cache"]}  # same objects
    BOUND_OVERLAPS[name][0](args, scratch)
    before = dict(snapshot(args), scratch=scratch.clone())
    with pytest.raises(InputError, match="overlaps|smaller than|alias"):
        op(*(args[k] for k in BOUND_ARGS))
    assert kernel.calls == 1, "the kernel was launched"
    assert unchanged(before, dict(args, scratch=scratch)) == []
    fresh = valid("cpu")
    op(*(fresh[k] for k in BOUND_ARGS))  # and the op still serves a valid call
    assert kernel.calls == 2


@pytest.mark.parametrize("name", sorted(IN_PLACE_OVERLAPS))
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_bound_op_in_place_refuses_overlap_with_q_in(name, native):
    op, kernel = _bound(in_place=True, native=native)
    args = valid("cpu")
    op(*(args[k] for k in BOUND_ARGS))
    assert (op._fast is not None) == native
    args = valid("cpu") | {"k_cache": args["k_cache"], "cos_sin_cache": args["cos_sin_cache"]}
    IN_PLACE_OVERLAPS[name][0](args)
    before = snapshot(args)
    with pytest.raises(InputError, match="overlaps"):
        op(*(args[k] for k in BOUND_ARGS))
    assert kernel.calls == 1 and unchanged(before, args) == []


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_valid_calls_stay_on_the_fast_path(monkeypatch, native):
    """The per-call check refuses nothing valid: after the first call of a shape no full validation
    runs, for the one-call function (written pads and in place), the KV-only one and bound ops."""
    a, kv_args = valid("cpu"), valid_kv("cpu")
    rt = StubRuntime(native=native)
    op, _ = _bound(in_place=False, native=native)
    op_in_place, _ = _bound(in_place=True, native=native)
    in_place = dict(a, q_out=a["q_in"])
    calls = [
        lambda: ops.qnorm_rope_kv_insert(*(a[k] for k in QKV_ARGS), runtime=rt),
        lambda: ops.qnorm_rope_kv_insert(*(in_place[k] for k in QKV_ARGS), runtime=rt),
        lambda: ops.kv_rope_insert(*(kv_args[k] for k in KV_ARGS[:-1]), norm_weight=kv_args["norm_weight"],
                                   runtime=rt),
        lambda: op(*(a[k] for k in BOUND_ARGS)),
        lambda: op_in_place(*(a[k] for k in BOUND_ARGS)),
    ]  # fmt: skip
    for call in calls:
        call()
    full = _count_full_checks(monkeypatch)
    launched = rt.kernel.calls
    for _ in range(3):
        for call in calls:
            call()
    assert full == []
    assert rt.kernel.calls == launched + 9  # the three one-call calls per round launched
    assert all((shape.native is not None) == native for shape in rt.calls.values())
