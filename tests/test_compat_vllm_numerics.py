"""attn_prologue.compat.vllm's parity choices on CPU: by default the ops write what vLLM's CUDA op writes
("preset=vllm") into the formats that preset covers (fp8_ds_mla, mxfp8) and the format's defaults into
the others; register(numerics=...) applies its choices to every call, and refuses one the ops' packed
formats lack before anything is registered. Inputs: fresh random bf16 rows holding NaN, +-Inf, signed
zeros and a block below the amax floor; outputs poisoned first; expected bytes from the package
functions with the same numerics (attn_prologue.qnorm_rope_kv_insert / kv_rope_insert)."""

from __future__ import annotations

import inspect

import attn_prologue as ap
import pytest
import torch
from attn_prologue.compat import registration, vllm
from attn_prologue.errors import InputError
from attn_prologue.formats import Numerics, NumericsError, get_format

from .support.vllm_cases import (
    EPS,
    Case,
    D,
    allocating_args,
    bits,
    caller_owned_args,
    make,
    namespace,
    poison_pool,
    poison_q_out,
    registrations,
)

R = 64  # the rope tail; the NoPE dims [0, D - R) are the quantized ones
BLOCK = 64  # fp8_ds_mla's quantization block (two of mxfp8's 32-wide blocks)
VLLM = "preset=vllm"
NAN_INF = (float("nan"), float("inf"), -float("inf"))


@pytest.fixture
def registered():
    """register(...) with the pool and cleanup (support.vllm_cases.registrations); yields the factory."""
    with registrations() as make_registration:
        yield make_registration


def special(case: Case, *, cache_format: str | None = None) -> dict:
    """make(case) with every row class in kv: per row a NaN, a +Inf or a -Inf (rows cycle through them;
    row 0 has all three), signed zeros, one NoPE block of values below the amax floor (1e-4) and, in
    every fourth row, a NaN in the rope tail. Positions are random (the case's seed)."""
    x = make(case, cache_format=cache_format)
    g = torch.Generator().manual_seed(7919 + case.seed)
    kv = x["kv"].float()
    blocks = (D - R) // BLOCK
    for t in range(case.n):
        tiny, *others = torch.randperm(blocks, generator=g).tolist()
        kv[t, tiny * BLOCK : (tiny + 1) * BLOCK] = torch.randn(BLOCK, generator=g) * 1e-6
        # NaN / Inf / zeros in the other blocks, at random places
        cols = [b * BLOCK + int(torch.randint(BLOCK, (1,), generator=g)) for b in others]
        kinds = list(NAN_INF) if t == 0 else [NAN_INF[t % 3]]
        for c, v in zip(cols, kinds + [-0.0, 0.0, -0.0]):
            kv[t, c] = v
        if t % 4 == 3:
            kv[t, D - R + int(torch.randint(R, (1,), generator=g))] = float("nan")
    x["kv"] = kv.bfloat16()
    return x


def want_qkv(case: Case, x: dict, q_out: torch.Tensor, fmt: str, numerics) -> tuple:
    """(q_out, k_cache) after attn_prologue.qnorm_rope_kv_insert(..., numerics=numerics) on clones."""
    q_out, k_cache = q_out.clone(), x["k_cache"].clone()
    ap.qnorm_rope_kv_insert(
        x["q"], x["kv"], q_out, k_cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], EPS,
        case.block_size, fmt, numerics=numerics, apply_q_norm=case.q_norm, apply_q_rope=case.q_rope,
        q_layout="interleaved" if case.interleaved else "head_major",
    )  # fmt: skip
    return q_out, k_cache


def want_kv(case: Case, x: dict, cache: torch.Tensor, fmt: str, numerics, kv_scale=None) -> torch.Tensor:
    """The cache after attn_prologue.kv_rope_insert(..., numerics=numerics) on a clone."""
    out = cache.clone()
    ap.kv_rope_insert(x["kv"], out, x["slot_mapping"], x["positions"], x["cos_sin_cache"], case.block_size,
                      fmt, kv_scale=kv_scale, numerics=numerics)  # fmt: skip
    return out


def kv_args(case: Case, x: dict) -> tuple:
    return x["kv"], x["k_cache"], x["slot_mapping"], x["positions"], x["cos_sin_cache"], case.block_size


CASES = [
    Case(7, seed=60),
    Case(9, m=8, mxfp8=True, interleaved=True, slots32=True, negative_every=4, seed=61),
]


