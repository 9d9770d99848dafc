"""Bit-exact scalar building blocks for the reference, in plain vectorized torch.

Everything here runs on CPU and CUDA tensors, never synchronizes and traces under
torch.compile(fullgraph=True). The kernels use the same rules; the comments say which PTX
instruction each function stands for.
"""

from __future__ import annotations

import torch

F32_MANTISSA_MASK = 0x7FFFFF
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN_BYTE = 0x7F  # cvt.rn.satfinite.e4m3x2.f32 gives the canonical NaN 0x7F for any NaN
E2M1_NAN_CODE = 0x7  # e2m1 has no NaN; NaN is stored as +6 (CUDA's fp4 conversion rule)
# Round half down (the Hadamard engines' E2M1 rule) by the nearest-even rounding of a shrunk value: for x
# a bfloat16 value times a power of two, x * (1 - 2^-9) in float32 (exact), rounded to nearest even -- in
# one step, or through float16 first -- is x rounded half down: a tie moves below itself, any other value
# stays on its side of every decision point (proven for every bf16 value and scale: tests/test_index_q_hadamard.py).
# In bfloat16 (fma.rn.bf16x2, one rounding of a * s + 64 * 2^k) the representable 1 - 2^-8 does the same.
E2M1_TIES_DOWN_SHRINK = 1 - 2.0**-9
E2M1_TIES_DOWN_SHRINK_BF16 = 1 - 2.0**-8


def _round_mantissa_f32(x: torch.Tensor, drop_bits: int) -> torch.Tensor:
    """Round float32 x to 23 - drop_bits mantissa bits, nearest even, on the bits (no exponent
    limit: subnormal float32 inputs round on the same linear grid). NaN -> quiet NaN 0x7FC00000
    with x's sign; a carry out of the largest exponent gives Inf."""
    bits = x.view(torch.int32)
    sign = bits & -0x80000000
    mag = bits & 0x7FFFFFFF
    mag = torch.where(mag > 0x7F800000, torch.full_like(mag, 0x7FC00000), mag)  # NaN, no overflow
    lsb = (mag >> drop_bits) & 1
    mag = (mag + ((1 << (drop_bits - 1)) - 1) + lsb) & ~((1 << drop_bits) - 1)
    return (mag | sign).view(torch.float32)


def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype (round to nearest even) -> fp32, for dtype float32, bfloat16 or float16.

    Computed on the float32 bits, not as `x.to(dtype).to(torch.float32)`: under torch.compile,
    Inductor fuses that pair into a no-op (it skips intermediate downcasts unless
    `emulate_precision_casts` is set), which silently dropped the rounding that docs/op.md
    requires (KV path step 3, and the norm of the weighted-norm KV relative). Equal to the cast
    pair for every non-NaN input; a NaN comes back as a quiet NaN (payload not pinned).
    """
    x = x.to(torch.float32)
    if dtype == torch.float32:
        return x
    if dtype == torch.bfloat16:
        return _round_mantissa_f32(x, 16)
    if dtype == torch.float16:
        r = _round_mantissa_f32(x, 13)  # 10 mantissa bits, normal range
        r = torch.where(r.abs() >= 65536.0, torch.copysign(torch.full_like(r, float("inf")), r), r)
        sub = torch.round(x * 2.0**24) * 2.0**-24  # below 2^-14: fixed quantum 2^-24, ties even
        return torch.where(x.abs() < 2.0**-14, sub, r)
    raise ValueError(f"round_through: unsupported dtype {dtype}")


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 a*b + c, like PTX `fma.rn.f32`.

    The product of two float32 values is exact in float64. The sum is rounded to float64 with
    round-to-odd (TwoSum gives the exact error; an inexact even result moves one ulp towards the
    exact value), and round-to-odd at 53 bits followed by round-to-nearest at 24 bits is a single
    correct rounding. Non-finite sums are left to float64 arithmetic (same IEEE result).
    """
    return _sum_round_to_odd(a.double() * b.double(), c.double()).to(torch.float32)


def _sum_round_to_odd(p: torch.Tensor, c64: torch.Tensor) -> torch.Tensor:
    """p + c in float64 rounded to odd (fma_f32)."""
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & even & torch.isfinite(s) & torch.isfinite(err)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(fix, torch.nextafter(s, toward), s)


