"""attn_prologue.compat.vllm on CPU: vLLM's DeepSeek-V4 schemas registered under an engine's namespace,
byte-exact against the reference (cache bytes and q) in every form, and the allocating form handing out
pool views. Registration and errors: test_compat_vllm_registration.py; torch.compile:
test_compat_vllm_compile.py."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue.compat import vllm
from attn_prologue.errors import InputError, ScratchError, UnsupportedError

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
    caller_owned_args,
    expected_kv,
    expected_qkv,
    make,
    poison_pool,
    poison_q_out,
    pool_buffer,
    registrations,
)


@pytest.fixture
def registered():
    """register(...) with the pool and cleanup (support.vllm_cases.registrations); yields the factory."""
    with registrations() as make_registration:
        yield make_registration


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