# ---- the default: vLLM's preset where it has an entry ---------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_the_allocating_form_writes_vllms_bytes_by_default(registered, case: Case, entry):
    r = registered("allocating")
    x = special(case)
    buf = poison_pool(r)
    q_poison = poison_q_out(case.n, rows_past=0)
    want_q, want_cache = want_qkv(case, x, q_poison, case.fmt, VLLM)
    _, defaults_cache = want_qkv(case, x, q_poison, case.fmt, None)
    assert not torch.equal(want_cache, defaults_cache)  # the rows tell the two apart
    q_padded = (r.qkv_op if entry == "torch op" else r.qkv)(*allocating_args(case, x))
    assert torch.equal(x["k_cache"], want_cache)
    assert torch.equal(bits(q_padded), bits(want_q))  # Q is the same whatever the numerics
    assert bits(buf[case.n :]).eq(bits(torch.tensor(float("nan")).bfloat16())).all()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("entry", ["torch op", "plain callable", "q_head_padded=0"])
def test_the_kv_only_op_writes_vllms_bytes_by_default(registered, case: Case, entry):
    r = registered("allocating")
    x = special(case)
    want = want_kv(case, x, x["k_cache"], case.fmt, VLLM)
    assert not torch.equal(want, want_kv(case, x, x["k_cache"], case.fmt, None))
    if entry == "q_head_padded=0":
        r.qkv_op(*allocating_args(case, x, q_head_padded=0))
    else:
        (r.kv_op if entry == "torch op" else r.kv_insert)(*kv_args(case, x), None, case.mxfp8)
    assert torch.equal(x["k_cache"], want)


@pytest.mark.parametrize("form", ["q_out_second", "q_out_third"])
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "mxfp8", "nvfp4_dsv4", "bf16"])
def test_caller_owned_forms_follow_the_rule_for_their_cache_format(registered, form, fmt):
    """vLLM's preset for the formats it covers; a cache_format it has no entry for (nvfp4_dsv4, bf16
    records in a uint8 cache) is written with the format's defaults, and registering it is not refused."""
    r = registered(form, cache_format=fmt)
    case = Case(7, m=6, block_size=16, seed=62)
    x = special(case, cache_format=fmt)
    q_out = poison_q_out(case.n)
    numerics = VLLM if fmt in ("fp8_ds_mla", "mxfp8") else None
    want_q, want_cache = want_qkv(case, x, q_out, fmt, numerics)
    r.qkv_op(*caller_owned_args(form, case, x, q_out))
    assert torch.equal(x["k_cache"], want_cache) and torch.equal(bits(q_out), bits(want_q))
    assert r.numerics_for(fmt) == (None if numerics is None else Numerics(preset="vllm"))


def test_formats_the_preset_lacks_get_their_defaults_on_the_kv_only_op(registered):
    """A bf16 cache (unquantized) and fp8_scale (per-tensor FP8) pick formats "preset=vllm" has no entry
    for: the default writes their defaults rather than raising at the call."""
    r = registered("allocating")
    case = Case(7, m=6, block_size=16, seed=63)
    x = special(case)
    with pytest.raises(NumericsError, match="preset vllm has no cache format bf16"):
        get_format("bf16").resolve_numerics(VLLM)  # (what passing the preset through would do)
    cache = torch.full((3, case.block_size, D), float("nan")).bfloat16()
    pages = cache.view(torch.uint8).view(3, -1)
    want = want_kv(case, x, pages, "bf16", None)
    r.kv_insert(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 16, None, False)
    assert torch.equal(pages, want)
    scale = torch.tensor([0.05])
    fp8 = torch.randint(0, 256, (3, case.block_size * D), dtype=torch.uint8)
    want = want_kv(case, x, fp8, "fp8_tensor", None, kv_scale=scale)
    r.kv_op(x["kv"], fp8, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 16, scale, False)
    assert torch.equal(fp8, want)
    assert r.numerics_for("bf16") is None and r.numerics_for("fp8_tensor") is None


# ---- an explicit numerics ------------------------------------------------------------------------
def test_numerics_is_a_keyword_of_register_defaulting_to_vllms():
    p = inspect.signature(vllm.register).parameters["numerics"]
    assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == vllm.VLLM_NUMERICS


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize(
    "numerics",
    [None, "", "preset=vllm-triton", "preset=vllm, e4m3_nan=0x7f", Numerics(e4m3_nan="0x7e"), VLLM],
    ids=repr,
)
def test_an_explicit_numerics_applies_to_every_call(registered, case: Case, numerics):
    r = registered("allocating", numerics=numerics)
    x, y = special(case), special(case)
    q_poison = poison_q_out(case.n, rows_past=0)
    want_q, want_cache = want_qkv(case, x, q_poison, case.fmt, numerics)
    poison_pool(r)
    q_padded = r.qkv(*allocating_args(case, x))
    assert torch.equal(x["k_cache"], want_cache) and torch.equal(bits(q_padded), bits(want_q))
    want = want_kv(case, y, y["k_cache"], case.fmt, numerics)
    r.kv_op(*kv_args(case, y), None, case.mxfp8)
    assert torch.equal(y["k_cache"], want)