# ---- float16 pairs (the SM90 E2M1 codes under lean_quant: templates/conversions/portable.jinja) ----
def round_f16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest-even float16 value, as float64: 11 significant bits, below 2^-14 the fixed
    quantum 2^-24, a magnitude past 65504 + 16 -> Inf (scalings by powers of two and torch.round, which
    ties to even, are exact in float64)."""
    v = v.double()
    a = v.abs()
    _, e = torch.frexp(a)
    quantum = torch.where(a < 2.0**-14, torch.full_like(a, 2.0**-24), torch.ldexp(torch.ones_like(a), e - 11))
    r = torch.round(a / quantum) * quantum
    r = torch.where(r >= 65520.0, torch.full_like(r, float("inf")), r)
    return torch.copysign(torch.where(torch.isfinite(a), r, a), v)


def fma_f16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma.rn.f16x2 on one half: a*b + c rounded once (round-to-odd at 53 bits, then to 11, as fma_f32)."""
    return round_f16(_sum_round_to_odd(a.double() * b.double(), c.double()))


def _f16_min_max(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max.f16x2(min.f16x2(x, hi), lo): each returns its other operand for NaN, so NaN -> hi."""
    c = torch.where(torch.isnan(x), hi, torch.minimum(x, hi))
    return torch.maximum(c, lo)


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF  # (v is a float16 value: exact)


def e2m1_codes_in_f16(mags: torch.Tensor, clamped: torch.Tensor) -> torch.Tensor:
    """The codes of e2m1_word_of_f16, one half at a time: magnitudes `mags` in [0, 6] (float16 values),
    signs from `clamped`. p = bits(max(a, 1)) & 0x7C00; t = a + 512 * 2^k rounded once;
    code = bits(t) - p + (p >> 9) - 0x241E."""
    p = _f16_bits(torch.maximum(mags, torch.ones_like(mags))) & 0x7C00
    t = fma_f16(torch.ldexp(torch.ones_like(mags), (p >> 10) - 15), torch.full_like(mags, 512.0), mags)
    code = _f16_bits(t) - p + (p >> 9) - 0x241E
    return (code | torch.signbit(clamped).to(torch.int32) << 3).to(torch.uint8)


def e2m1_pack_codes_in_f16(y: torch.Tensor) -> torch.Tensor:
    """e2m1_pack8_in_f16 per value (mxfp4: y = x * 2^-e in float32): float16 rounding, clamp to +-6."""
    six = torch.full_like(y, E2M1_MAX, dtype=torch.float64)
    c = _f16_min_max(round_f16(y.double()), -six, six)
    return e2m1_codes_in_f16(c.abs(), c)


def round_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest-even bfloat16 value, as float64: 8 significant bits, below 2^-126 the fixed
    quantum 2^-133, a magnitude from (2 - 2^-8) * 2^127 up -> Inf."""
    v = v.double()
    a = v.abs()
    _, e = torch.frexp(a)
    quantum = torch.where(
        a < 2.0**-126, torch.full_like(a, 2.0**-133), torch.ldexp(torch.ones_like(a), e - 8)
    )
    r = torch.round(a / quantum) * quantum
    r = torch.where(r >= (2 - 2.0**-8) * 2.0**127, torch.full_like(r, float("inf")), r)
    return torch.copysign(torch.where(torch.isfinite(a), r, a), v)


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # (v is a bfloat16 value: exact)


def e2m1_codes_in_bf16(mags: torch.Tensor, clamped: torch.Tensor, ties_down: bool = False) -> torch.Tensor:
    """The codes of e2m1_word_of_bf16, one half at a time: magnitudes `mags` in [0, 6] (bfloat16 values),
    signs from `clamped`. p = bits(max(a, 1)) & 0x7F80; t = a + 64 * 2^k rounded once (fma.rn.bf16x2);
    code = bits(t) - p + (p >> 6) - 0x3FE. `ties_down` (the Hadamard engines' rule): t = a * (1 - 2^-8) +
    64 * 2^k rounded once instead (E2M1_TIES_DOWN_SHRINK_BF16), and no sign on a zero code."""
    p = _bf16_bits(torch.maximum(mags, torch.ones_like(mags))) & 0x7F80
    a = mags.double() * (E2M1_TIES_DOWN_SHRINK_BF16 if ties_down else 1.0)  # (exact: 16 bits)
    t = round_bf16(_sum_round_to_odd(torch.ldexp(torch.ones_like(mags), (p >> 7) - 127) * 64.0, a))
    code = _bf16_bits(t) - p + (p >> 6) - 0x3FE
    sign = torch.signbit(clamped) & ((code != 0) if ties_down else True)
    return (code | sign.to(torch.int32) << 3).to(torch.uint8)


def e2m1_pack_codes_in_bf16(x: torch.Tensor, inv: torch.Tensor, ties_down: bool = False) -> torch.Tensor:
    """e2m1_pack8_bf16_pairs per value: x a bfloat16 value, inv the block's inverse scale (a power of two,
    2^-127, 0 or -Inf: bfloat16 values too), the product rounded to bfloat16 (mul.rn.bf16x2), clamped to
    +-6 with NaN -> +6 (min.bf16x2, then max.bf16x2, return the other operand for NaN)."""
    six = torch.full_like(x, E2M1_MAX, dtype=torch.float64)
    c = _f16_min_max(round_bf16(x.double() * inv.double()), -six, six)
    return e2m1_codes_in_bf16(c.abs(), c, ties_down)


def e2m1_quotient_codes_in_f16(x: torch.Tensor, s: torch.Tensor, recip: torch.Tensor) -> torch.Tensor:
    """e2m1_quotient_codes_io per value (nvfp4_v41): x float32, s its group's e4m3 scale, `recip`
    the float16 reciprocal the kernel uses (within one float16 ulp of 1 / s)."""
    c, q = _f16_quotients(x, s, recip)
    return e2m1_codes_in_f16(q, c)


# nvfp4_dsv4's tie rule in float16 (e2m1_reciprocal_codes_io): 7 * 2^-14 = 0.875 * 2^-11, float16 0x0F00
F16_TIE_BIAS = 7 * 2.0**-14


def e2m1_reciprocal_codes_in_f16(x: torch.Tensor, s: torch.Tensor, recip: torch.Tensor) -> torch.Tensor:
    """e2m1_reciprocal_codes_io per value (nvfp4_dsv4): the quotient's codes, with the corrected quotient q
    of a group whose scale significand is 1.875 moved to RN(q + q * F16_TIE_BIAS) first. There
    fl(1/s) > 1/s, and x * fl(1/s) rounds the ties x / s in {1.25, 2.5, 5} up, not to even; the move
    takes q up one ulp when its significand is >= 1.25 and leaves 0.25 (significand 1), whose tie the
    reference rounds down. Exact for bf16 rows only: their quotients are ties or several float16 ulps from
    every decision point, while an fp16 row's can be one ulp below one. s = 0 (the codes of x * 0) is
    computed with the scale 1 and its reciprocal 1: a group whose amax / 6 rounds to 0 holds NaN or values
    of at most 6 * 2^-10, which code as +6 and signed zeros either way."""
    zero = s == 0
    one = torch.ones_like(s)
    s, recip = torch.where(zero, one, s), torch.where(zero, one.double(), recip)
    c, q = _f16_quotients(x, s, recip)
    significand_1875 = (_f16_bits(s.double()) & 0x0380) == 0x0380  # (an e4m3 subnormal never has it)
    q = torch.where(significand_1875, fma_f16(q, torch.full_like(q, F16_TIE_BIAS), q), q)
    return e2m1_codes_in_f16(q, c)


def _f16_quotients(x: torch.Tensor, s: torch.Tensor, recip: torch.Tensor):
    """(x in float16 clamped to +-6s, NaN -> +6s; RN(a * recip) and its one correction, a = |clamped|)."""
    limit = 6.0 * s.double()
    c = _f16_min_max(round_f16(x.double()), -limit, limit)
    a = c.abs()
    q = round_f16(a * recip)
    return c, fma_f16(fma_f16(q, -s.double(), a), recip, q)


def ceil_log2_exponent(r: torch.Tensor) -> torch.Tensor:
    """ceil(log2(r)) for positive normal float32 r (int32), from the bits, never a log.

    `((bits + 0x7FFFFF) >> 23) - 127`: a nonzero mantissa carries into the exponent. Saturates at
    127 like `cvt.rp.satfinite.ue8m0x2.f32` (byte 254, the largest finite UE8M0), so +Inf gives
    127 on every target (docs/formats.md gives the portable integer form of that instruction).
    """
    bits = r.view(torch.int32)
    return (((bits + F32_MANTISSA_MASK) >> 23) - 127).clamp_max(127)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-126, 128] (128 gives +Inf), built from the bits."""
    return _pow2_bits(e).view(torch.float32)


def _pow2_bits(e: torch.Tensor) -> torch.Tensor:
    return (e + 127).to(torch.int32) << 23


def pow2_f32_bytes(e: torch.Tensor) -> torch.Tensor:
    """The 4 little-endian bytes of pow2_f32(e), by shifts (torch.compile traces no 4-to-1-byte view)."""
    bits = _pow2_bits(e)
    return torch.stack([(bits >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).to(torch.uint8).flatten(-2)


def nan_ignoring_amax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """max |x| along dim, ignoring NaN like PTX `max.f32` (an all-NaN block gives 0)."""
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=dim)


def e4m3_bytes(y: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3 bytes with round-to-nearest-even and saturation to +-448.

    `cvt.rn.satfinite.e4m3x2.f32`: +-Inf saturates to +-448, NaN gives 0x7F.
    """
    b = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.full_like(b, E4M3_NAN_BYTE), b)


