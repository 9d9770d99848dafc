"""Property tests of the reference (docs/op.md, docs/formats.md) against independent oracles:
exact rational arithmetic (fractions.Fraction), brute-force nearest-value searches over hand-built
value tables, float64 re-derivations of the math, and slow per-row Python loops for the paging."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
import torch
from attn_prologue import codecs
from attn_prologue import numerics as nx
from attn_prologue import reference as ref
from attn_prologue.formats import ScaleFloor, get_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# D, R per format (the fixed-D formats at their D; the any-D formats at a small D)
FMT_DR = {
    "fp8_ds_mla": (512, 64),
    "mxfp8": (512, 64),
    "fp8_token": (128, 64),
    "mxfp4": (128, 64),
    "bf16": (128, 64),
    "fp8_tensor": (64, 32),
    "nvfp4_v41": (512, 64),
    "nvfp4_dsv4": (512, 64),
}
ALL_FORMATS = sorted(FMT_DR)


# =============================================================================================
# helpers: float32 bits and exact rounding
# =============================================================================================
def f32_from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def bits_from_f32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def exact_ceil_log2(q: Fraction) -> int:
    """The smallest integer k with q <= 2^k, for rational q > 0, in integer arithmetic."""
    assert q > 0
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return k


def round_to_f32(q: Fraction) -> float:
    """Correct rounding (nearest, ties to even) of a rational to float32, with subnormals and
    overflow to Inf. The sign of a zero result is handled by the caller."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    k = exact_ceil_log2(a)  # 2^(k-1) < a <= 2^k
    e = k - 1 if Fraction(2) ** k != a else k  # 2^e <= a < 2^(e+1)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n = round(a / quantum)  # Fraction.__round__: half to even
    v = n * quantum
    if v >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(v)  # exact: v is a float32


# Independent value tables, built from the bit layouts (not from torch's float8 / numerics.py).
def _e4m3_table() -> list[tuple[float, int]]:
    out = []
    for b in range(0x7F):  # non-negative finite codes 0x00 .. 0x7E
        ex, m = b >> 3, b & 7
        v = m / 8 * 2.0**-6 if ex == 0 else (1 + m / 8) * 2.0 ** (ex - 7)
        out.append((v, b))
    return out


E4M3_POS = _e4m3_table()
E2M1_POS = [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7)]


def nearest_code(y: float, table, sign_bit: int) -> int:
    """Nearest table value to y (saturating), ties to the even code; sign bit from signbit(y)."""
    a = min(abs(y), table[-1][0])  # saturate (and keep huge |y| from losing the distances)
    best = min(table, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return best[1] | (sign_bit if math.copysign(1.0, y) < 0 else 0)


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


def _positive_bf16_amax() -> torch.Tensor:
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # 0 and all positive finite
    return bits.view(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "mxfp8", "fp8_token", "mxfp4"])
def test_block_exponent_exhaustive_bf16(name):
    """e for every bf16 amax >= 0 equals the exact ceil(log2(max(amax, floor) / fp_max)) of the
    rationals (clamped for mxfp4), although the code divides in float32 (or, for fp8_token,
    multiplies by fl(1/448)). Why they agree: for fp_max = 448 = 1.75 * 2^8 or 6 = 1.5 * 2^2, a
    float32 amax != fp_max * 2^k is at least 1/1.75 (resp. 1/1.5) quotient ulps away from 2^k, so
    the rounded quotient never lands on the other side of 2^k; fl(1/448) = (1/448)(1 + 0.375 *
    2^-23) moves a quotient of exactly 2^k by less than half an ulp."""
    fmt = get_format(name)
    amax = _positive_bf16_amax()
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


def _fma_oracle(a: float, b: float, c: float) -> float:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        prod_neg = (math.copysign(1, a) * math.copysign(1, b)) < 0
        both_neg_zero = (a * b == 0) and prod_neg and c == 0 and math.copysign(1, c) < 0
        return -0.0 if both_neg_zero else 0.0  # IEEE: exact zero sum is +0 under RN
    r = round_to_f32(exact)
    if r == 0:
        return math.copysign(0.0, float(exact.numerator))  # underflow keeps the sign
    return r


def test_fma_f32_correctly_rounded():
    cases = _fma_cases()
    assert len(cases) > 3000
    a, b, c = (torch.tensor([t[i] for t in cases], dtype=torch.float32) for i in range(3))
    got = nx.fma_f32(a, b, c).view(torch.int32).tolist()
    naive = (a.double() * b.double() + c.double()).float().view(torch.int32).tolist()
    n_naive_wrong = 0
    for (x, y, z), g, nv in zip(cases, got, naive):
        want = bits_from_f32(_fma_oracle(x, y, z))
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


# =============================================================================================
# round trips: decode(encode(x)) error bounds
# =============================================================================================
@st.composite
def token_values(draw, d: int, allow_big: bool = True):
    """[M, d] float32 values that are bf16 numbers (what the op stores): random mantissas with a
    per-row magnitude and a per-element dynamic range, zeros, and edge floats from hypothesis."""
    seed = draw(st.integers(0, 2**31 - 1))
    m = draw(st.integers(1, 3))
    log_scale = draw(st.integers(-30, 30))
    spread = draw(st.integers(0, 24))
    zero_frac = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(m, d, generator=g)
    expo = torch.randint(-spread, 1, (m, d), generator=g).float()
    x = mant * torch.exp2(expo + log_scale)
    x = torch.where(torch.rand(m, d, generator=g) < zero_frac, torch.zeros_like(x), x)
    # Beyond ~2.5e38 a block's decoded value can round up to 2^128 and overflow float32 on
    # decode (see test_golden_vectors.py::test_decode_overflow_near_float32_max).
    big = 2.0**127 * 1.5 if allow_big else 2.0**100  # 2.55e38 / 1.27e30, exact float32
    specials = draw(
        st.lists(st.tuples(st.integers(0, m * d - 1), st.floats(-big, big, width=32)), max_size=6)
    )
    flat = x.reshape(-1)
    for i, v in specials:
        flat[i] = v
    return flat.reshape(m, d).to(torch.bfloat16).to(torch.float32)


