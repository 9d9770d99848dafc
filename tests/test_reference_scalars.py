"""Property tests of the reference's scalar building blocks (numerics.py, codecs' exponents) against
exact rational arithmetic and brute-force searches over value tables built from the bit layouts."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
import torch
from attn_prologue import codecs
from attn_prologue import numerics as nx
from attn_prologue.formats import Numerics, ScaleFloor, get_format
from hypothesis import given, settings
from hypothesis import strategies as st

from .support.reference_oracles import (
    E2M1_POS,
    E4M3_POS,
    SETTINGS,
    bits_from_f32,
    exact_ceil_log2,
    f32_from_bits,
    fma_oracle,
    nearest_code,
    positive_bf16_amax,
)

# =============================================================================================
# numerics: scalar conversions against brute-force oracles
# =============================================================================================
f32_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=100, **SETTINGS)
@given(st.lists(f32_finite, min_size=1, max_size=64), st.integers(0, 2**31 - 1))
def test_e4m3_bytes_is_nearest_even(values, seed):
    g = torch.Generator().manual_seed(seed)
    # hypothesis floats (edge-heavy) plus a random batch concentrated on the e4m3 range
    rnd = torch.randn(256, generator=g) * 2.0 ** torch.randint(-14, 10, (256,), generator=g)
    y = torch.cat((torch.tensor(values, dtype=torch.float32), rnd.float()))
    got = nx.e4m3_bytes(y).tolist()
    want = [nearest_code(v, E4M3_POS, 0x80) for v in y.tolist()]
    assert got == want


@settings(max_examples=100, **SETTINGS)
@given(st.lists(f32_finite, min_size=1, max_size=64), st.integers(0, 2**31 - 1))
def test_e2m1_codes_is_nearest_even(values, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = torch.rand(256, generator=g) * 14 - 7  # [-7, 7)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    y = torch.cat((torch.tensor(values, dtype=torch.float32), rnd, ties, -ties))
    got = nx.e2m1_codes(y).tolist()
    want = [nearest_code(v, E2M1_POS, 0x8) for v in y.tolist()]
    assert got == want


@settings(max_examples=40, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.bfloat16, torch.float16]))
def test_round_through_equals_cast(seed, dtype):
    """numerics.round_through (computed on the bits) equals torch's own fp32 -> dtype -> fp32
    conversion for random bit patterns (every exponent, subnormals, overflow) and the edges."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (1 << 14,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            65504.0,
            65519.996,
            65520.0,
            -65520.0,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-25,
            1 + 2.0**-8,
            1 + 3 * 2.0**-8,
            1 + 2.0**-11,
            3.3961e38,
            3.4028235e38,
            2.0**-126,
            2.0**-149,
        ]
    )
    x = torch.cat((x, edges, -edges))
    x = x[~torch.isnan(x)]
    got = nx.round_through(x, dtype)
    want = x.to(dtype).to(torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(nx.round_through(torch.tensor([math.nan]), dtype)).all()


# =============================================================================================
# ceil_log2_exponent: exhaustive over bf16
# =============================================================================================
def test_ceil_log2_exhaustive_bf16():
    """Every positive finite bf16 value r (bits 0x0001 .. 0x7F7F) and +Inf.

    Oracle: math.frexp (r = f * 2^k, 0.5 <= f < 1): ceil(log2 r) = k - 1 if f == 0.5 else k.
    Normal r: exact, saturated at 127 (like cvt.rp.satfinite.ue8m0x2.f32: r > 2^127, +Inf
    included, gives 127, the largest finite UE8M0 exponent). Subnormal r (bits < 0x0080) are outside the documented domain ("positive
    normal float32"): the bit trick gives -126 = max(exact, -126) for them; block_exponent never
    passes one (its amax floors keep r >= 2^-126, see test_block_exponent_exhaustive_bf16)."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    r = bits.view(torch.bfloat16).to(torch.float32)
    got = nx.ceil_log2_exponent(r).tolist()
    for b, v, e in zip(range(1, 0x7F80), r.tolist(), got):
        f, k = math.frexp(v)
        exact = k - 1 if f == 0.5 else k
        if b >= 0x0080:
            assert e == min(exact, 127), (hex(b), v, e, exact)
        else:
            assert e == max(exact, -126) == -126, (hex(b), v, e, exact)
    assert len(got) == 0x7F7F and got[-1] == 127  # bf16 max (2 - 2^-7) * 2^127: exact 128
    assert nx.ceil_log2_exponent(torch.tensor([math.inf])).item() == 127


def test_ceil_log2_random_f32():
    """Random positive normal float32 (all mantissa bits in play), oracle from the bits as ints."""
    rng = random.Random(1)
    bits = [rng.randrange(0x00800000, 0x7F800000) for _ in range(20000)]
    bits += [(e << 23) | m for e in (1, 2, 126, 127, 128, 253, 254) for m in (0, 1, 0x7FFFFF)]
    r = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = nx.ceil_log2_exponent(r).tolist()
    for b, e in zip(bits, got):
        ex, m = b >> 23, b & 0x7FFFFF
        assert e == min(ex - 127 if m == 0 else ex - 126, 127), hex(b)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "mxfp8", "fp8_token", "mxfp4"])
def test_block_exponent_exhaustive_bf16(name):
    """e for every bf16 amax >= 0 equals the exact ceil(log2(max(amax, floor) / fp_max)) of the
    rationals (clamped for mxfp4), although the code divides in float32 (or, for fp8_token,
    multiplies by fl(1/448)). Why they agree: for fp_max = 448 = 1.75 * 2^8 or 6 = 1.5 * 2^2, a
    float32 amax != fp_max * 2^k is at least 1/1.75 (resp. 1/1.5) quotient ulps away from 2^k, so
    the rounded quotient never lands on the other side of 2^k; fl(1/448) = (1/448)(1 + 0.375 *
    2^-23) moves a quotient of exactly 2^k by less than half an ulp."""
    fmt = get_format(name)
    amax = positive_bf16_amax()
    got = codecs.block_exponent(fmt, amax).tolist()
    floor = Fraction(torch.tensor(fmt.amax_floor, dtype=torch.float32).item())
    fp_max = Fraction(fmt.fp_max)
    for a, e in zip(amax.tolist(), got):
        want = exact_ceil_log2(max(Fraction(a), floor) / fp_max)
        if name == "mxfp4":
            want = min(max(want, -127), 127)
        assert e == want, (name, a, e, want)
    # the floors keep r = max(amax, floor) / fp_max a normal float32
    assert min(got) == (-126 if name == "mxfp4" else -22)
    # a block holding +Inf: saturated exponent 127 (see test_golden_vectors NaN/Inf tests)
    assert codecs.block_exponent(fmt, torch.tensor([math.inf])).item() == 127


# =============================================================================================
# fma_f32: correctly rounded against exact rational arithmetic
# =============================================================================================
def _fma_cases() -> list[tuple[float, float, float]]:
    rng = random.Random(12345)
    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    cases = []

    def rand_f32(lo_e, hi_e):
        m = rng.getrandbits(23)
        e = rng.randint(lo_e, hi_e)
        s = rng.getrandbits(1) << 31
        return f32_from_bits(s | ((e + 127) << 23) | m)

    # 1. random finite bit patterns over the whole range
    while len(cases) < 800:
        a, b, c = (f32_from_bits(rng.getrandbits(32)) for _ in range(3))
        if all(math.isfinite(v) for v in (a, b, c)):
            cases.append((a, b, c))
    # 2. comparable magnitudes (real cancellation and rounding work)
    for _ in range(1200):
        a, b = rand_f32(-20, 20), rand_f32(-20, 20)
        p = f32(a * b)
        kind = rng.randrange(4)
        if kind == 0:
            c = rand_f32(-40, 40)
        elif kind == 1:
            c = -p  # cancellation: the result is the rounding error of a * b
        elif kind == 2:
            c = f32(-p * (1 + rng.uniform(-(2**-10), 2**-10)))
        else:
            c = f32(p * 2.0 ** rng.randint(-30, -20) * rng.choice((1, -1)))  # tiny c vs product
        cases.append((a, b, c))
    # 3. products exactly halfway between two float32, nudged by tiny c of either sign: a naive
    #    (a*b + c in float64, then to float32) double-rounds these the wrong way.
    for _ in range(600):
        i, j = rng.randrange(1, 2048) | 1, rng.randrange(1, 2048) | 1
        sh = rng.randint(-30, 30)
        a = (1 + i * 2.0**-12) * 2.0**sh
        b = (1 + j * 2.0**-12) * rng.choice((1.0, -1.0))  # product has bit 2^-24 set: a tie
        c = rng.choice((0.0, 1.0, -1.0)) * 2.0 ** (sh - rng.randint(26, 100))
        cases.append((f32(a), f32(b), f32(c)))
    # 4. subnormal results and products
    for _ in range(400):
        a, b = rand_f32(-80, -60), rand_f32(-80, -60)
        c = rand_f32(-126, -110) if rng.random() < 0.7 else f32_from_bits(rng.getrandbits(23))
        cases.append((a, b, c))
    # 5. near overflow
    for _ in range(200):
        a, b = rand_f32(60, 64), rand_f32(62, 64)
        c = rand_f32(120, 127)
        cases.append((a, b, c))
    # 6. signed zeros
    for a, b, c in (
        (0.0, 1.0, -0.0),
        (-0.0, 1.0, -0.0),
        (-0.0, 1.0, 0.0),
        (1.0, -1.0, 1.0),
        (2.0**-100, 2.0**-100, -0.0),
        (-(2.0**-100), 2.0**-100, 0.0),
        (-(2.0**-100), 2.0**-100, -0.0),
        (1.5, 2.0, -3.0),
    ):
        cases.append((a, b, c))
    return cases


def test_fma_f32_correctly_rounded():
    cases = _fma_cases()
    assert len(cases) > 3000
    a, b, c = (torch.tensor([t[i] for t in cases], dtype=torch.float32) for i in range(3))
    got = nx.fma_f32(a, b, c).view(torch.int32).tolist()
    naive = (a.double() * b.double() + c.double()).float().view(torch.int32).tolist()
    n_naive_wrong = 0
    for (x, y, z), g, nv in zip(cases, got, naive):
        want = bits_from_f32(fma_oracle(x, y, z))
        assert g & 0xFFFFFFFF == want, (x, y, z, hex(g & 0xFFFFFFFF), hex(want))
        n_naive_wrong += (nv & 0xFFFFFFFF) != want
    assert n_naive_wrong > 50  # the adversarial cases do defeat double rounding


def test_fma_f32_non_finite():
    inf, nan = math.inf, math.nan
    a = torch.tensor([inf, inf, inf, 1e38, -1e38, nan, 1.0, 0.0])
    b = torch.tensor([0.0, 1.0, 2.0, 1e38, 1e38, 1.0, 1.0, 5.0])
    c = torch.tensor([1.0, -inf, 1.0, 0.0, 0.0, 1.0, nan, -inf])
    r = nx.fma_f32(a, b, c).tolist()
    assert math.isnan(r[0]) and math.isnan(r[1])  # inf * 0, inf - inf
    assert r[2] == inf and r[3] == inf and r[4] == -inf  # overflow
    assert math.isnan(r[5]) and math.isnan(r[6]) and r[7] == -inf


@pytest.mark.parametrize("name", ["fp8_ds_mla", "mxfp8"])
def test_block_exponent_scale_floor_exhaustive_bf16(name):
    """ScaleFloor.SCALE: e = ceil(log2(max(amax / 448, fl(1e-4)))) for every bf16 amax >= 0, against
    exact rationals (the float32 quotient never crosses a power of two, as for the amax floor)."""
    fmt = get_format(name)
    amax = positive_bf16_amax()
    got = codecs.block_exponent(fmt, amax, Numerics(scale_floor=ScaleFloor.SCALE)).tolist()
    floor = Fraction(torch.tensor(fmt.amax_floor, dtype=torch.float32).item())
    for a, e in zip(amax.tolist(), got):
        assert e == exact_ceil_log2(max(Fraction(a) / 448, floor)), (a, e)
    assert min(got) == -13  # byte 114
    amax_floor = codecs.block_exponent(fmt, amax).tolist()
    agree = [a >= 0.0448 for a in amax.tolist()]
    assert all(g == h for g, h, ok in zip(got, amax_floor, agree) if ok)
    assert any(g != h for g, h in zip(got, amax_floor))
