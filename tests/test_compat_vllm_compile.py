"""attn_prologue.compat.vllm under torch.compile on CPU: fullgraph traces of every form equal to eager,
mutations kept, fake implementations giving the real shapes, and inductor calling the ops in place."""

from __future__ import annotations

import pytest
import torch
from attn_prologue.compat import vllm
from attn_prologue.errors import InputError

from .support.vllm_cases import (
    CALLER_OWNED,
    Case,
    D,
    H,
    P,
    allocating_args,
    bits,
    caller_owned_args,
    expected_qkv,
    make,
    poison_q_out,
    pool_buffer,
    registrations,
)


@pytest.fixture
def registered():
    """register(...) with the pool and cleanup (support.vllm_cases.registrations); yields the factory."""
    with registrations() as make_registration:
        yield make_registration


# ---- torch.compile --------------------------------------------------------------------------------
def test_allocating_and_kv_only_ops_under_torch_compile_fullgraph(registered):
    """One compiled graph: the allocating op (q_padded consumed inside the graph), the KV-only op on
    a second cache, through torch.ops and through the plain callables; equal to eager, and the cache
    mutations are kept."""
    r = registered("allocating")
    qkv_op, kv_op = r.qkv_op, r.kv_op
    case = Case(7, m=6, negative_every=3, seed=54)

    def step(x, cache2, use_plain):
        qkv, kv_insert = (r.qkv, r.kv_insert) if use_plain else (qkv_op, kv_op)
        q_padded = qkv(*allocating_args(case, x))
        kv_insert(x["kv"], cache2, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 64, None, True)
        return q_padded[:, :H, :8].float() * 2  # a consumer inside the graph (exact in any order)

    results = []
    for compiled, use_plain in ((False, False), (True, False), (True, True)):
        torch._dynamo.reset()
        x = make(case)
        cache2 = make(Case(7, mxfp8=True, seed=55))["k_cache"]
        fn = torch.compile(step, fullgraph=True) if compiled else step
        total = fn(x, cache2, use_plain)
        results.append((total, x["k_cache"], cache2, bits(pool_buffer(r)[: case.n]).clone()))
    eager = results[0]
    assert not torch.equal(eager[1], make(case)["k_cache"])  # the eager call wrote the cache
    for other in results[1:]:
        for a, b in zip(eager, other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_caller_owned_form_under_torch_compile_keeps_both_mutations(registered):
    r = registered("q_out_second")
    case = CALLER_OWNED[1]

    def step(x, q_out):
        r.qkv_op(*caller_owned_args("q_out_second", case, x, q_out))
        return q_out[:, 0, :8].float() * 2

    torch._dynamo.reset()
    outs = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        x, q_out = make(case), poison_q_out(case.n)
        outs.append((fn(x, q_out), bits(q_out), x["k_cache"]))
    want_q, want_cache = expected_qkv(case, make(case), poison_q_out(case.n))
    assert torch.equal(outs[1][1], bits(want_q)) and torch.equal(outs[1][2], want_cache)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # rows >= N stay NaN


def test_fake_impls_give_the_real_shapes_without_data(registered):
    from torch._subclasses.fake_tensor import FakeTensorMode

    r = registered("allocating")
    case = Case(7, seed=56)
    real = make(case)
    with FakeTensorMode() as mode:
        x = {k: mode.from_tensor(v) for k, v in real.items()}
        out = r.qkv_op(*allocating_args(case, x))
        kv_only = r.qkv_op(*allocating_args(case, x, q_head_padded=0))
    assert out.shape == (7, P, D) and out.stride() == (P * D, D, 1) and out.dtype == torch.bfloat16
    assert kv_only.shape == (7, 0, D)
    with pytest.raises(InputError, match="kv is a meta tensor"):
        r.kv_op(*(v.to("meta") if isinstance(v, torch.Tensor) else v for v in (
            real["kv"], real["k_cache"], real["slot_mapping"], real["positions"], real["cos_sin_cache"], 64,
            None, False)))  # fmt: skip


def test_inductor_calls_the_ops_in_place_without_copying_the_cache(registered):
    """The compiled graph calls both ops on the caller's caches (re-inplaced after functionalization)
    and copies no cache; q_padded comes back from the op (the pool view), not from an allocation."""
    from torch._inductor.utils import run_and_get_code

    r = registered("allocating")
    case = Case(7, seed=57)

    def step(x, cache2):
        q_padded = r.qkv(*allocating_args(case, x))
        r.kv_insert(x["kv"], cache2, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 64, None, True)
        return q_padded[:, :H, :8].float() * 2

    torch._dynamo.reset()
    x, cache2 = make(case), make(Case(7, mxfp8=True, seed=58))["k_cache"]
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), x, cache2)
    call = code[0][code[0].index("def call(self, args)") :]
    ns = r.namespace
    assert f"torch.ops.{ns}.{vllm.QKV_NAME}.default(arg0_1, arg1_1, arg2_1" in call
    assert f"torch.ops.{ns}.{vllm.KV_NAME}.default(" in call
    for copy in ("clone", ".copy_(", "aten.copy"):  # (the consumer's kernel is named fused__to_copy_...)
        assert copy not in call, f"compiled graph copies something ({copy})"
    assert call.count("empty_strided") == 1  # the consumer's float32 output only


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_overlap_is_refused_typed_under_torch_compile_writing_nothing(registered, backend):
    """As for our own ops (test_torch_op.py): the fake implementations check the overlap rules while
    dynamo traces, so a backend that runs the op on copies of the written buffers cannot skip them."""
    r = registered("q_out_third")
    case = CALLER_OWNED[1]
    x, q_out = make(case), poison_q_out(case.n)
    x["kv"] = q_out[: case.n, -1]  # kv inside q_out (its last head)
    x["kv"].copy_(make(case)["kv"])
    before_q, before_cache = bits(q_out).clone(), x["k_cache"].clone()

    def step(x, q_out):
        r.qkv(*caller_owned_args("q_out_third", case, x, q_out))

    torch._dynamo.reset()
    with pytest.raises(InputError, match="overlaps kv"):
        torch.compile(step, backend=backend, fullgraph=True)(x, q_out)
    assert torch.equal(bits(q_out), before_q) and torch.equal(x["k_cache"], before_cache)