def _check_e4m3_block_round_trip(name: str, x: torch.Tensor):
    fmt = get_format(name)
    d = x.shape[1]
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, d)
    nq = fmt.dims(d)[0]
    qb = fmt.quant_block
    floor = torch.tensor(fmt.amax_floor, dtype=torch.float32).item()
    for row in range(x.shape[0]):
        for blk in range(nq // qb):
            xs = x[row, blk * qb : (blk + 1) * qb].double()
            ds = dec[row, blk * qb : (blk + 1) * qb].double()
            s = scales[row, blk].item()
            # the scale is a power of two, and the smallest one with max(amax, floor) <= 448 s
            assert s > 0 and math.frexp(s)[0] == 0.5
            amax = max(xs.abs().max().item(), floor)
            assert amax <= 448 * s and amax > 224 * s, (amax, s)
            # Per element: e4m3 keeps 3 mantissa bits, so a normal result (|x / s| >= 2^-6) is off
            # by at most half an ulp = 2^-4 of its magnitude; a subnormal one (spacing 2^-9) by at
            # most 2^-10 in element units, i.e. 2^-10 * s. x / s is exact (power of two).
            err = (ds - xs).abs()
            bound = torch.maximum(xs.abs() * 2.0**-4, torch.full_like(xs, 2.0**-10 * s))
            assert (err <= bound).all(), (name, row, blk, (err - bound).max().item())
            # and it is the nearest e4m3 value (independent table, ties to even)
            el = data[row, blk * qb : (blk + 1) * qb].tolist()
            want = [nearest_code(v / s, E4M3_POS, 0x80) for v in xs.tolist()]
            assert el == want
    # the bf16 rope tail of fp8_ds_mla round-trips exactly
    if fmt.rope_tail_bf16:
        assert torch.equal(dec[:, nq:], x[:, nq:])


@settings(max_examples=80, **SETTINGS)
@given(token_values(512))
def test_round_trip_fp8_ds_mla(x):
    _check_e4m3_block_round_trip("fp8_ds_mla", x)


@settings(max_examples=80, **SETTINGS)
@given(token_values(512))
def test_round_trip_mxfp8(x):
    _check_e4m3_block_round_trip("mxfp8", x)


@settings(max_examples=120, **SETTINGS)
@given(token_values(128))
def test_round_trip_fp8_token(x):
    _check_e4m3_block_round_trip("fp8_token", x)


@settings(max_examples=120, **SETTINGS)
@given(token_values(128))
def test_round_trip_mxfp4(x):
    fmt = get_format("mxfp4")
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, 128)
    codes = codecs.unpack_e2m1(data)
    for row in range(x.shape[0]):
        for blk in range(4):
            xs = x[row, blk * 32 : (blk + 1) * 32].double()
            ds = dec[row, blk * 32 : (blk + 1) * 32].double()
            s = scales[row, blk].item()
            amax = max(xs.abs().max().item(), 6 * 2.0**-126)
            assert amax <= 6 * s and amax > 3 * s, (amax, s)
            # e2m1 spacing is 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]: the error of an element is
            # at most half the spacing where it lies, in units of s.
            y = xs.abs() / s
            half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
            assert ((ds - xs).abs() <= half_gap * s).all()
            want = [nearest_code(v / s, E2M1_POS, 0x8) for v in xs.tolist()]
            assert codes[row, blk * 32 : (blk + 1) * 32].tolist() == want


@settings(max_examples=60, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_round_trip_bf16_exact(seed, m):
    """Every bf16 value (any finite or infinite bit pattern) comes back bit for bit."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-32768, 32768, (m, 96), generator=g, dtype=torch.int32).to(torch.int16)
    bits[bits.view(torch.bfloat16).isnan()] = 0x3F80  # NaN payloads are not pinned (see golden)
    x = bits.view(torch.bfloat16).to(torch.float32)
    fmt = get_format("bf16")
    data, scale = codecs.encode_tokens(fmt, x)
    assert torch.equal(data.view(torch.int16), bits)  # little-endian bf16 bytes
    dec, _ = codecs.decode_tokens(fmt, data, scale, 96)
    assert torch.equal(dec.view(torch.int32), x.view(torch.int32))


@settings(max_examples=120, **SETTINGS)
@given(token_values(64, allow_big=False), st.floats(2.0**-12, 2.0**12, width=32))
def test_round_trip_fp8_tensor(x, sigma):
    """y = fl(x / sigma) (rel. error 2^-24), e4m3 (2^-4 relative or 2^-10 absolute, as above),
    decoded as fl(e4m3 * sigma) (rel. error 2^-24): bound max(2^-4 |x|, 2^-10 sigma) plus 2^-21
    (|x| + sigma). |x / sigma| beyond 464 (448 + half the top spacing) saturates to +-448."""
    fmt = get_format("fp8_tensor")
    kv_scale = torch.tensor(sigma, dtype=torch.float32)
    data, scale = codecs.encode_tokens(fmt, x, kv_scale)
    dec, _ = codecs.decode_tokens(fmt, data, scale, 64, kv_scale)
    xs, ds = x.double(), dec.double()
    y = xs / sigma
    big = y.abs() > 464
    sat = torch.tensor(448 * sigma, dtype=torch.float32).double()
    assert torch.equal(ds[big], torch.copysign(sat.expand_as(ds[big]), xs[big]))
    assert torch.equal(data[big], torch.where(xs[big] > 0, 0x7E, 0xFE).to(torch.uint8))
    bound = torch.maximum(xs.abs() * 2.0**-4, torch.full_like(xs, 2.0**-10 * sigma))
    bound = bound + 2.0**-21 * (xs.abs() + sigma)
    err = (ds - xs).abs()
    assert (err[~big] <= bound[~big]).all()


# =============================================================================================
# paging: skipped rows and record placement, against a per-row Python loop
# =============================================================================================
def oracle_cache(
    before: torch.Tensor,
    name: str,
    d: int,
    bs: int,
    slots: list[int],
    data: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Slow independent paging: one row at a time, byte offsets from docs/formats.md."""
    db, sb = data.shape[1], scale.shape[1]
    out = before.clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, o = slot // bs, slot % bs
        for i in range(db):
            out[blk, o * db + i] = data[t, i]
        for i in range(sb):
            out[blk, bs * db + o * sb + i] = scale[t, i]
    return out


def make_cos_sin(max_pos: int, r: int, base: float = 10000.0) -> torch.Tensor:
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=1).float()


