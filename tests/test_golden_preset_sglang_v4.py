"""Golden vectors of `preset=sglang` on `fp8_ds_mla`, derived BY HAND from SGLang 0.5.23's V4 writer
(read from the sglang-0.5.23 wheel: python/sglang/kernels/jit/csrc/deepseek_v4/store.cuh, the V4
branch of fused_store_cache; main_norm_rope.cuh's V4 branch quantizes with the same lines), through
the same machinery as tests/test_golden_presets.py (RoPE at position 0 with its separating pair in
dims 448, 449, then the paged insert into a poisoned page, via the reference and the CPU torch op).

What SGLang's V4 writer does with a 64-wide block of NoPE values x (fp8_utils.cuh):
* scale_raw = fmaxf(1e-4, amax) / 448, with amax = warp::reduce_max(fmaxf(|x|, |y|)): fmaxf
  drops a NaN, so amax ignores NaN and an all-NaN block has amax NaN, then fmaxf(1e-4, NaN) = 1e-4.
  The floor applies to amax, before the division (scale_floor=amax).
* byte = cast_to_ue8m0(scale_raw) = its exponent bits + (mantissa != 0): ceil(log2(scale_raw)).
* element = pack_fp8(x * inv_scale) with inv_scale = 2^(127 - byte) exactly, clipped by
  fmaxf(fminf(v, 448), -448): fminf returns 448 for a NaN, so NaN -> +448 = 0x7E (e4m3_nan=0x7e),
  and -0.0 stays -0.0 (0x80).
* Warps 0..6 write scale bytes 0..6; nothing writes byte 7 (scale_pad=skip).
* Inf: scale_raw = Inf -> byte 255 (inf_scale=255 gives the same byte); SGLang's inv_scale is then
  __uint_as_float((254 - 255) << 23) = -Inf, so its elements are x * -Inf (finite -> -+448, zero ->
  NaN -> +448), where this preset multiplies by 0 (Inf -> NaN -> 0x7E, finite -> +-0): the one row
  class the entry lists as not matched (presets.PRESETS["sglang"]).
"""

from __future__ import annotations

from .support.golden import INF, NAN, byte_row
from .test_golden_presets import BF16_MAX, POISON, write

ROW = {
    # block 0, finite and signed zeros: amax 3 -> scale_raw 3/448 = 2^-7.22 -> byte 127 - 7 = 120;
    # x * 2^7: 3 -> 384 = 1.5 * 2^8 = 0x7C, -1 -> -128 = 0xF0, -0.0 -> 0x80, -2 -> -256 = 0xF8
    0: 3.0, 1: -1.0, 2: -0.0, 3: -2.0,
    # block 1, one NaN: amax 1 -> 2^-8.81 -> byte 119; NaN -> 0x7E, 1 * 2^8 = 256 = 0x78
    64: NAN, 65: 1.0,
    # block 2, all NaN: amax NaN, fmaxf(1e-4, NaN) = 1e-4 -> 1e-4 / 448 = 2^-22.09 -> byte 105; 0x7E each
    **{128 + i: NAN for i in range(64)},
    # block 3, Inf: byte 255; here x * 0: Inf, -Inf -> NaN -> 0x7E, 2 -> 0x00, -3 -> 0x80 (not SGLang's)
    192: INF, 193: -INF, 194: 2.0, 195: -3.0,
    # block 4, below the amax floor (2^-20 < 1e-4): byte 105, x * 2^22: 2^-20 -> 4 = 0x48,
    # -2^-24 -> -0.25 = 0xA8
    256: 2.0**-20, 257: -(2.0**-24),
    # block 5, overflow: amax = BF16_MAX -> 2^119.2 -> byte 247, x * 2^-120: BF16_MAX -> 255.0 -> 256
    # = 0x78, -2^126 -> -64 = 0xE8
    320: BF16_MAX, 321: -(2.0**126),
    # block 6: zeros -> byte 105 (SGLang's V4.1 writer, with the floor on the scale, gives 114)
}  # fmt: skip

DATA = {
    0: 0x7C, 1: 0xF0, 2: 0x80, 3: 0xF8, 64: 0x7E, 65: 0x78, **{128 + i: 0x7E for i in range(64)},
    192: 0x7E, 193: 0x7E, 194: 0x00, 195: 0x80, 256: 0x48, 257: 0xA8, 320: 0x78, 321: 0xE8,
    # the rope tail, dims 448, 449 (bf16 little-endian): tests/test_golden_presets.py's pair, even_sin:
    # even' 0xBFC1, odd' 0x3F00 (SGLang's store.cuh stores the rotated row it is given; its fused
    # writers' `x_re * c - x_im * s`, `x_re * s + x_im * c` contract to these fmas)
    448: 0xC1, 449: 0xBF, 450: 0x00, 451: 0x3F,
}  # fmt: skip
SCALE = [120, 119, 105, 255, 105, 247, 105, POISON]  # blocks 0..6, then the pad byte, never written


def test_fp8_ds_mla_sglang_preset():
    data, scale = write("fp8_ds_mla", [ROW], "preset=sglang")
    assert data[0] == byte_row(576, DATA)
    assert scale[0] == SCALE
