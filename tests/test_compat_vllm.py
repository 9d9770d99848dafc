"""attn_prologue.compat.vllm on CPU: vLLM's DeepSeek-V4 schemas registered under an engine's namespace,
byte-exact against the reference (cache bytes and q), the allocating form handing out pool views,
typed errors with nothing written, overriding an engine's own op, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import itertools
import warnings

import attn_prologue as ap
import pytest
import torch
from attn_prologue.compat import vllm
from attn_prologue.errors import InputError, RegistrationError, ScratchError, UnsupportedError

from .support.vllm_cases import (
    ALLOCATING,
    CALLER_OWNED,
    EPS,
    KV_ONLY,
    Case,
    D,
    H,
    P,
    allocating_args,
    bits,
    expected_kv,
    expected_qkv,
    make,
    poison_q_out,
)

_names = itertools.count()


def namespace() -> str:
    """A fresh namespace per registration: torch.ops caches what it has looked up."""
    return f"compat_test_{next(_names)}"


@pytest.fixture
def registered():
    """register(...) with the pool and cleanup; yields the factory."""
    made = []

    def make_registration(form="allocating", *, max_tokens=300, micro_batches=1, lock=True, **kw):
        pool = kw.pop("pool", None)
        if pool is None and form == "allocating":
            pool = ap.ScratchPool()
            pool.reserve(
                max_tokens=max_tokens, padded_heads=P, head_dim=D, micro_batches=micro_batches, device="cpu"
            )
            if lock:
                pool.lock()
        r = vllm.register(namespace(), form=form, pool=pool, **kw)
        made.append(r)
        return r

    yield make_registration
    for r in made:
        r.close()


def pool_buffer(r, micro_batch=0) -> torch.Tensor:
    return r.pool.buffer(padded_heads=P, head_dim=D, micro_batch=micro_batch, device="cpu")


def poison_pool(r, micro_batch=0) -> torch.Tensor:
    """NaN over the whole buffer (pads included: "written" mode must zero them); returns it."""
    buf = pool_buffer(r, micro_batch)
    buf.fill_(float("nan"))
    return buf


# ---- the schemas ----------------------------------------------------------------------------------
def test_schemas_are_vllms_argument_lists_with_their_mutations(registered):
    want = {
        "allocating": "(Tensor q, Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, Tensor positions, "
        "Tensor cos_sin_cache, int q_head_padded, float eps, int block_size, bool apply_q_norm, "
        "bool kv_mxfp8, bool apply_q_rope, bool is_q_interleaved) -> Tensor",
        "q_out_second": "(Tensor q_in, Tensor(a!) q_out, Tensor kv, Tensor(b!) k_cache, Tensor slot_mapping, "
        "Tensor position_ids, Tensor cos_sin_cache, float eps, int cache_block_size) -> ()",
        "q_out_third": "(Tensor q_in, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos_sin_cache, float eps, int block_size) -> ()",
    }
    for form, sig in want.items():
        r = registered(form)
        assert str(r.qkv_op.default._schema) == f"{r.namespace}::{vllm.QKV_NAME}{sig}"
        assert str(r.kv_op.default._schema) == (
            f"{r.namespace}::{vllm.KV_NAME}(Tensor kv, Tensor(a!) cache, Tensor slots, Tensor positions, "
            "Tensor cos_sin_cache, int block_size, Tensor? fp8_scale, bool kv_mxfp8) -> ()"
        )
        written = [
            a.name for a in r.qkv_op.default._schema.arguments if a.alias_info and a.alias_info.is_write
        ]
        assert written == (["k_cache"] if form == "allocating" else ["q_out", "k_cache"])


# ---- the allocating form --------------------------------------------------------------------------
@pytest.mark.parametrize("case", ALLOCATING, ids=str)
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_allocating_form_matches_the_reference(registered, case: Case, entry):
    r = registered("allocating")
    x = make(case)
    buf = poison_pool(r)
    want_q, want_cache = expected_qkv(case, x, poison_q_out(case.n, rows_past=0))
    call = r.qkv_op if entry == "torch op" else r.qkv
    q_padded = call(*allocating_args(case, x))
    assert q_padded.shape == (case.n, P, D) and q_padded.dtype == torch.bfloat16
    assert torch.equal(bits(q_padded), bits(want_q))  # every head: live ones and zero pads
    assert torch.equal(x["k_cache"], want_cache)
    assert bits(buf[case.n :]).eq(bits(torch.tensor(float("nan")).bfloat16())).all()  # rows >= N untouched
    if case.rows and (x["slot_mapping"] >= 0).any():
        assert not torch.equal(x["k_cache"], make(case)["k_cache"])  # something was written


def test_the_flags_reach_the_op(registered):
    """apply_q_norm, apply_q_rope, is_q_interleaved and kv_mxfp8 each change what is written (so the
    comparisons above would notice a flag dropped or swapped)."""
    r = registered("allocating")
    base = Case(7, seed=30)
    outs = {}
    for flag in ("none", "q_norm", "q_rope", "interleaved"):
        case = base if flag == "none" else Case(7, seed=30, **{flag: flag == "interleaved"})
        x = make(case)
        outs[flag] = r.qkv(*allocating_args(case, x)).clone()
    assert len({bits(v).numpy().tobytes() for v in outs.values()}) == 4
    a, b = make(base), make(base)  # the same bytes: a 584 B/token cache also holds 528 B records
    r.qkv(*allocating_args(base, a))
    r.qkv(*allocating_args(Case(7, seed=30, mxfp8=True), b))
    assert not torch.equal(a["k_cache"], b["k_cache"])


@pytest.mark.parametrize("case", [ALLOCATING[1], ALLOCATING[4]], ids=str)
def test_q_head_padded_zero_is_the_kv_only_call(registered, case):
    r = registered("allocating")
    x = make(case)
    before = pool_buffer(r).clone()
    want = expected_kv(case, x, x["k_cache"], case.fmt)
    x["q"] = torch.empty(0)  # not read
    out = r.qkv_op(*allocating_args(case, x, q_head_padded=0))
    assert out.shape == (case.n, 0, D) and out.numel() == 0
    assert torch.equal(x["k_cache"], want)
    assert torch.equal(bits(pool_buffer(r)), bits(before))


def test_the_allocating_form_returns_views_of_the_locked_pool(registered):
    """Nothing is allocated per call: every q_padded lies inside the pool's reservation (its storage),
    the same token count gets the same view back, and the reservation does not change."""
    r = registered("allocating", max_tokens=300)
    buf = pool_buffer(r)
    start, end = buf.data_ptr(), buf.data_ptr() + buf.nbytes
    reserved = r.pool.reserved_bytes
    seen = {}
    for n in (1, 7, 64, 300, 7, 1):
        case = Case(n, seed=n)
        q_padded = r.qkv(*allocating_args(case, make(case)))
        assert q_padded.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert start <= q_padded.data_ptr() and q_padded.data_ptr() + q_padded.nbytes <= end
        assert seen.setdefault(n, q_padded) is q_padded
    assert r.pool.reserved_bytes == reserved and r.pool.locked


def test_micro_batches_come_from_the_registered_index_or_callable(registered):
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=8, padded_heads=P, head_dim=D, micro_batches=2, device="cpu")
    pool.lock()
    current = [0]
    r = registered("allocating", pool=pool, micro_batch=lambda: current[0])
    case = Case(7, seed=40)
    x = make(case)
    a = r.qkv(*allocating_args(case, x))
    current[0] = 1
    b = r.qkv(*allocating_args(case, x))
    assert a.data_ptr() == pool_buffer(r, 0).data_ptr() and b.data_ptr() == pool_buffer(r, 1).data_ptr()
    assert torch.equal(bits(a), bits(b))
    current[0] = 2
    with pytest.raises(ScratchError, match="micro_batch=2"):
        r.qkv(*allocating_args(case, x))


def test_the_pool_grows_before_lock_and_refuses_after_it_writing_nothing(registered):
    r = registered("allocating", max_tokens=8, lock=False)
    small, big = Case(7, seed=41), Case(64, seed=42)
    r.qkv(*allocating_args(small, make(small)))
    q_padded = r.qkv(*allocating_args(big, make(big)))  # not locked: the buffer grows (as pool.view does)
    assert r.pool.capacity(padded_heads=P, head_dim=D, device="cpu") == 64
    assert q_padded.untyped_storage().data_ptr() == pool_buffer(r).untyped_storage().data_ptr()
    again = r.qkv(*allocating_args(small, make(small)))  # a view of the new buffer, not the retired one
    assert again.untyped_storage().data_ptr() == pool_buffer(r).untyped_storage().data_ptr()
    r.pool.lock()
    huge = Case(65, seed=43)
    x = make(huge)
    before = x["k_cache"].clone()
    with pytest.raises(ScratchError, match="65 tokens do not fit the locked scratch pool"):
        r.qkv(*allocating_args(huge, x))
    assert torch.equal(x["k_cache"], before)
    r.pool.release()
    with pytest.raises(ScratchError, match="no scratch reserved"):
        r.qkv(*allocating_args(small, make(small)))


def test_written_pads_survive_a_reader_that_writes_the_view_and_zero_once_pads_do_not(registered):
    """Why "written" is the default: inductor may reuse an op's output buffer for in-place pointwise
    work (seen on torch 2.13 CPU), i.e. the reader writes the view. "written" zeroes the pads again
    on the next call; "zero_once" writes the live heads only and keeps what the reader left."""
    case = Case(7, seed=44)
    for mode in ("written", "zero_once"):
        r = registered("allocating", pad_heads=mode)
        x = make(case)
        q_padded = r.qkv(*allocating_args(case, x))
        assert not q_padded[:, H:].view(torch.int16).any()
        q_padded.add_(1)  # the reader writes its input
        q_padded = r.qkv(*allocating_args(case, x))
        want_q, _ = expected_qkv(case, x, poison_q_out(case.n, rows_past=0))
        assert torch.equal(bits(q_padded[:, :H]), bits(want_q[:, :H]))
        pads_zero = not q_padded[:, H:].view(torch.int16).any()
        assert pads_zero == (mode == "written")


def test_zero_once_claims_the_buffer_for_one_head_count_and_layout(registered):
    r = registered("allocating", pad_heads="zero_once")
    case = Case(7, seed=45)
    r.qkv(*allocating_args(case, make(case)))
    other = Case(7, seed=45, interleaved=True)
    with pytest.raises(ScratchError, match=r"already serves H=64 live heads \(head_major\)"):
        r.qkv(*allocating_args(other, make(other)))
    x = make(case)
    x["q"] = x["q"][:, :32]  # another H on the same buffer
    with pytest.raises(ScratchError, match="cannot also serve H=32"):
        r.qkv(*allocating_args(case, x))


def test_written_mode_never_shares_a_buffer_with_zero_once_writers(registered):
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=8, padded_heads=P, head_dim=D, micro_batches=1, device="cpu")
    pool.claim(H, padded_heads=P, head_dim=D, device="cpu")  # a bound op's claim, zero-once
    r = registered("allocating", pool=pool)
    case = Case(7, seed=46)
    with pytest.raises(ScratchError, match="a writer of every head cannot share it"):
        r.qkv(*allocating_args(case, make(case)))


# ---- the caller-owned forms -----------------------------------------------------------------------
def caller_owned_args(form: str, case: Case, x: dict, q_out: torch.Tensor) -> tuple:
    common = (x["slot_mapping"], x["positions"], x["cos_sin_cache"], EPS, case.block_size)
    if form == "q_out_second":
        return (x["q"], q_out, x["kv"], x["k_cache"], *common)
    return (x["q"], x["kv"], q_out, x["k_cache"], *common)


@pytest.mark.parametrize("case", CALLER_OWNED, ids=str)
@pytest.mark.parametrize("form", ["q_out_second", "q_out_third"])
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_caller_owned_forms_match_the_reference(registered, case: Case, form, entry):
    r = registered(form, cache_format=case.fmt)
    x = make(case)
    q_out = poison_q_out(case.n)
    want_q, want_cache = expected_qkv(case, x, q_out)
    (r.qkv_op if entry == "torch op" else r.qkv)(*caller_owned_args(form, case, x, q_out))
    assert torch.equal(bits(q_out), bits(want_q))  # pads zero, rows >= N still NaN
    assert torch.equal(x["k_cache"], want_cache)


def test_the_caller_owned_forms_take_keywords_by_their_own_names(registered):
    case = Case(7, seed=47)
    x = make(case)
    q_out = poison_q_out(case.n)
    want_q, want_cache = expected_qkv(case, x, q_out)
    r = registered("q_out_second")
    r.qkv(
        x["q"], q_out, x["kv"], x["k_cache"], x["slot_mapping"], position_ids=x["positions"],
        cos_sin_cache=x["cos_sin_cache"], eps=EPS, cache_block_size=case.block_size,
    )  # fmt: skip
    assert torch.equal(bits(q_out), bits(want_q)) and torch.equal(x["k_cache"], want_cache)


# ---- the KV-only op -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", KV_ONLY, ids=str)
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_kv_only_op_matches_the_reference_in_both_packed_formats(registered, case: Case, entry):
    r = registered("q_out_third")
    x = make(case)
    want = expected_kv(case, x, x["k_cache"], case.fmt)
    args = (x["kv"], x["k_cache"], x["slot_mapping"], x["positions"], x["cos_sin_cache"], case.block_size)
    (r.kv_op if entry == "torch op" else r.kv_insert)(*args, None, case.mxfp8)
    assert torch.equal(x["k_cache"], want)


@pytest.mark.parametrize("cache_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_scale_selects_the_per_tensor_fp8_cache(registered, cache_dtype):
    """fp8_scale given: each value is stored as e4m3(x / scale), D bytes per token (our fp8_tensor),
    in a uint8 page of bytes or a float8_e4m3fn [num_blocks, block_size, D] cache."""
    r = registered("allocating")
    case = Case(64, m=60, negative_every=4, seed=48)
    x = make(case)
    scale = torch.tensor([0.05])
    bs = case.block_size
    pages = torch.randint(0, 256, (x["k_cache"].shape[0], bs * D), dtype=torch.uint8)
    before = pages.clone()
    want = expected_kv(case, x, pages, "fp8_tensor", kv_scale=scale)
    cache = pages if cache_dtype is torch.uint8 else pages.view(torch.float8_e4m3fn).view(-1, bs, D)
    r.kv_op(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], bs, scale, False)
    assert torch.equal(pages, want) and not torch.equal(pages, before)


def test_a_bfloat16_cache_is_the_unquantized_format(registered):
    r = registered("allocating")
    case = Case(7, m=6, block_size=16, seed=49)
    x = make(case)
    cache = torch.randn(3, case.block_size, D).bfloat16()  # [num_blocks, block_size, D]
    want = expected_kv(case, x, cache.view(torch.uint8).view(3, -1), "bf16")
    r.kv_insert(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 16, None, False)
    assert torch.equal(cache.view(torch.uint8).view(3, -1), want)


@pytest.mark.parametrize(
    "cache_dtype, scale, mxfp8, error, match",
    [
        (torch.uint8, True, True, UnsupportedError, "no format of ours takes a per-tensor fp8_scale"),
        (torch.bfloat16, False, True, UnsupportedError, "kv_mxfp8=True writes MXFP8 records"),
        (torch.float8_e4m3fn, False, False, InputError, "needs fp8_scale"),
        (torch.bfloat16, True, False, InputError, "takes no fp8_scale"),
        (torch.int16, False, False, InputError, "must be uint8"),
    ],
)
def test_cache_and_scale_that_do_not_map_are_refused_writing_nothing(
    registered, cache_dtype, scale, mxfp8, error, match
):
    r = registered("allocating")
    case = Case(7, seed=50)
    x = make(case)
    cache = torch.zeros(4, case.block_size * D, dtype=torch.uint8).view(cache_dtype)
    before = cache.clone()
    s = torch.tensor([0.5]) if scale else None
    with pytest.raises(error, match=match):
        r.kv_op(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 64, s, mxfp8)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


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
    r = vllm.register(namespace(), pool=None)
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
            vllm.register(namespace(), **kw)


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
    r2 = vllm.register(ns, form="q_out_second")  # no override needed: the names are free again
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
    vllm.register(ns, form="q_out_third")  # the return value is dropped, as an engine may do
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
    with pytest.raises(InputError, match="meta tensors"):
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
