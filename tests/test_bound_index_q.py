"""The bound indexer-Q op on the CPU, its kernel stood in for by the reference in the compiled argument
order (test_index_q.StandInRuntime): it writes the reference's bytes for every preset, format and position
width over calls of varying T; a call the full check would refuse is refused on a cached geometry too and
writes nothing; a cached geometry skips the full check; bind-time errors come before any call."""

from __future__ import annotations

import functools
import types

import attn_prologue as ap
import pytest
import torch
from attn_prologue import bound_index_q, index_q_ops
from attn_prologue.errors import InputError, UnsupportedError
from attn_prologue.index_q import index_q_reference
from attn_prologue.parity import NumericsError

from .test_index_q import StandInRuntime, inputs, outputs

H = 8


@pytest.fixture(autouse=True)
def cpu_bound(monkeypatch):
    """Bind to the CPU: the stand-in runtime's kernels take CPU tensors (bind_device refuses a CPU device)."""
    monkeypatch.setattr(bound_index_q, "bind_device", lambda device, what: torch.device("cpu"))


def bound(fmt="fp8_token", numerics=None, **kw):
    a = inputs()
    return ap.bind_index_q(num_heads=H, softmax_scale=a["softmax_scale"], head_scale=a["head_scale"], fmt=fmt,
                           numerics=numerics, runtime=StandInRuntime(), **kw)  # fmt: skip


def call_args(t, seed, pos_dtype=torch.int64):
    a = inputs(t=max(t, 2), h=H, seed=seed)  # (its NaN and -Inf need two rows: the first t are kept)
    a["positions"] = a["positions"].to(pos_dtype)
    tensors = {
        k: a[k] if k == "cos_sin_cache" else a[k][:t].clone()
        for k in ("q", "positions", "cos_sin_cache", "weights")
    }
    return tensors, (a["softmax_scale"], a["head_scale"])


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize("numerics", [None, "vllm-triton", "sglang", "tokenspeed"])
def test_bound_calls_write_the_reference_over_varying_token_counts(fmt, numerics):
    op = bound(fmt, numerics)
    for seed, (t, pos_dtype) in enumerate(
        [(6, torch.int64), (3, torch.int64), (9, torch.int32), (1, torch.int64), (0, torch.int32)]
    ):
        a, scales = call_args(t, seed, pos_dtype)
        codes, w, q_scales = outputs(t, H, fmt)  # poisoned: 0x55 codes and scales, 7.0 weights
        op(**a, q_out=codes, weights_out=w, q_scales=q_scales)
        want = index_q_reference(*a.values(), *scales, fmt, numerics)
        assert torch.equal(codes, want[0]) and torch.equal(w, want[2]), (t, pos_dtype)
        assert q_scales is None or torch.equal(q_scales, want[1])
    widths = [k["positions32"] for k in op._shape._rt.asked]
    assert widths == [False, True]  # one set of calls per positions width, asked once each


def test_a_cached_geometry_skips_the_full_check(monkeypatch):
    op = bound()
    checks = []
    real = index_q_ops.check
    monkeypatch.setattr(index_q_ops, "check", lambda *a: checks.append(1) or real(*a))
    for t in (4, 4, 7, 2, 0):
        a, _ = call_args(t, t)
        codes, w, _ = outputs(t, H, "fp8_token")
        op(**a, q_out=codes, weights_out=w)
    assert len(checks) == 1  # the first call's; T is not part of the geometry
    a, _ = call_args(3, 1)
    op(
        **a,
        q_out=outputs(3, H, "fp8_token")[0].view(torch.float8_e4m3fn),
        weights_out=outputs(3, H, "fp8_token")[1],
    )
    assert len(checks) == 2  # another dtype: the full check again


def refusals(a, t):
    """(what, call arguments) of calls the full check refuses, each differing from a valid call of T = t in
    what a cached geometry's per-call check must see: T, alignment, overlap, lazy bits, grad, dtype, heads."""
    codes, w, _ = outputs(t, H, "fp8_token")
    big = torch.full((t * H * 128 + 1,), 0x55, dtype=torch.uint8)
    q_bytes = a["q"].view(torch.uint8).view(-1)
    yield "must have shape", {**a, "q_out": outputs(t + 1, H, "fp8_token")[0], "weights_out": w}
    yield "16-byte", {**a, "q_out": big[1:].view(t, H, 128), "weights_out": w}
    yield "overlaps", {**a, "q_out": q_bytes[: t * H * 128].view(t, H, 128), "weights_out": w}
    yield (
        "overlaps",
        {
            **a,
            "q_out": codes,
            "weights_out": codes.view(-1)[64 : 64 + t * H * 4].view(torch.float32).view(t, H),
        },
    )
    yield "negat", {**a, "weights": a["weights"]._neg_view(), "q_out": codes, "weights_out": w}
    yield "requires grad", {**a, "q_out": codes, "weights_out": w.clone().requires_grad_()}
    yield "bfloat16 or float16", {**a, "q": a["q"].float(), "q_out": codes, "weights_out": w}
    yield "for this bound op", {**{k: v[:, :4] if k in ("q", "weights") else v for k, v in a.items()},
                      "q_out": codes[:, :4], "weights_out": w[:, :4]}  # fmt: skip


# (the function takes any head count: the last case, another head count, is a refusal of the bound op only)
@pytest.mark.parametrize(
    "case, entry", [(c, "bound op") for c in range(8)] + [(c, "function") for c in range(7)]
)
def test_a_refused_call_on_a_cached_geometry_writes_nothing(case, entry):
    """Both entry points run the same per-call check (index_q_ops.IndexQCalls)."""
    t = 5
    a, scales = call_args(t, 0)
    if entry == "bound op":
        op = bound()
    else:
        rt = StandInRuntime()
        op = functools.partial(
            ap.index_q_rope_quant, softmax_scale=scales[0], head_scale=scales[1], runtime=rt
        )
        op._shape = types.SimpleNamespace(_rt=rt)
    codes, w, _ = outputs(t, H, "fp8_token")
    op(**a, q_out=codes, weights_out=w)  # the geometry is now cached
    what, bad = list(refusals(a, t))[case]
    written = [v.clone() for k, v in bad.items() if k in ("q_out", "weights_out")] + [a["q"].clone()]
    launched = len(op._shape._rt.seen)
    with pytest.raises(InputError, match=what):
        op(**bad)
    assert len(op._shape._rt.seen) == launched
    after = [v for k, v in bad.items() if k in ("q_out", "weights_out")] + [a["q"]]
    for before, now in zip(written, after, strict=True):
        assert torch.equal(before.view(torch.uint8), now.detach().view(torch.uint8)), what


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(fmt="nvfp4"), UnsupportedError, "fp8_token or mxfp4"),
        (dict(weights_dtype=torch.float16), InputError, "weights_dtype"),
        (dict(softmax_scale=float("inf")), InputError, "softmax_scale"),
        (dict(head_scale=True), InputError, "head_scale"),
        (dict(num_heads=0), InputError, "num_heads"),
        (dict(dtype=torch.float32), InputError, "dtype"),
        (dict(numerics="sglnag"), NumericsError, "did you mean"),
        (dict(numerics="vllm", dtype=torch.float16), NumericsError, "bf16"),
    ],
)
def test_bind_time_errors_come_before_any_call(kw, error, match):
    rt = StandInRuntime()
    args = dict(num_heads=H, softmax_scale=0.1, head_scale=0.2, runtime=rt) | kw
    with pytest.raises(error, match=match):
        ap.bind_index_q(**args)
    assert rt.seen == []