@st.composite
def paging_case(draw):
    name = draw(st.sampled_from(ALL_FORMATS))
    bs = draw(st.integers(1, 16))
    nblocks = draw(st.integers(1, 5))
    pad = draw(st.integers(0, 48))
    strided = draw(st.booleans())
    n = draw(st.integers(0, 10))
    m = draw(st.integers(0, n))
    nslots = nblocks * bs
    pool = draw(st.permutations(list(range(nslots))))
    slots = []
    for t in range(m):
        if t < len(pool) and draw(st.booleans()):
            slots.append(pool[t])
        else:
            slots.append(-draw(st.integers(1, 2**40)))  # any negative slot means skip
    seed = draw(st.integers(0, 2**31 - 1))
    return name, bs, nblocks, pad, strided, n, slots, seed


def _make_cache(name, d, bs, nblocks, pad, strided, g):
    fmt = get_format(name)
    used = bs * fmt.bytes_per_token(d)
    base = torch.randint(0, 256, (nblocks, used + pad), generator=g, dtype=torch.uint8)
    cache = base[:, :used] if strided else base
    return base, cache


@settings(max_examples=400, **SETTINGS)
@given(paging_case(), st.sampled_from(["kv_rope_insert", "qnorm_rope_kv_insert"]))
def test_paging_and_skipped_rows(case, op):
    name, bs, nblocks, pad, strided, n, slots, seed = case
    d, r = FMT_DR[name]
    g = torch.Generator().manual_seed(seed)
    base, cache = _make_cache(name, d, bs, nblocks, pad, strided, g)
    before = base.clone()
    # kv as a slice of a wider projection: row stride > D
    kv = (torch.randn(n, d + 24, generator=g) * 3).to(torch.bfloat16)[:, :d]
    positions = torch.randint(0, 64, (n,), generator=g)
    cs = make_cos_sin(64, r)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    kv_scale = torch.tensor(0.125) if name == "fp8_tensor" else None
    if op == "kv_rope_insert":
        ref.kv_rope_insert(kv, cache, slot_t, positions, cs, bs, name, kv_scale=kv_scale)
    else:
        h = 2
        q_in = torch.randn(n, h, d, generator=g).to(torch.bfloat16)
        q_out = torch.full((n, h, d), math.nan, dtype=torch.bfloat16)
        ref.qnorm_rope_kv_insert(
            q_in, kv, q_out, cache, slot_t, positions, cs, 1e-6, bs, name, kv_scale=kv_scale
        )
    m = len(slots)
    vals = ref.kv_values(kv[:m], positions[:m], cs)
    data, scale = codecs.encode_tokens(get_format(name), vals, kv_scale)
    want = oracle_cache(before, name, d, bs, slots, data, scale)
    assert torch.equal(base, want)
    if any(s >= 0 for s in slots):
        assert not torch.equal(base, before)  # random records over random poison


# =============================================================================================
# qnorm_rope_kv_insert: the op contract against a float64 oracle
# =============================================================================================
def q_oracle(q_in, positions, cs, eps, r, apply_q_norm=True) -> torch.Tensor:
    x = q_in.double()
    if apply_q_norm:
        x = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return rope_oracle(x, positions, cs, r, head_axis=True)


