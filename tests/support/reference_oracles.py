"""Independent oracles of the reference property tests (tests/test_reference_*.py): exact rational
rounding, value tables built from the bit layouts, hypothesis strategies for rows, the slow per-row
paging and a float64 RoPE table. Nothing here calls the code under test."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch
from attn_prologue.formats import get_format
from hypothesis import HealthCheck
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


def positive_bf16_amax() -> torch.Tensor:
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # 0 and all positive finite
    return bits.view(torch.bfloat16).to(torch.float32)


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
    # decode (see test_golden_indexer_rows.py::test_decode_overflow_near_float32_max).
    big = 2.0**127 * 1.5 if allow_big else 2.0**100  # 2.55e38 / 1.27e30, exact float32
    specials = draw(
        st.lists(st.tuples(st.integers(0, m * d - 1), st.floats(-big, big, width=32)), max_size=6)
    )
    flat = x.reshape(-1)
    for i, v in specials:
        flat[i] = v
    return flat.reshape(m, d).to(torch.bfloat16).to(torch.float32)


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


def fma_oracle(a: float, b: float, c: float) -> float:
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        prod_neg = (math.copysign(1, a) * math.copysign(1, b)) < 0
        both_neg_zero = (a * b == 0) and prod_neg and c == 0 and math.copysign(1, c) < 0
        return -0.0 if both_neg_zero else 0.0  # IEEE: exact zero sum is +0 under RN
    r = round_to_f32(exact)
    if r == 0:
        return math.copysign(0.0, float(exact.numerator))  # underflow keeps the sign
    return r


def make_cache(name, d, bs, nblocks, pad, strided, g):
    fmt = get_format(name)
    used = bs * fmt.bytes_per_token(d)
    base = torch.randint(0, 256, (nblocks, used + pad), generator=g, dtype=torch.uint8)
    cache = base[:, :used] if strided else base
    return base, cache
