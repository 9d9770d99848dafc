"""attn_prologue.compat.vllm on CPU: typed errors with nothing written (the plain callables' argument
checks, bad tensors through the torch ops, bad options), and registering under a namespace: taken
names, overriding an engine's own op, closing, the order against the engine's library, reserved
namespaces and malformed names, registrations of one name closed in either order."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from attn_prologue.compat import registration, vllm
from attn_prologue.errors import InputError, RegistrationError, ScratchError, UnsupportedError

from .support.vllm_cases import (
    CALLER_OWNED,
    EPS,
    KV_ONLY,
    Case,
    allocating_args,
    bits,
    caller_owned_args,
    expected_kv,
    expected_qkv,
    make,
    namespace,
    poison_pool,
    poison_q_out,
    registrations,
)


@pytest.fixture
def registered():
    """register(...) with the pool and cleanup (support.vllm_cases.registrations); yields the factory."""
    with registrations() as make_registration:
        yield make_registration


# ---- errors: typed, and nothing written -----------------------------------------------------------
def bad_calls(args: tuple):
    """(what, args, kwargs) for the plain callable of the allocating form: arity and types."""
    a = list(args)
    yield "12 arguments", a[:12], {}
    yield "14 arguments", [*a, True], {}
    yield "unknown keyword", a[:12], {"interleaved": False}
    yield "given twice", a, {"eps": EPS}
    yield "a str for a Tensor", [a[0], "kv", *a[2:]], {}
    yield "a float for block_size", [*a[:8], 64.0, *a[9:]], {}
    yield "a bool for q_head_padded", [*a[:6], True, *a[7:]], {}
    yield "an int for a bool flag", [*a[:9], 1, *a[10:]], {}


def test_wrong_arity_or_types_raise_input_error_and_write_nothing(registered):
    r = registered("allocating")
    case = Case(7, seed=51)
    x = make(case)
    buf = poison_pool(r)
    before_cache, before_buf = x["k_cache"].clone(), bits(buf).clone()
    for what, args, kwargs in bad_calls(allocating_args(case, x)):
        with pytest.raises(InputError):
            r.qkv(*args, **kwargs)
        assert torch.equal(x["k_cache"], before_cache), what
        assert torch.equal(bits(buf), before_buf), what
    # through torch.ops the dispatcher parses the schema before any of our code runs: its own error
    with pytest.raises(RuntimeError):
        r.qkv_op(*allocating_args(case, x)[:12])
    assert torch.equal(x["k_cache"], before_cache)


@pytest.mark.parametrize(
    "what, change, error",
    [
        ("int32 positions", lambda x, a: a.__setitem__(4, x["positions"].int()), InputError),
        ("P < H", lambda x, a: a.__setitem__(6, 32), InputError),
        ("P without a buffer", lambda x, a: a.__setitem__(6, 64), ScratchError),
        ("negative P", lambda x, a: a.__setitem__(6, -1), InputError),
        ("a cache too small for block_size", lambda x, a: a.__setitem__(8, 256), InputError),
        ("kv in another dtype", lambda x, a: a.__setitem__(1, x["kv"].half()), InputError),
        ("an int8 cache", lambda x, a: a.__setitem__(2, x["k_cache"].view(torch.int8)), InputError),
        ("kv with fewer rows than q", lambda x, a: a.__setitem__(1, x["kv"][:5]), InputError),
    ],
)
def test_bad_tensors_through_the_torch_op_raise_typed_errors_and_write_nothing(
    registered, what, change, error
):
    r = registered("allocating")
    case = Case(7, seed=52)
    x = make(case)
    buf = poison_pool(r)
    before_cache, before_buf = x["k_cache"].clone(), bits(buf).clone()
    args = list(allocating_args(case, x))
    change(x, args)
    with pytest.raises(error):
        r.qkv_op(*args)
    assert torch.equal(x["k_cache"], before_cache) and torch.equal(bits(buf), before_buf)


def test_the_allocating_form_needs_a_pool_for_q_but_not_for_kv_only(registered):
    r = vllm.register(namespace(), pool=None, new_namespace=True)
    try:
        case = Case(7, seed=53)
        x = make(case)
        with pytest.raises(ScratchError, match="register\\(..., pool=pool\\)"):
            r.qkv(*allocating_args(case, x))
        r.qkv(*allocating_args(case, x, q_head_padded=0))  # KV-only: no pool needed
    finally:
        r.close()


def test_register_refuses_bad_options():
    for kw, error in (
        (dict(form="caller_owned"), InputError),
        (dict(pad_heads="zero"), InputError),
        (dict(cache_format="fp8"), UnsupportedError),
        (dict(pool=object()), InputError),
        (dict(micro_batch="0"), InputError),
    ):
        with pytest.raises(error):
            vllm.register(namespace(), new_namespace=True, **kw)


# ---- registering under a namespace ----------------------------------------------------------------
def test_a_taken_name_is_refused_unless_overridden_with_the_same_schema(registered):
    r = registered("allocating")
    with pytest.raises(RegistrationError, match="already defined"):
        vllm.register(r.namespace, pool=r.pool)
    with pytest.raises(RegistrationError, match="another schema"):
        vllm.register(r.namespace, form="q_out_third", override=True)
    with warnings.catch_warnings():  # torch warns once per process that a kernel is overridden
        warnings.simplefilter("ignore")
        again = vllm.register(r.namespace, pool=r.pool, override=True)
    again.close()


def test_override_runs_ours_behind_an_engines_own_op():
    """The engine defined the op (its own argument names, `Tensor!` annotations, a kernel of its own);
    register(override=True) keeps its schema and runs our implementation."""
    ns = namespace()
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define(
        f"{vllm.KV_NAME}(Tensor kv, Tensor! kv_cache, Tensor slot_mapping, Tensor positions, "
        "Tensor cos_sin_cache, SymInt block_size, Tensor? scale, bool mxfp8) -> ()"
    )
    calls = []
    lib.impl(vllm.KV_NAME, lambda *a: calls.append(a), "CPU")
    lib.define(f"{vllm.QKV_NAME}(Tensor q, Tensor kv, Tensor! k_cache, Tensor slot_mapping, Tensor positions, "
               "Tensor cos_sin_cache, int p, float eps, int bs, bool a, bool b, bool c, bool d) -> Tensor")  # fmt: skip
    case = KV_ONLY[1]
    x = make(case)
    want = expected_kv(case, x, x["k_cache"], case.fmt)
    args = (x["kv"], x["k_cache"], x["slot_mapping"], x["positions"], x["cos_sin_cache"], case.block_size)
    with warnings.catch_warnings():  # torch warns once per process that a kernel is overridden
        warnings.simplefilter("ignore")
        r = vllm.register(ns, override=True)
    try:
        getattr(torch.ops, ns).fused_deepseek_v4_kv_rope_insert(*args, None, case.mxfp8)
        assert torch.equal(x["k_cache"], want) and calls == []
        r.close()  # the engine's own kernel is back
        getattr(torch.ops, ns).fused_deepseek_v4_kv_rope_insert(*args, None, case.mxfp8)
        assert len(calls) == 1
    finally:
        r.close()
        lib._destroy()


def test_close_unregisters_so_the_names_can_be_registered_again(registered):
    r = registered("q_out_third")
    ns = r.namespace
    r.close()
    r2 = vllm.register(ns, form="q_out_second", new_namespace=True)  # the names are free again
    try:
        case = CALLER_OWNED[1]
        x = make(case)
        q_out = poison_q_out(case.n)
        want_q, _ = expected_qkv(case, x, q_out)
        getattr(torch.ops, ns).fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
            *caller_owned_args("q_out_second", case, x, q_out)
        )
        assert torch.equal(bits(q_out), bits(want_q))
    finally:
        r2.close()


def test_a_registration_nobody_keeps_stays_registered():
    ns = namespace()
    vllm.register(ns, form="q_out_third", new_namespace=True)  # the return value is dropped, as an engine may
    import gc

    gc.collect()
    case = CALLER_OWNED[0]
    x = make(case)
    q_out = poison_q_out(case.n)
    want_q, _ = expected_qkv(case, x, q_out)
    getattr(torch.ops, ns).fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        *caller_owned_args("q_out_third", case, x, q_out)
    )
    assert torch.equal(bits(q_out), bits(want_q))
    next(r for r in vllm._LIVE if r.namespace == ns).close()


# ---- what register refuses, and registrations of one name (issue 28, item 16) -------------------------
@pytest.mark.parametrize("namespace_", ["aten", "prim", "prims", "quantized", "attn_prologue"])
def test_reserved_namespaces_are_refused_even_with_override(namespace_):
    for override in (False, True):
        with pytest.raises(RegistrationError, match="namespace of torch's or attn_prologue's own ops"):
            vllm.register(namespace_, form="q_out_third", override=override, new_namespace=True)
    assert registration.existing_schema(namespace_, vllm.QKV_NAME) is None  # nothing was defined there


@pytest.mark.parametrize(
    "kw",
    [dict(namespace="my ns"), dict(namespace="a::b"), dict(namespace=""), dict(namespace=7),
     dict(qkv_name="bad name"), dict(qkv_name="x.y"), dict(kv_name="9x"), dict(kv_name="a(b)"),
     dict(qkv_name="same", kv_name="same")], ids=str,
)  # fmt: skip
def test_malformed_names_are_refused(kw):
    args = dict(namespace=namespace(), form="q_out_third", new_namespace=True) | kw
    with pytest.raises(RegistrationError, match="identifier|must differ"):
        vllm.register(args.pop("namespace"), **args)


def test_a_namespace_no_library_has_defined_is_refused_unless_it_is_new():
    """Registering before the engine's library loads would make the engine's own definitions fail: a
    namespace with no ops is refused unless the caller says it is its own; once a library defines
    something there (the engine loaded), register works."""
    ns = namespace()
    with pytest.raises(RegistrationError, match="register after the engine's own library"):
        vllm.register(ns, form="q_out_third")
    engine = torch.library.Library(ns, "FRAGMENT")
    engine.define("engine_op(Tensor x) -> Tensor")
    r = vllm.register(ns, form="q_out_third")
    try:
        assert r.qkv_op is not None
    finally:
        r.close()
        engine._destroy()


def test_why_the_order_matters_an_engine_defining_our_names_later_fails():
    """What the refusal above prevents: the engine's library, loading after a registration, cannot
    define the same name (torch raises)."""
    r = vllm.register(namespace(), form="q_out_third", new_namespace=True)
    engine = torch.library.Library(r.namespace, "FRAGMENT")
    try:
        with pytest.raises(RuntimeError):
            engine.define(f"{vllm.KV_NAME}{vllm.KV_SCHEMA}")
    finally:
        engine._destroy()
        r.close()


def _run_caller_owned(ns: str) -> tuple:
    case = CALLER_OWNED[1]
    x = make(case)
    q_out = poison_q_out(case.n)
    want_q, want_cache = expected_qkv(case, x, q_out)
    getattr(torch.ops, ns).fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        *caller_owned_args("q_out_third", case, x, q_out)
    )
    return torch.equal(bits(q_out), bits(want_q)) and torch.equal(x["k_cache"], want_cache)


@pytest.mark.parametrize("first_closed", ["first", "second"])
def test_closing_one_of_two_registrations_leaves_the_other_working(first_closed):
    ns = namespace()
    first = vllm.register(ns, form="q_out_third", new_namespace=True)
    with warnings.catch_warnings():  # torch warns once per process that a kernel is overridden
        warnings.simplefilter("ignore")
        second = vllm.register(ns, form="q_out_third", override=True)
    closing, staying = (first, second) if first_closed == "first" else (second, first)
    closing.close()
    assert registration.existing_schema(ns, vllm.QKV_NAME) is not None
    assert _run_caller_owned(ns)  # the op still runs (the other's kernels)
    staying.close()
    assert registration.existing_schema(ns, vllm.QKV_NAME) is None  # the last one closed: gone
    closing.close()  # a second close does nothing


def test_the_plain_callables_show_the_schema_s_arguments_to_help(registered):
    import inspect

    r = registered("q_out_second")
    assert list(inspect.signature(r.qkv).parameters) == [a.name for a in r.qkv_op.default._schema.arguments]
    assert list(inspect.signature(r.kv_insert).parameters)[:2] == ["kv", "cache"]


_kv_only_names = itertools.count()


def test_kv_only_registers_the_kv_op_alone():
    ns = f"kv_only_{next(_kv_only_names)}"
    r = vllm.register(ns, kv_only=True, new_namespace=True)
    try:
        assert r.qkv is None and r.qkv_op is None and r.kv_op is not None
        assert hasattr(getattr(torch.ops, ns), vllm.KV_NAME)
        assert not hasattr(getattr(torch.ops, ns), vllm.QKV_NAME)
    finally:
        r.close()