def e4m3_values(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


# E2M1 magnitudes by code 0..7 and the round-to-nearest-even decision points between them.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 -> 4-bit e2m1 codes (uint8 0..15), round-to-nearest-even, saturating to +-6.

    A tie goes to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0,
    5->4.0. The sign bit (0x8) follows the sign of y, -0 included. NaN -> 0x7 (+6).
    This is the software rounding the SM90 kernels use; SM100/SM120 use `cvt.rn.satfinite.e2m1x2.f32`.
    """
    a = y.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = torch.signbit(y).to(torch.uint8) << 3
    out = code | sign
    return torch.where(torch.isnan(y), torch.full_like(out, E2M1_NAN_CODE), out)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def ue8m0_values(b: torch.Tensor) -> torch.Tensor:
    """Scale bytes -> 2^(byte-127) as float32; 255 is the UE8M0 NaN code."""
    e = b.to(torch.int32) - 127
    v = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


# ---- the kernels' leaner exact arithmetic (LaunchConfig.lean_quant), as the same rules ---------------
# Plain-torch twins of attn_prologue.device.kernel_lib's lean functions, operation for operation. Each is
# bit-identical to the rule above it replaces on the inputs stated (tests/test_lean_quant_cpu.py: every
# float32 for the E2M1 rounding; every e4m3 scale and every float32 significand for the divisions).
def e2m1_codes_by_magic(y: torch.Tensor) -> torch.Tensor:
    """e2m1_codes by the exponent-dependent magic add: c = max(min(y, 6), -6) with NaN -> +6; for
    2^k = max(2^floor(log2|c|), 1), |c| + 2^(22+k) rounds at the E2M1 spacing 2^(k-1) (nearest even),
    and code = bits(sum) - bits(2^(22+k)) + 2k; the sign bit of c."""
    six = torch.full_like(y, E2M1_MAX)
    c = torch.where(torch.isnan(y), six, y.clamp(-E2M1_MAX, E2M1_MAX))
    b = c.view(torch.int32)
    p = torch.clamp_min(b & 0x7F800000, 0x3F800000)  # bits of 2^k
    s = c.abs() + p.view(torch.float32) * 2.0**22  # the product is exact: one rounding, as the fma
    code = s.view(torch.int32) + (p >> 22) - p - (0x0B000000 + 254)
    return (code | ((b >> 28) & 8)).to(torch.uint8)


def reciprocal_newton(s: torch.Tensor, r0: torch.Tensor) -> torch.Tensor:
    """One Newton step r0 + r0 * (1 - s * r0) with fused multiply-adds (kernel_lib.reciprocal_of_e4m3)."""
    return fma_f32(r0, fma_f32(-s, r0, torch.ones_like(s)), r0)


def quotient_by_reciprocal(x: torch.Tensor, s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """q = x * r, then q - (q * s - x) * r in fused multiply-adds (kernel_lib.quotient_by_reciprocal)."""
    q = x * r
    return fma_f32(-fma_f32(q, s, -x), r, q)


def quotient_by_constant(amax: torch.Tensor, c: float) -> torch.Tensor:
    """quotient_by_reciprocal by fl(1 / c), then min with 2 x the product, NaN-ignoring like min.f32:
    +Inf for +Inf, whose correction is NaN (kernel_lib.quotient_by_constant)."""
    r = torch.full_like(amax, 1.0 / c)
    q0 = amax * r
    return torch.fmin(quotient_by_reciprocal(amax, torch.full_like(amax, c), r), q0 * 2.0)


def e2m1_codes_ties_down_by_magic(y: torch.Tensor) -> torch.Tensor:
    """The Hadamard engines' E2M1 codes (ties toward zero, no -0; index_q_hadamard.e2m1_codes_toward_zero) by
    a magic add rounding up: for 2^k as in e2m1_codes_by_magic, RU(1.5 * 2^(22+k) + (|c| - 2^(k-2))) lands on
    the grid 2^(k-1) of its binade (1.5 keeps the sum inside it when |c| < 2^(k-2)): ceil(|c| / step - 1/2)
    steps, i.e. round half down. The rounding up is taken in float64, exact here (the sum needs 26 bits)."""
    six = torch.full_like(y, E2M1_MAX)
    c = torch.where(torch.isnan(y), six, y.clamp(-E2M1_MAX, E2M1_MAX))
    b = c.view(torch.int32)
    p = torch.clamp_min(b & 0x7F800000, 0x3F800000)  # bits of 2^k
    pk = p.view(torch.float32).double()
    t = (c.abs() - pk * 0.25).float().double()  # fma.rn(2^k, -1/4, |c|): exact but below 0.25 (code 0 anyway)
    steps = torch.ceil(t / (pk * 0.5))  # fma.rp's rounding onto the grid of 1.5 * 2^(22+k)
    code = (steps + 2 * torch.log2(pk)).to(torch.int32)
    nonzero = code != 0
    return (code | (((b >> 28) & 8) * nonzero)).to(torch.uint8)
