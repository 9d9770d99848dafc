"""Device-side arithmetic of the Hadamard engines (SGLang's and TokenSpeed's indexer Q: index_q's HADAMARD
bits), shared by every index_q module as kernel_lib is. Its CPU twins: index_q.rotate / hadamard and
numerics.e2m1_codes_ties_down_by_magic (tests/test_index_q_hadamard.py)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from .kernel_lib import VEC, e2m1_positive_zeros, f32_bits, f32_from_bits, fma_rn, fmax, fmin, mul_rn


def rcp_rn(x: Float32) -> Float32:
    """RN(1 / x), IEEE (rcp.rn.f32): 0 for +Inf."""
    return cute.arch.inline_ptx("rcp.rn.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x])


def rope_rotate_unfused(frag: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor):
    """GPT-J rotation with every product rounded: e*c - o*s, e*s + o*c (eager torch's arithmetic)."""
    for i in range(VEC // 2):
        e, o, c, s = frag[2 * i], frag[2 * i + 1], cos[i], sin[i]
        frag[2 * i] = mul_rn(e, c) - mul_rn(o, s)
        frag[2 * i + 1] = mul_rn(e, s) + mul_rn(o, c)


def transform(ys, sub: Int32, stages, lanes: int):
    """The unscaled 128-point Walsh-Hadamard transform of one row in place, one radix-2 stage per entry of
    `stages` (the index bit its pairs differ in; each butterfly writes lo + hi, lo - hi). Lane map of
    index_q: dim i = 8 * (slot * lanes + sub) + element, so bits 0-2 pair elements of a vector, the next
    log2(lanes) bits pair lanes (a butterfly shuffle: the upper lane takes other - own = lo - hi) and the
    rest pair slots."""
    lane_bits = lanes.bit_length() - 1
    for bit in stages:
        if bit < 3:
            h = 1 << bit
            for y in ys:
                for j in range(VEC):
                    if not j & h:
                        lo, hi = y[j], y[j + h]
                        y[j], y[j + h] = lo + hi, lo - hi
        elif bit < 3 + lane_bits:
            mask = 1 << (bit - 3)
            sign = cutlass.select_((sub & mask) != 0, Float32(-1.0), Float32(1.0))
            for y in ys:
                for j in range(VEC):
                    other = cute.arch.shuffle_sync_bfly(y[j], mask)
                    y[j] = fma_rn(y[j], sign, other)  # other + own, or other - own: one exact rounding
        else:
            h = 1 << (bit - 3 - lane_bits)
            for s in range(len(ys)):
                if not s & h:
                    lo_vec, hi_vec = ys[s], ys[s + h]
                    for j in range(VEC):
                        lo, hi = lo_vec[j], hi_vec[j]
                        lo_vec[j], hi_vec[j] = lo + hi, lo - hi


def e2m1_pack8_ties_down(y) -> Uint32:
    """8 float32 -> one word of 8 e2m1 codes (element 2j in the low nibble of byte j) with ties rounded
    toward zero, saturating to +-6, NaN -> +6, no -0 (SGLang's and TokenSpeed's rule): c as in
    kernel_lib.e2m1_pack8_by_magic, then RU(1.5 * 2^(22+k) + (|c| - 2^(k-2))) sits on the E2M1 grid of |c|'s
    binade, rounded half down (twin: numerics.e2m1_codes_ties_down_by_magic)."""
    codes = Uint32(0)
    signs = Uint32(0)
    bias = 0
    for i in range(8):
        c = fmax(fmin(y[i], Float32(6.0)), Float32(-6.0))
        b = f32_bits(c)
        p = cutlass.max(b & Uint32(0x7F800000), Uint32(0x3F800000))  # bits of 2^k
        t = fma_rn(f32_from_bits(p), Float32(-0.25), cute.math.absf(c))
        s = cute.arch.inline_ptx(
            "fma.rp.f32 {$w0}, {$r0}, 0f4AC00000, {$r1};",  # 2^k * 1.5 * 2^22 + t, rounded up
            write_only_types=[Float32],
            read_only_args=[f32_from_bits(p), t],
        )
        codes = codes + ((f32_bits(s) + (p >> Uint32(22)) - p) << Uint32(4 * i))
        signs = signs | ((b >> Uint32(28 - 4 * i)) & Uint32(8 << (4 * i)))
        bias += (0x0B000000 + 0x400000 + 254) << (4 * i)
    return e2m1_positive_zeros((codes - Uint32(bias % 2**32)) | signs)