def rope_oracle(x, positions, cs, r, head_axis=False) -> torch.Tensor:
    d = x.shape[-1]
    c = cs[positions, : r // 2].double()
    s = cs[positions, r // 2 : r].double()
    if head_axis:
        c, s = c[:, None, :], s[:, None, :]
    out = x.clone()
    e, o = x[..., d - r :: 2], x[..., d - r + 1 :: 2]
    out[..., d - r :: 2] = e * c - o * s
    out[..., d - r + 1 :: 2] = e * s + o * c
    return out


def ulp_of(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of dtype at |y| (float64 in, float64 out), subnormals included."""
    mant_bits, min_exp = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    _, e = torch.frexp(y.abs())  # |y| = f * 2^e, 0.5 <= f < 1: floor(log2 |y|) = e - 1
    e = torch.where(y == 0, torch.full_like(e, min_exp), torch.clamp(e - 1, min=min_exp))
    return torch.exp2((e - mant_bits).double())


def f32_slack(want64: torch.Tensor, r: int) -> torch.Tensor:
    """How far the float32 computation may be from the float64 oracle: 2^-19 relative (the sum of
    squares, sqrt and division add up to ~2^-20 relative in the inverse RMS) of |y| on the
    normalized dims, and of the pair norm sqrt(even^2 + odd^2) on the RoPE dims (a rotation that
    cancels keeps the absolute error of its products, not a relative one)."""
    d = want64.shape[-1]
    slack = want64.abs().clone()
    t = want64[..., d - r :]
    pair = torch.sqrt(t[..., 0::2] ** 2 + t[..., 1::2] ** 2)
    slack[..., d - r :] = torch.stack((pair, pair), dim=-1).reshape(t.shape)
    return slack * 2.0**-19 + 2.0**-40


def assert_close_ulp(got: torch.Tensor, want64: torch.Tensor, dtype, atol: torch.Tensor | float):
    """|got - want| <= 1 ulp(want) + atol: the fp32 result is within atol of want (float64), then
    one rounding to dtype (half an ulp; one ulp covers a rounding-boundary crossing)."""
    err = (got.double() - want64).abs()
    bound = ulp_of(want64, dtype) + atol
    assert torch.isfinite(got).all()
    assert (err <= bound).all(), (err - bound).max().item()


def ordered(bits16: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude 16-bit float bits -> integers in value order (+0 and -0 both 0)."""
    b = bits16.to(torch.int32)
    mag = b & 0x7FFF
    return torch.where(b < 0, -mag, mag)


@st.composite
def op_case(draw):
    name = draw(st.sampled_from(ALL_FORMATS))
    n = draw(st.integers(1, 6))
    extra_rows = draw(st.integers(0, 3))
    h = draw(st.integers(1, 4))
    p = h + draw(st.sampled_from([0, 0, 1, 3]))
    m = draw(st.integers(0, n))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    order = draw(st.sampled_from(["kernel", "eager"]))
    apply_q_norm = draw(st.sampled_from([True, True, False]))
    log_scale = draw(st.integers(-6, 6))
    eps = draw(st.sampled_from([1e-6, 1e-5]))
    seed = draw(st.integers(0, 2**31 - 1))
    return name, n, extra_rows, h, p, m, dtype, order, apply_q_norm, log_scale, eps, seed


def run_op(
    name, n, extra_rows, h, p, m, dtype, order, apply_q_norm, log_scale, eps, seed, bs=4, max_pos=4096
):
    d, r = FMT_DR[name]
    g = torch.Generator().manual_seed(seed)
    q_in = (torch.randn(n, h, d, generator=g) * 2.0**log_scale).to(dtype)
    if n > 1:
        q_in[1, 0] = 0  # an all-zero head: rsqrt(eps) * 0 = 0
    kv = (torch.randn(n, d + 16, generator=g) * 2.0**log_scale).to(dtype)[:, :d]
    positions = torch.randint(0, max_pos, (n,), generator=g)
    cs = make_cos_sin(max_pos, r)
    nblocks = max(1, (n + bs - 1) // bs)
    slots = torch.randperm(nblocks * bs, generator=g)[:m]
    if m > 1:
        slots[0] = -1
    q_out = torch.full((n + extra_rows, p, d), math.nan, dtype=dtype)
    q_out[n:].view(torch.int16).random_(generator=g)  # rows beyond N: random poison
    base, cache = _make_cache(name, d, bs, nblocks, 8, True, g)
    q_before, cache_before = q_out.clone(), base.clone()
    kv_scale = torch.tensor(0.0625) if name == "fp8_tensor" else None
    ref.qnorm_rope_kv_insert(
        q_in,
        kv,
        q_out,
        cache,
        slots,
        positions,
        cs,
        eps,
        bs,
        name,
        kv_scale=kv_scale,
        apply_q_norm=apply_q_norm,
        order=order,
    )
    return dict(
        q_in=q_in,
        kv=kv,
        positions=positions,
        cs=cs,
        slots=slots,
        q_out=q_out,
        base=base,
        q_before=q_before,
        cache_before=cache_before,
        kv_scale=kv_scale,
        d=d,
        r=r,
        bs=bs,
    )


@settings(max_examples=300, **SETTINGS)
@given(op_case())
def test_qnorm_rope_kv_insert_contract(case):
    name, n, extra_rows, h, p, m, dtype, order, apply_q_norm, log_scale, eps, seed = case
    o = run_op(*case)
    q_out, d, r = o["q_out"], o["d"], o["r"]
    # rows beyond N: untouched, bit for bit
    assert torch.equal(q_out[n:].view(torch.int16), o["q_before"][n:].view(torch.int16))
    # pad heads [H, P) of rows < N: exactly the zero bit pattern
    assert (q_out[:n, h:].view(torch.int16) == 0).all()
    # live heads of ALL N rows (M <= N: DP padding still processes Q) vs the float64 oracle
    want = q_oracle(o["q_in"], o["positions"], o["cs"], eps, r, apply_q_norm)
    assert_close_ulp(q_out[:n, :h], want, dtype, f32_slack(want, r))
    # cache: rows t < M with slot >= 0 only, at their records (per-row oracle loop)
    slots = o["slots"].tolist()
    vals = ref.kv_values(o["kv"][: len(slots)], o["positions"][: len(slots)], o["cs"], order=order)
    # KV step 3: the values the cache encodes are I/O-dtype numbers (rounded after RoPE)
    assert torch.equal(vals, vals.to(dtype).to(torch.float32))
    data, scale = codecs.encode_tokens(get_format(name), vals, o["kv_scale"])
    assert torch.equal(o["base"], oracle_cache(o["cache_before"], name, d, o["bs"], slots, data, scale))
    # the values the cache stores: RoPE of kv rounded through the I/O dtype (float64 oracle)
    if len(slots):
        kv_want = rope_oracle(o["kv"][: len(slots)].double(), o["positions"][: len(slots)], o["cs"], r)
        assert_close_ulp(vals, kv_want, dtype, f32_slack(kv_want, r))


def test_dp_padding_explicit():
    """M = 1 < N = 5: Q for all 5 rows, KV for row 0 only."""
    case = ("fp8_ds_mla", 5, 2, 3, 4, 1, torch.bfloat16, "kernel", True, 0, 1e-6, 11)
    o = run_op(*case)
    want = q_oracle(o["q_in"], o["positions"], o["cs"], 1e-6, 64)
    assert_close_ulp(o["q_out"][:5, :3], want, torch.bfloat16, f32_slack(want, 64))
    assert (o["q_out"][:5, 3:].view(torch.int16) == 0).all()
    assert torch.equal(o["q_out"][5:].view(torch.int16), o["q_before"][5:].view(torch.int16))
    slot = o["slots"][0].item()
    blk, off = divmod(slot, 4)
    changed = (o["base"] != o["cache_before"]).nonzero()
    assert changed.numel() > 0
    assert (changed[:, 0] == blk).all()  # only row 0's block was written
    cols = changed[:, 1]
    in_data = (cols >= off * 576) & (cols < (off + 1) * 576)
    in_scale = (cols >= 4 * 576 + off * 8) & (cols < 4 * 576 + (off + 1) * 8)
    assert (in_data | in_scale).all()


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_n_zero_is_noop(name):
    d, r = FMT_DR[name]
    g = torch.Generator().manual_seed(3)
    q_out = torch.full((3, 4, d), math.nan, dtype=torch.bfloat16)
    base, cache = _make_cache(name, d, 2, 2, 8, False, g)
    q_before, cache_before = q_out.clone(), base.clone()
    kv_scale = torch.tensor(1.0) if name == "fp8_tensor" else None
    ref.qnorm_rope_kv_insert(
        torch.empty(0, 2, d, dtype=torch.bfloat16),
        torch.empty(0, d, dtype=torch.bfloat16),
        q_out,
        cache,
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        make_cos_sin(8, r),
        1e-6,
        2,
        name,
        kv_scale=kv_scale,
    )
    assert torch.equal(q_out.view(torch.int16), q_before.view(torch.int16))
    assert torch.equal(base, cache_before)
    ref.kv_rope_insert(
        torch.empty(0, d, dtype=torch.bfloat16),
        cache,
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        make_cos_sin(8, r),
        2,
        name,
        kv_scale=kv_scale,
    )
    assert torch.equal(base, cache_before)


@settings(max_examples=100, **SETTINGS)
@given(
    st.sampled_from(["fp8_ds_mla", "bf16", "fp8_token"]),
    st.integers(1, 6),
    st.integers(1, 4),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.integers(-4, 4),
    st.integers(0, 2**31 - 1),
)
def test_kernel_vs_eager_order(name, n, h, dtype, log_scale, seed):
    """Both orders agree within 1 ulp of the I/O dtype on q_out and 1 bf16 ulp on the stored
    16-bit values (the fp8_ds_mla rope tail; every value of the bf16 cache format), EXCEPT where
    RoPE cancels (see assert_orders_agree)."""
    outs = {}
    for order in ("kernel", "eager"):
        outs[order] = run_op(name, n, 1, h, h + 1, n, dtype, order, True, log_scale, 1e-6, seed)
    d, r = FMT_DR[name]
    assert_orders_agree(outs["kernel"]["q_out"][:n], outs["eager"]["q_out"][:n], r, dtype)
    ca, cb = outs["kernel"]["base"], outs["eager"]["base"]
    slots = [s for s in outs["kernel"]["slots"].tolist() if s >= 0]
    bs = 4
    for slot in slots:
        blk, o = divmod(slot, bs)
        if name == "fp8_ds_mla":
            lo, hi, rr = o * 576 + 448, o * 576 + 576, r  # the tail holds exactly the rope dims
        elif name == "bf16":
            lo, hi, rr = o * 2 * d, (o + 1) * 2 * d, r
        else:
            continue
        ta = ca[blk, lo:hi].contiguous().view(torch.bfloat16)
        tb = cb[blk, lo:hi].contiguous().view(torch.bfloat16)
        assert_orders_agree(ta, tb, rr, torch.bfloat16)


def assert_orders_agree(a: torch.Tensor, b: torch.Tensor, r: int, dtype: torch.dtype):
    """a, b [..., D] in a 16-bit dtype from the two orders.

    Dims [0, D-R) (normalized only): within 1 ulp (ordered bit patterns).
    RoPE dims: within 1 ulp + 2^-21 * |pair|, |pair| = sqrt(even^2 + odd^2). The orders differ
    in float32 by a few roundings of the PRODUCTS e*c, o*s (fma or not), i.e. a few 2^-24 *
    (|e c| + |o s|) <= 2^-23 * sqrt(2) * |pair|, which is NOT small against the result when the
    rotation cancels (e c ~ o s): then the 16-bit results can be many ulps apart (measured: up to
    25 bf16 ulps in 1 of ~2M random values). docs/op.md's "within 1 bf16 ulp" holds only without
    such cancellation."""
    d = a.shape[-1]
    ia, ib = a.view(torch.int16), b.view(torch.int16)
    nope = (ordered(ia[..., : d - r]) - ordered(ib[..., : d - r])).abs()
    assert nope.numel() == 0 or nope.max().item() <= 1
    ta, tb = a[..., d - r :].double(), b[..., d - r :].double()
    pair = torch.sqrt(ta[..., 0::2] ** 2 + ta[..., 1::2] ** 2)
    pair = torch.stack((pair, pair), dim=-1).reshape(ta.shape)
    big = torch.maximum(ta.abs(), tb.abs())
    bound = ulp_of(big, dtype) + 2.0**-21 * pair
    assert ((ta - tb).abs() <= bound).all(), ((ta - tb).abs() - bound).max().item()


def test_kernel_vs_eager_do_differ_somewhere():
    """Sanity for the test above: the two orders are not trivially identical (otherwise the
    tolerance test would be vacuous), and the cancellation case is real."""
    g = torch.Generator().manual_seed(1)
    q_in = torch.randn(1024, 16, 128, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (1024,), generator=g)
    cs = make_cos_sin(4096, 64)
    a = ref.q_values(q_in, pos, cs, 1e-6, order="kernel")
    b = ref.q_values(q_in, pos, cs, 1e-6, order="eager")
    assert (a != b).sum().item() > 1000  # float32 results differ often ...
    qa, qb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    diff = (ordered(qa.view(torch.int16)) - ordered(qb.view(torch.int16))).abs()
    assert (diff[..., :64] == 1).any()  # ... sometimes across a bf16 rounding boundary
    assert diff[..., :64].max().item() == 1  # never more without RoPE
    assert diff[..., 64:].max().item() > 1  # RoPE cancellation: more than 1 ulp (seed 1: 25)
    assert_orders_agree(qa, qb, 64, torch.bfloat16)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "mxfp4"])
def test_fp16_io(name):
    """fp16 q_in / kv / q_out: q_out is fp16 within 1 fp16 ulp of the float64 oracle; the cache
    stores RoPE(kv) rounded through fp16 (then bf16 for the ds_mla tail)."""
    o = run_op(name, 6, 1, 3, 4, 6, torch.float16, "kernel", True, 0, 1e-6, 5)
    assert o["q_out"].dtype == torch.float16
    want = q_oracle(o["q_in"], o["positions"], o["cs"], 1e-6, o["r"])
    assert_close_ulp(o["q_out"][:6, :3], want, torch.float16, f32_slack(want, o["r"]))
    assert (o["q_out"][:6, 3:].view(torch.int16) == 0).all()
    slots = o["slots"].tolist()
    live = [t for t, s in enumerate(slots) if s >= 0]
    dec, _ = codecs.decode_cache(
        o["base"], get_format(name), o["d"], 4, torch.tensor([slots[t] for t in live])
    )
    kv_want = rope_oracle(o["kv"][live].double(), o["positions"][live], o["cs"], o["r"])
    if name == "fp8_ds_mla":
        # bf16 tail of the fp16-rounded value: within 1 fp16 ulp + 1 bf16 ulp
        tail = dec[:, 448:].double()
        tw = kv_want[:, 448:]
        assert (
            (tail - tw).abs()
            <= ulp_of(tw, torch.float16) + ulp_of(tw, torch.bfloat16) + f32_slack(kv_want, 64)[:, 448:]
        ).all()
        nope_err = (dec[:, :448].double() - kv_want[:, :448]).abs()
        # v = fp16(w) = w on these unrotated dims (kv is fp16); e4m3 adds max(2^-4 |v|, 2^-10 s) with the
        # block scale s < amax(v) / 224: total <= (2^-4 + 2^-9) |w| + 2^-10 s
        blk_amax = kv_want[:, :448].abs().reshape(-1, 7, 64).amax(-1, keepdim=True)
        s = (blk_amax * (1 + 2.0**-9) / 224).expand(-1, -1, 64).reshape(-1, 448)
        bound = kv_want[:, :448].abs() * (2.0**-4 + 2.0**-9) + 2.0**-10 * s
        assert (nope_err <= bound).all()
    else:
        # e2m1: at most half a gap <= 1 * s, with s < amax(v) / 3; plus the fp16 rounding of v
        blk_amax = kv_want.abs().reshape(-1, 4, 32).amax(-1, keepdim=True)
        s = (blk_amax * (1 + 2.0**-9) / 3).expand(-1, -1, 32).reshape(-1, 128)
        bound = s + ulp_of(kv_want, torch.float16) + f32_slack(kv_want, 64)
        assert ((dec.double() - kv_want).abs() <= bound).all()


# =============================================================================================
# order="kernel": a scalar re-implementation of the documented operation order, bit for bit
# =============================================================================================
def _f32(x: float) -> float:
    """One float32 rounding of a double. For +, -, *, / and sqrt of float32 operands, computing
    in double then rounding once is the correctly rounded float32 result (53 >= 2 * 24 + 2)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _fma32(a: float, b: float, c: float) -> float:
    return _fma_oracle(a, b, c)  # exact rational a*b + c, one rounding


def _q_kernel_order_scalar(
    x: list[float], eps: float, cos: list[float], sin: list[float], r: int
) -> list[float]:
    """Q path in the kernels' order (reference.py docstring): lanes = min(32, D/8); vector v (8
    elements) of a row belongs to lane v % lanes and each lane walks its vectors in order with
    fma(x, x, acc); then an xor butterfly (1, 2, 4, ...) over the lanes; mean = sum / D;
    rsqrt as IEEE sqrt then IEEE division; x * inv; RoPE even' = fma(e, c, -(o*s)),
    odd' = fma(e, s, o*c)."""
    d = len(x)
    lanes = min(32, d // 8)
    acc = [0.0] * lanes
    for v in range(d // 8):
        for k in range(8):
            e = x[v * 8 + k]
            acc[v % lanes] = _fma32(e, e, acc[v % lanes])
    step = 1
    while step < lanes:
        acc = [_f32(acc[i] + acc[i ^ step]) for i in range(lanes)]
        step *= 2
    ms = _f32(_f32(acc[0] / d) + _f32(eps))
    inv = _f32(1.0 / _f32(math.sqrt(ms)))
    y = [_f32(v * inv) for v in x]
    return _rope_kernel_order_scalar(y, cos, sin, r)


def _rope_kernel_order_scalar(y: list[float], cos, sin, r) -> list[float]:
    d = len(y)
    out = list(y)
    for i in range(r // 2):
        e, o = y[d - r + 2 * i], y[d - r + 2 * i + 1]
        c, s = cos[i], sin[i]
        out[d - r + 2 * i] = _fma32(e, c, -_f32(o * s))
        out[d - r + 2 * i + 1] = _fma32(e, s, _f32(o * c))
    return out


@settings(max_examples=60, **SETTINGS)
@given(
    st.sampled_from([(128, 64), (512, 64), (256, 32)]),
    st.integers(1, 2),
    st.integers(1, 2),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.integers(-4, 4),
    st.sampled_from([1e-6, 1e-5, 0.1]),
    st.integers(0, 2**31 - 1),
)
def test_kernel_order_matches_scalar_oracle(dr, n, h, dtype, log_scale, eps, seed):
    d, r = dr
    g = torch.Generator().manual_seed(seed)
    q_in = (torch.randn(n, h, d, generator=g) * 2.0**log_scale).to(dtype)
    kv = (torch.randn(n, d, generator=g) * 2.0**log_scale).to(dtype)
    positions = torch.randint(0, 512, (n,), generator=g)
    cs = make_cos_sin(512, r)
    q = ref.q_values(q_in, positions, cs, eps, order="kernel")
    kvv = ref.kv_values(kv, positions, cs, order="kernel")
    for t in range(n):
        cos = cs[positions[t], : r // 2].tolist()
        sin = cs[positions[t], r // 2 :].tolist()
        for hh in range(h):
            want = _q_kernel_order_scalar(q_in[t, hh].float().tolist(), eps, cos, sin, r)
            got = q[t, hh].tolist()
            assert [bits_from_f32(v) for v in got] == [bits_from_f32(v) for v in want], (t, hh)
        kv_want = _rope_kernel_order_scalar(kv[t].float().tolist(), cos, sin, r)
        kv_want = torch.tensor(kv_want, dtype=torch.float32).to(dtype).to(torch.float32)
        assert torch.equal(kvv[t].view(torch.int32), kv_want.view(torch.int32))


def test_kernel_order_rms_inverse_is_ieee():
    """order="kernel" takes 1/sqrt as IEEE sqrt then IEEE division (sqrt.rn.f32, div.rn.f32).
    Oracle: numpy's float32 sqrt and division (IEEE, correctly rounded) on the same mean."""
    import numpy as np  # a declared dependency: a missing numpy fails here instead of skipping

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 128, generator=g).to(torch.bfloat16).to(torch.float32)
    eps = 1e-6
    ms = (ref.sum_of_squares(x, "kernel") / 128 + eps).numpy()
    want = np.float32(1.0) / np.sqrt(ms.astype(np.float32))
    got = ref.rms_inverse(x, eps, "kernel")[:, 0].numpy()
    assert want.dtype == np.float32 and (got == want).all(), int((got != want).sum())


# =============================================================================================
# NVFP4 groups: exhaustive over the E4M3 scales and the E2M1 ties, against numpy + value tables
# =============================================================================================
import numpy as np  # noqa: E402  (a declared dependency: the IEEE float32 oracle)

E4M3_SCALES = [(v, b) for v, b in E4M3_POS if b >= 0x01]  # every positive finite e4m3 value
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _nvfp4_scale_oracle(name: str, amax: float) -> int:
    """The scale byte by the rules of formats.py, with numpy's IEEE float32 arithmetic and the
    e4m3 table: nvfp4_v41 e4m3(clamp(amax * fl(1/6), 2^-9, 448)), nvfp4_dsv4 e4m3(amax / 6)."""
    a = np.float32(amax)
    if name == "nvfp4_v41":
        q = float(np.clip(a * (np.float32(1) / np.float32(6)), np.float32(2.0**-9), np.float32(448)))
    else:
        q = float(a / np.float32(6))
    return nearest_code(q, E4M3_POS, 0x80)


def _nvfp4_code_oracle(name: str, x: float, s: float) -> int:
    """e2m1 code of x in units of s: x / s (nvfp4_v41) or x * fl(1/s) (nvfp4_dsv4, 0 when s = 0),
    ties to even, saturating; the sign of a zero result by the format's default Fp4Zero."""
    x32, s32 = np.float32(x), np.float32(s)
    if name == "nvfp4_v41":
        y = float(x32 / s32)
    else:
        y = float(x32 * (np.float32(1) / s32 if s32 != 0 else np.float32(0)))
    code = nearest_code(y, E2M1_POS, 0x8)
    signed = get_format(name).numerics.fp4_zero.value == "signed"
    return code if signed or code != 0x8 else 0


def _encode_groups(name: str, groups: list[list[float]]):
    """Pack 16-wide groups into 512-wide rows of the format's quantized dims (the rest zero);
    return (codes [G, 16], scale bytes [G]) of those groups."""
    fmt = get_format(name)
    per_row = fmt.num_scales(512)
    rows = -(-len(groups) // per_row)
    flat = torch.zeros(rows * per_row * 16, dtype=torch.float32)
    flat[: len(groups) * 16] = torch.tensor(groups, dtype=torch.float32).reshape(-1)
    tail = torch.zeros(rows, 512 - per_row * 16, dtype=torch.float32)
    x = torch.cat((flat.reshape(rows, per_row * 16), tail), dim=1)
    data, scale = codecs.encode_tokens(fmt, x)
    codes = codecs.unpack_e2m1(data[:, : per_row * 8].contiguous()).reshape(-1, 16)[: len(groups)]
    return codes, scale[:, :per_row].reshape(-1)[: len(groups)]


@pytest.mark.parametrize("name", ["nvfp4_v41", "nvfp4_dsv4"])
def test_nvfp4_scale_exhaustive_over_e4m3(name):
    """For every positive finite e4m3 scale value s and every midpoint m between neighbouring
    scales (and the 0 / 2^-9 midpoint): amax = 6 s, 6 m and their float32 neighbours give the
    oracle's scale byte. 6 s and 6 m are exact float32, so the midpoints test the scale's own
    ties (to the even mantissa) and the neighbours the quotient's rounding."""
    values = [0.0] + [v for v, _ in E4M3_SCALES]
    amaxes = []
    for lo, hi in zip(values, values[1:]):
        for q in (hi, (lo + hi) / 2):
            c = np.float32(6 * q)
            amaxes += [
                float(np.nextafter(c, np.float32(0))),
                float(c),
                float(np.nextafter(c, np.float32(1e9))),
            ]
    amaxes += [6 * 448.0 * 2, 1e30]
    groups = [[a] + [0.0] * 15 for a in amaxes]
    _, scales = _encode_groups(name, groups)
    want = [_nvfp4_scale_oracle(name, a) for a in amaxes]
    assert scales.tolist() == want
    assert set(want) >= {b for _, b in E4M3_SCALES}  # every scale byte is reached
    assert (0x00 in want) == (name == "nvfp4_dsv4")  # only FlashInfer's rule has no lower clamp


@pytest.mark.parametrize("name", ["nvfp4_v41", "nvfp4_dsv4"])
def test_nvfp4_codes_exhaustive_over_scales_and_ties(name):
    """Every positive finite e4m3 scale s (amax = 6 s sets it) with every E2M1 tie t * s and grid
    value of either sign: the codes are the oracle's (the division keeps exact ties, the
    reciprocal multiply of nvfp4_dsv4 moves some of them, see test_golden_vectors)."""
    groups, scales = [], []
    for s, _ in E4M3_SCALES:
        group = [6 * s] + [t * s for t in E2M1_TIES] + [-t * s for t in E2M1_TIES] + [-6 * s]
        groups.append(group)
        scales.append(s)
    for s, _ in E4M3_SCALES:  # the grid values and zeros at the same scales
        groups.append([6 * s] + [g * s for g, _ in E2M1_POS[:7]] + [-g * s for g, _ in E2M1_POS[:7]] + [-0.0])
        scales.append(s)
    codes, sbytes = _encode_groups(name, groups)
    assert sbytes.tolist() == [b for _, b in E4M3_SCALES] * 2
    want = [[_nvfp4_code_oracle(name, x, s) for x in g] for g, s in zip(groups, scales)]
    assert codes.tolist() == want
    if name == "nvfp4_dsv4":  # the reciprocal really moves ties somewhere (the test is not vacuous)
        div = [[_nvfp4_code_oracle("nvfp4_v41", x, s) for x in g] for g, s in zip(groups, scales)]
        assert sum(a != b for ra, rb in zip(want, div) for a, b in zip(ra, rb) if (a | b) & 7) > 10


@settings(max_examples=80, **SETTINGS)
@given(token_values(512), st.sampled_from(["nvfp4_v41", "nvfp4_dsv4"]))
def test_round_trip_nvfp4(x, name):
    """decode(encode(x)) within the NVFP4 bound per element: half the e2m1 spacing where x / s
    lies, in units of s (or the saturation |x| - 6 s beyond 6 s); a scale that rounded to 0
    (nvfp4_dsv4 only: amax / 6 <= 2^-10) loses the group. The bf16 tail comes back exactly."""
    fmt = get_format(name)
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, 512)
    nq = fmt.dims(512)[0]
    xs = x[:, :nq].double().reshape(x.shape[0], -1, 16)
    ds = dec[:, :nq].double().reshape(x.shape[0], -1, 16)
    s = scales.double().unsqueeze(-1)
    amax = xs.abs().amax(-1, keepdim=True)
    if name == "nvfp4_v41":
        assert (s >= 2.0**-9).all() and (s <= 448).all()
    # the scale is within e4m3 rounding (2^-4 relative) of amax / 6, or a clamp / zero bound
    near = (s - amax / 6).abs() <= (amax / 6) * 2.0**-4 + 2.0**-10
    assert (near | (s == 448) | (s == 2.0**-9)).all()
    zero = s == 0
    assert (amax[zero] <= 6 * 2.0**-10).all() and (ds * zero == 0).all()
    y = xs.abs() / torch.where(zero, torch.ones_like(s), s)
    half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    bound = torch.maximum(half_gap * s, xs.abs() - 6 * s) + 2.0**-20 * xs.abs()
    err = (ds - xs).abs()
    assert ((err <= bound) | zero).all(), (err - bound).max().item()
    if fmt.rope_tail_bf16:
        assert torch.equal(dec[:, nq:], x[:, nq:])


@pytest.mark.parametrize("name", ["fp8_ds_mla", "mxfp8"])
def test_block_exponent_scale_floor_exhaustive_bf16(name):
    """ScaleFloor.SCALE: e = ceil(log2(max(amax / 448, fl(1e-4)))) for every bf16 amax >= 0, against
    exact rationals (the float32 quotient never crosses a power of two, as for the amax floor)."""
    fmt = get_format(name)
    amax = _positive_bf16_amax()
    got = codecs.block_exponent(fmt, amax, ScaleFloor.SCALE).tolist()
    floor = Fraction(torch.tensor(fmt.amax_floor, dtype=torch.float32).item())
    for a, e in zip(amax.tolist(), got):
        assert e == exact_ceil_log2(max(Fraction(a) / 448, floor)), (a, e)
    assert min(got) == -13  # byte 114
    amax_floor = codecs.block_exponent(fmt, amax).tolist()
    agree = [a >= 0.0448 for a in amax.tolist()]
    assert all(g == h for g, h, ok in zip(got, amax_floor, agree) if ok)
    assert any(g != h for g, h in zip(got, amax_floor))


# =============================================================================================
# any block size, page strides larger than the records: every format
# =============================================================================================
@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("bs", [32, 48, 64, 128, 256])
def test_block_sizes_and_padded_pages(name, bs):
    """Records of tokens at the first, last and a middle offset of blocks land where the per-row
    oracle puts them with a page stride rounded past the records (vLLM-style: the next multiple of
    576), and decode_cache gives back what encode_tokens encoded."""
    d, r = FMT_DR[name]
    fmt = get_format(name)
    used = bs * fmt.bytes_per_token(d)
    stride = (used // 576 + 1) * 576  # > used, a multiple of 16
    g = torch.Generator().manual_seed(bs)
    base = torch.randint(0, 256, (3, stride), generator=g, dtype=torch.uint8)
    cache = base[:, :used]
    assert cache.stride(0) == stride > used
    before = base.clone()
    slots = [0, 2 * bs - 1, 2 * bs + bs // 2 + 1, -1]
    kv = (torch.randn(len(slots), d, generator=g) * 3).to(torch.bfloat16)
    positions = torch.arange(len(slots))
    cs = make_cos_sin(8, r)
    kv_scale = torch.tensor(0.125) if name == "fp8_tensor" else None
    slot_t = torch.tensor(slots)
    ref.kv_rope_insert(kv, cache, slot_t, positions, cs, bs, name, kv_scale=kv_scale)
    vals = ref.kv_values(kv, positions, cs)
    data, scale = codecs.encode_tokens(fmt, vals, kv_scale)
    assert torch.equal(base, oracle_cache(before, name, d, bs, slots, data, scale))
    live = torch.tensor(slots[:3])
    got, _ = codecs.decode_cache(cache, fmt, d, bs, live, kv_scale)
    want, _ = codecs.decode_tokens(fmt, data[:3], scale[:3], d, kv_scale)
    assert torch.equal(got, want)