def test_explicit_numerics_differ_from_the_default_where_they_should(registered):
    """The choice reaches the bytes: vllm-triton, vllm and the format defaults write three different
    caches for the same rows (so the test above would notice a numerics dropped)."""
    case = CASES[0]
    caches = []
    for numerics in ("preset=vllm-triton", vllm.VLLM_NUMERICS, None):
        r = registered("allocating", numerics=numerics)
        x = special(case)
        r.kv_insert(*kv_args(case, x), None, case.mxfp8)
        caches.append(x["k_cache"].numpy().tobytes())
    assert len(set(caches)) == 3


def test_an_explicit_caller_owned_preset_reaches_a_format_vllm_lacks(registered):
    case = Case(7, m=6, block_size=16, seed=64)
    caches = {}
    for numerics in ("preset=vllm-triton", vllm.VLLM_NUMERICS):
        r = registered("q_out_third", cache_format="bf16", numerics=numerics)
        x = special(case, cache_format="bf16")
        q_out = poison_q_out(case.n)
        _, want = want_qkv(case, x, q_out, "bf16", None if numerics == vllm.VLLM_NUMERICS else numerics)
        r.qkv(*caller_owned_args("q_out_third", case, x, q_out))
        assert torch.equal(x["k_cache"], want)
        caches[numerics] = x["k_cache"]
    assert not torch.equal(*caches.values())


def test_an_explicit_choice_a_dtype_picked_format_lacks_is_refused_at_the_call_writing_nothing(registered):
    """An explicit numerics applies as given, also to formats the cache's dtype picks: one that format
    lacks raises NumericsError there, before anything is written (the default never does)."""
    r = registered("allocating", numerics=VLLM)
    case = Case(7, m=6, block_size=16, seed=65)
    x = special(case)
    cache = torch.full((3, case.block_size, D), float("nan")).bfloat16()
    before = bits(cache).clone()
    with pytest.raises(NumericsError, match="bf16"):
        r.kv_op(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 16, None, False)
    assert torch.equal(bits(cache), before)


# ---- refused at register time --------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(numerics="preset=nope"), NumericsError, "unknown numerics preset 'nope'"),
        (dict(numerics="preset=flashinfer"), NumericsError, "preset flashinfer has no cache format fp8_ds_mla"),
        (dict(numerics="fp4_zero=positive"), NumericsError, "cache format fp8_ds_mla has no fp4_zero choice"),
        (dict(numerics="scale_floor"), NumericsError, "is not a parity choice"),
        (dict(numerics="e4m3_nan=0x7e, e4m3_nan=0x7f"), NumericsError, "sets e4m3_nan twice"),
        (dict(numerics=42), NumericsError, "got int"),
        (dict(form="q_out_third", cache_format="nvfp4_dsv4", numerics=VLLM), NumericsError,
         "write nvfp4_dsv4 records.*preset vllm has no cache format nvfp4_dsv4"),
        (dict(numerics="preset=vllm", form="nope"), InputError, "form must be one of"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_bad_numerics_are_refused_before_anything_is_registered(kw, error, match):
    ns = namespace()
    with pytest.raises(error, match=match):
        vllm.register(ns, new_namespace=True, **kw)
    for name in (vllm.QKV_NAME, vllm.KV_NAME):
        assert registration.existing_schema(ns, name) is None
    assert not any(r.namespace == ns for r in vllm._LIVE)
    r = vllm.register(ns, form="q_out_third", new_namespace=True)  # the names are free
    r.close()


def test_the_default_registers_for_every_cache_format():
    """The default never refuses: a caller-owned form may write any format, the preset covering it or not."""
    from attn_prologue.formats import FORMATS

    for fmt in FORMATS:
        r = vllm.register(namespace(), form="q_out_second", cache_format=fmt, new_namespace=True)
        try:
            want = Numerics(preset="vllm") if fmt in ("fp8_ds_mla", "mxfp8") else None
            assert r.numerics_for(fmt) == want
        finally:
            r.close()
