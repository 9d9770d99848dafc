"""Golden vectors per (format, engine preset), derived BY HAND from the engines' public writers
(presets.PRESETS cites each file and commit; docs/formats.md, "Matching an engine byte for byte").

Every case writes bf16 rows through the whole KV path (RoPE at position 0, then the format's
encoder, then the paged insert into a poisoned page), once through the reference and once through
the CPU torch op, and compares every byte with literals. Each row covers one row class of
presets.ROW_CLASSES: finite values and signed zeros, NaN, Inf, values below the amax floor, zeros,
and overflow (values near the bf16 maximum). What each engine does with them, read from its source:

* vllm (CUDA op): fminf(fmaxf(x * 2^-e, -448), 448) turns a NaN into -448 (0xFE: fmaxf returns the
  non-NaN operand); a block holding Inf has e = ceilf(log2f(Inf)) = Inf: byte fminf(Inf, 255) = 255
  and every element x * exp2f(-Inf) = x * 0 (Inf -> NaN -> 0xFE, finite -> +-0).
* vllm-triton: the same Inf rule; Triton's clamp(x, -448, 448) is min.xorsign.abs, which maps the
  (positive, canonical) NaN of x * scale to +448 (0x7E); the V4.1 writers rotate the NoPE pairs with
  cos = 1, sin = 0, i.e. (e - o*0, o + e*0): -0.0 becomes +0.0 where the pair's product is +-0 of the
  opposite sign, and NaN or Inf makes the pair NaN (Inf * 0); the odd term is fma(o, c, e*s).
* flashmla (tests/quant.py): scale 2^ceil(log2(max(amax / 448, 1e-4))), so zero blocks get 2^-13
  (byte 114); a block holding Inf gets scale Inf (e8m0 byte 0xFF) and x / Inf (Inf -> NaN -> 0x7F).
* sglang: the exponent floored at byte 114 (the scale floor); NVFP4 with the sign of zero kept.
* trtllm: amax floored at 1e-8; (int32(+Inf) + 127) wraps to byte 126; no pad byte written; NaN ->
  0x7E (Triton's clamp); the odd RoPE term fma(o, c, e*s).
* flashinfer: the nvfp4_dsv4 defaults (its writer is what the format's defaults follow).

The RoPE pair (dims D-R, D-R+1) = (e, o) = (-1, 1 + 2^-7) with c = 1 + 3 * 2^-19 and
s = 0.5 + 3 * 2^-9 + 3 * 2^-19 (float32) separates the two orders of the odd term:
  o*c = 1 + 2^-7 + 3*2^-19 + 3*2^-26 exactly; e*s is exact.
  even_sin: fma(e, s, RN(o*c)): RN(o*c) = 1 + 2^-7 + 3*2^-19 (3*2^-26 is 0.375 ulp: down), so the sum
            is exactly 0.5 + 2^-9, a bf16 tie -> even -> 0.5 = bf16 0x3F00.
  odd_cos:  fma(o, c, e*s): one rounding of 0.5 + 2^-9 + 3*2^-26 (0.75 ulp of 2^-24: up) ->
            0.5 + 2^-9 + 2^-24, above the tie -> 0.5 + 2^-8 = bf16 0x3F01.
  even' = fma(e, c, -RN(o*s)): o*s = 0.5 + 5*2^-9 + 3*2^-16 + 3*2^-19 + 3*2^-26 -> RN up by 2^-26 to
  ... + 2^-24; e*c - that = -(1.5 + 5*2^-9 + 3*2^-16 + 6*2^-19 + 2^-24): a tie at 2^-23, to the even
  -(1.5 + 5*2^-9 + 3*2^-16 + 3*2^-18) -> bf16 -(1.5 + 2^-7) = 0xBFC1 (1.25 of 2^-7 rounds to 1).
"""

from __future__ import annotations

import struct

import pytest
import torch
from attn_prologue import ops
from attn_prologue import reference as ref
from attn_prologue.formats import get_format

from .support.golden import INF, NAN, byte_row, is_bf16_nan

BF16_MAX = 3.3895313892515355e38  # bf16 0x7F7F = (2 - 2^-7) * 2^127
POISON = 0xA5
C0, S0 = 1 + 3 * 2.0**-19, 0.5 + 3 * 2.0**-9 + 3 * 2.0**-19  # the RoPE pair's cos and sin (see above)
ROPE_PAIR = (-1.0, 1 + 2.0**-7)


def cos_sin(r: int) -> torch.Tensor:
    """Position 0: cos 1 and sin 0 for every pair but pair 0, which gets (C0, S0)."""
    cs = torch.zeros(1, r)
    cs[0, : r // 2] = 1.0
    cs[0, 0], cs[0, r // 2] = C0, S0
    assert (cs[0, 0].item(), cs[0, r // 2].item()) == (C0, S0)  # both are float32 values
    return cs


def write(name: str, rows: list[dict[int, float]], numerics: str) -> tuple[list, list]:
    """bf16 rows (entries of zero rows; the first row also holds ROPE_PAIR in its first rotated pair)
    written at slots 0.. of one page of a poisoned cache, through the reference and through the CPU
    torch op (same bytes); -> (data records, scale records)."""
    fmt = get_format(name)
    d, r = fmt.head_dim or 128, fmt.rope_dim or 64
    kv = torch.zeros(len(rows), d)
    for i, entries in enumerate(rows):
        for k, v in entries.items():
            kv[i, k] = v
    kv[0, d - r], kv[0, d - r + 1] = ROPE_PAIR
    kv = kv.to(torch.bfloat16)
    assert kv.float()[0, d - r + 1].item() == ROPE_PAIR[1]  # every value here is a bf16
    bs = len(rows)
    db, sb = fmt.data_bytes(d), fmt.scale_bytes(d)
    caches = [torch.full((1, bs * (db + sb) + 16), POISON, dtype=torch.uint8) for _ in range(2)]
    args = (torch.arange(bs), torch.zeros(bs, dtype=torch.int64), cos_sin(r), bs, name)
    ref.kv_rope_insert(kv, caches[0], *args, numerics=numerics or None)
    ops.kv_rope_insert(kv, caches[1], *args, numerics=numerics or None)  # CPU: the torch op
    assert torch.equal(caches[0], caches[1])
    page = caches[0][0].tolist()
    assert page[bs * (db + sb) :] == [POISON] * 16  # page padding untouched
    data = [page[o * db : (o + 1) * db] for o in range(bs)]
    scale = [page[bs * db + o * sb : bs * db + (o + 1) * sb] for o in range(bs)]
    return data, scale


def by_preset(table: dict[str, dict], preset: str) -> dict:
    """An entry table keyed by preset ("" = the format defaults) with "*" for every preset."""
    out = dict(table.get("*", {}))
    out.update(table.get(preset, {}))
    return out


# =============================================================================================
# fp8_ds_mla: 7 NoPE blocks of 64 (one row class each) + the bf16 rope tail, one token
# =============================================================================================
DS_ROW = {
    # block 0, finite and signed zeros: amax 3 -> e = ceil(log2(3/448)) = -7 -> byte 120, x * 128:
    # 3 -> 384 = 0x7C, -1 -> -128 = 0xF0, -0.0 -> 0x80 (no preset rotates the NoPE dims of this
    # record: vLLM's 584 B Triton writer quantizes them unrotated), -2 -> -256 = 0xF8
    0: 3.0, 1: -1.0, 2: -0.0, 3: -2.0,
    # block 1, NaN: amax ignores it -> 1 -> e = ceil(-8.807) = -8 -> byte 119; 1 * 256 = 0x78
    64: NAN, 65: 1.0,
    # block 2, Inf (with 2 and -3)
    128: INF, 129: -INF, 130: 2.0, 131: -3.0,
    # block 3, below the amax floor: amax 2^-20
    192: 2.0**-20, 193: -(2.0**-24),
    # block 4: zeros; block 5, overflow: amax = BF16_MAX -> 2^119.19 -> e = 120 -> byte 247,
    # x * 2^-120: 255 -> 256 = 0x78, -2^126 -> -64 = 0xE8
    320: BF16_MAX, 321: -(2.0**126),
    # block 6: zeros
}  # fmt: skip
DS_DATA = {
    "*": {0: 0x7C, 1: 0xF0, 2: 0x80, 3: 0xF8, 65: 0x78, 320: 0x78, 321: 0xE8,
          # tail dims 448, 449 at bytes 448..451 (bf16 little-endian): even' 0xBFC1, odd' 0x3F00
          448: 0xC1, 449: 0xBF, 450: 0x00, 451: 0x3F},
    # NaN -> 0x7F; Inf block (byte 254) x * 2^-126: Inf -> 448, -Inf -> -448, 2 -> 0, -3 -> -0;
    # below the 1e-4 floor: e = ceil(log2(1e-4 / 448)) = -22 -> byte 105, x * 2^22: 2^-20 -> 4 = 0x48,
    # -2^-24 -> -0.25 = 0xA8 (E = 5)
    "": {64: 0x7F, 128: 0x7E, 129: 0xFE, 130: 0x00, 131: 0x80, 192: 0x48, 193: 0xA8},
    # NaN -> 0xFE; Inf block x * 0: Inf, -Inf -> NaN -> 0xFE, 2 -> +0, -3 -> -0
    "preset=vllm": {64: 0xFE, 128: 0xFE, 129: 0xFE, 130: 0x00, 131: 0x80, 192: 0x48, 193: 0xA8},
    # NaN -> 0x7E; Inf block x * 0 -> NaN -> 0x7E; odd RoPE term fma(o, c, e*s): 0x3F01
    "preset=vllm-triton": {64: 0x7E, 128: 0x7E, 129: 0x7E, 130: 0x00, 131: 0x80, 192: 0x48, 193: 0xA8,
                           450: 0x01},
    # scale floor 2^-13 (byte 114): x * 2^13: 2^-20 -> 2^-7 = 4 * 2^-9 -> subnormal 0x04; -2^-24 ->
    # -2^-11 = -0.25 units of 2^-9 -> -0 = 0x80; Inf block x / Inf: NaN -> 0x7F
    "preset=flashmla": {64: 0x7F, 128: 0x7F, 129: 0x7F, 130: 0x00, 131: 0x80, 192: 0x04, 193: 0x80},
    # floor 1e-8: amax 2^-20 is above it: e = ceil(-20 - 8.807) = -28 -> byte 99; x * 2^28: 2^-20 ->
    # 256 = 0x78, -2^-24 -> -16 = 0xD8 (E = 11); NaN and the Inf block as vllm-triton; 0x3F01
    "preset=trtllm": {64: 0x7E, 128: 0x7E, 129: 0x7E, 130: 0x00, 131: 0x80, 192: 0x78, 193: 0xD8, 450: 0x01},
}  # fmt: skip
DS_SCALE = {
    # [block 0..6, pad]: 120, 119, Inf block, below the floor, zeros, 247, zeros, pad
    "": [120, 119, 254, 105, 105, 247, 105, 0],
    "preset=vllm": [120, 119, 255, 105, 105, 247, 105, 0],
    "preset=vllm-triton": [120, 119, 255, 105, 105, 247, 105, 0],
    # zero blocks: max(0 / 448, 1e-4) -> 2^-13 -> 114
    "preset=flashmla": [120, 119, 255, 114, 114, 247, 114, 0],
    # zero blocks: 1e-8 / 448 = 2^-35.4 -> e = -35 -> byte 92; Inf: 126; the pad byte is not written
    "preset=trtllm": [120, 119, 126, 99, 92, 247, 92, POISON],
}


@pytest.mark.parametrize("preset", sorted(DS_SCALE))
def test_fp8_ds_mla_presets(preset):
    data, scale = write("fp8_ds_mla", [DS_ROW], preset)
    assert data[0] == byte_row(576, by_preset(DS_DATA, preset))
    assert scale[0] == DS_SCALE[preset]


# =============================================================================================
# mxfp8: 16 blocks of 32 (the rope dims quantized too), one token
# =============================================================================================
MX_ROW = {
    # block 0, finite and signed zeros: amax 3 -> byte 120, x * 128. Pairs (2, 3) = (-0, -2) and
    # (6, 7) = (1, -0): the NoPE rotation gives -0 - (-2 * 0) = -0 + 0 = +0 and -0 + 1 * 0 = +0;
    # pairs (4, 5) = (-0, 2) and (8, 9) = (-1, -0) keep their -0 (-0 - 0 = -0, -0 + -0 = -0)
    0: 3.0, 1: -1.0, 2: -0.0, 3: -2.0, 4: -0.0, 5: 2.0, 6: 1.0, 7: -0.0, 8: -1.0, 9: -0.0,
    # block 1, NaN: (32, 33) = (NaN, 2); the rotation spreads the NaN to 33 (2 + NaN * 0)
    32: NAN, 33: 2.0, 34: 1.0,
    # block 2, Inf: (64, 65) = (Inf, 1); the rotation gives 65 = 1 + Inf * 0 = NaN
    64: INF, 65: 1.0, 66: -3.0,
    # block 3, below the floor; block 4 zeros; block 5 overflow (as fp8_ds_mla)
    96: 2.0**-20, 97: -(2.0**-24),
    160: BF16_MAX, 161: -(2.0**126),
}  # fmt: skip
MX_DATA = {
    # 3, -1, -2, 2 (256), 1 (128), -1 at x 128; (-0, 2) -> 0x80; (-1, -0) -> 0xF0, 0x80; the
    # overflow block; block 14 (dims 448..479, the rope pair, amax |even'| = 1.5078 in bf16, 1.5098 in
    # float32): e = ceil(log2(1.51 / 448)) = -8 -> x 256: even' -386 / -386.5 -> -384 = 0xFC; odd'
    # 0.5 + 2^-9 (+2^-24) -> 128.5 -> 128 = 0x70 (the two RoPE orders round to the same byte here)
    "*": {0: 0x7C, 1: 0xF0, 3: 0xF8, 4: 0x80, 5: 0x78, 6: 0x70, 8: 0xF0, 9: 0x80, 96 + 0: 0x48, 97: 0xA8,
          160: 0x78, 161: 0xE8, 448: 0xFC, 449: 0x70},
    # no rotation: -0 stays 0x80; block 1 amax 2 -> byte 120: NaN -> 0x7F, 2 -> 0x78, 1 -> 0x70;
    # Inf block (254): Inf -> 0x7E, 1 -> 0x00, -3 -> 0x80
    "": {2: 0x80, 7: 0x80, 32: 0x7F, 33: 0x78, 34: 0x70, 64: 0x7E, 65: 0x00, 66: 0x80},
    "preset=vllm": {2: 0x80, 7: 0x80, 32: 0xFE, 33: 0x78, 34: 0x70, 64: 0xFE, 65: 0x00, 66: 0x80},
    # rotated: +0 at 2 and 7; block 1 amax 1 (33 is NaN) -> byte 119: NaN, NaN -> 0x7E, 1 * 256 -> 0x78;
    # Inf block x * 0: Inf -> NaN, NaN -> 0x7E, -3 -> -0
    "preset=vllm-triton": {2: 0x00, 7: 0x00, 32: 0x7E, 33: 0x7E, 34: 0x78, 64: 0x7E, 65: 0x7E, 66: 0x80},
    # the scale floor: below-floor block at 2^-13 (x 2^13: 0x04, 0x80); otherwise the defaults
    "preset=sglang": {2: 0x80, 7: 0x80, 32: 0x7F, 33: 0x78, 34: 0x70, 64: 0x7E, 65: 0x00, 66: 0x80,
                      96: 0x04, 97: 0x80},
}  # fmt: skip
MX_SCALE = {
    # blocks: 0: 120, 1: NaN block, 2: Inf block, 3: below the floor, 4: zeros, 5: 247, 6..13 zeros,
    # 14: 119 (the rope pair), 15: zeros
    "": [120, 120, 254, 105, 105, 247] + [105] * 8 + [119, 105],
    "preset=vllm": [120, 120, 255, 105, 105, 247] + [105] * 8 + [119, 105],
    "preset=vllm-triton": [120, 119, 255, 105, 105, 247] + [105] * 8 + [119, 105],
    "preset=sglang": [120, 120, 254, 114, 114, 247] + [114] * 8 + [119, 114],
}


@pytest.mark.parametrize("preset", sorted(MX_SCALE))
def test_mxfp8_presets(preset):
    data, scale = write("mxfp8", [MX_ROW], preset)
    assert data[0] == byte_row(512, by_preset(MX_DATA, preset))
    assert scale[0] == MX_SCALE[preset]


# =============================================================================================
# nvfp4_v41: 32 groups of 16, E4M3 scales s = e4m3(clamp(amax * fl(1/6), 2^-9, 448)), codes x / s
# =============================================================================================
NV_ROW = {
    # group 0: amax 6 -> s = 6 * fl(1/6) -> 1.0 (0x38); codes 6 -> 7, -0.25 -> -0 (a tie to 0), -0,
    # -1 -> 0xA, 1 -> 2, -0; the rotation turns the -0 of (2, 3) = (-0, -1) and (4, 5) = (1, -0) to +0
    0: 6.0, 1: -0.25, 2: -0.0, 3: -1.0, 4: 1.0, 5: -0.0,
    # group 1, NaN: (16, 17) = (NaN, 3), 18 = 1.5
    16: NAN, 17: 3.0, 18: 1.5,
    # group 2, Inf: (32, 33) = (Inf, 2), 34 = -3
    32: INF, 33: 2.0, 34: -3.0,
    # group 3, below the scale clamp: 2^-12 * fl(1/6) < 2^-9 -> s = 2^-9 (0x01): 2^-12 -> 0.125 units
    # -> 0, -2^-14 -> -2^-5 units -> -0 (0x8): byte 24 = 0x80
    48: 2.0**-12, 49: -(2.0**-14),
    # group 4, overflow: 3072 / 6 = 512 -> clamp 448 (0x7E): 3072 / 448 = 6.86 -> 7, -1024 / 448 =
    # -2.29 -> -2 = 0xC: byte 32 = 0xC7
    64: 3072.0, 65: -1024.0,
}  # fmt: skip
NV_DATA = {
    "*": {0: 0x87, 24: 0x80, 32: 0xC7,
          # group 28 (the rope pair): amax |even'| 1.5078 (bf16) or 1.5098: s = e4m3(0.2513 / 0.2516)
          # = 0.25 (0x28); even' -6.03 / -6.04 -> -6 = 0xF, odd' 0.5 + 2^-9 (+2^-24) -> 2.008 -> 2.0
          # (code 4)
          224: 0x4F},
    # signed zeros kept: (-0, -1) -> 0xA8, (1, -0) -> 0x82; group 1 amax 3 -> s = 0.5 (0x30): NaN -> 7,
    # 3 / 0.5 = 6 -> 7, 1.5 / 0.5 = 3 -> 5; group 2 s = 448: Inf -> 7, 2 / 448 -> 0, -3 / 448 -> -0
    "": {1: 0xA8, 2: 0x82, 8: 0x77, 9: 0x05, 16: 0x07, 17: 0x08},
    "preset=sglang": {1: 0xA8, 2: 0x82, 8: 0x77, 9: 0x05, 16: 0x07, 17: 0x08},
    # rotated: +0 at dims 2 and 5 -> 0xA0, 0x02; group 1: 17 is NaN, amax 1.5 -> s = 0.25 (0x28): 18 ->
    # 6 -> 7; group 2: 33 = 2 + Inf * 0 = NaN -> 7
    "preset=vllm-triton": {1: 0xA0, 2: 0x02, 8: 0x77, 9: 0x07, 16: 0x77, 17: 0x08},
}  # fmt: skip
NV_SCALE = {
    "": [0x38, 0x30, 0x7E, 0x01, 0x7E] + [0x01] * 23 + [0x28] + [0x01] * 3,
    "preset=sglang": [0x38, 0x30, 0x7E, 0x01, 0x7E] + [0x01] * 23 + [0x28] + [0x01] * 3,
    "preset=vllm-triton": [0x38, 0x28, 0x7E, 0x01, 0x7E] + [0x01] * 23 + [0x28] + [0x01] * 3,
}


@pytest.mark.parametrize("preset", sorted(NV_SCALE))
def test_nvfp4_v41_presets(preset):
    data, scale = write("nvfp4_v41", [NV_ROW], preset)
    assert data[0] == byte_row(256, by_preset(NV_DATA, preset))
    assert scale[0] == NV_SCALE[preset]


def test_nvfp4_dsv4_flashinfer_is_the_format_defaults():
    """FlashInfer's writer is what nvfp4_dsv4's defaults follow (formats.py cites it): the preset
    resolves to the defaults and writes the same bytes (pinned by test_golden_nvfp4)."""
    fmt = get_format("nvfp4_dsv4")
    assert fmt.resolve_numerics("preset=flashinfer") == fmt.numerics
    assert write("nvfp4_dsv4", [NV_ROW], "preset=flashinfer") == write("nvfp4_dsv4", [NV_ROW], "")


# =============================================================================================
# fp8_token (D = 128: NoPE 0..63, rope 64..127): one block, one float32 scale per token -> a token
# per row class
# =============================================================================================
TOKEN_ROWS = [
    {0: 3.0, 1: -1.0, 2: -0.0, 3: -2.0, 4: 1.0, 5: -0.0},  # finite and signed zeros
    {0: NAN, 1: 2.0, 2: 1.0},  # NaN
    {0: INF, 1: 1.0, 2: -3.0},  # Inf
    {0: 2.0**-20, 1: -(2.0**-24)},  # below the amax floor
    {0: BF16_MAX, 1: -(2.0**126)},  # overflow
]


def f32_bytes(bits: int) -> list[int]:
    return list(struct.pack("<I", bits))


TOKEN_DATA = {
    # row 0: e = ceil(log2(3 * fl(1/448))) = -7, x 128: 0x7C, 0xF0, -0 -> 0x80 (rotated: +0), 0xF8,
    # 0x70, -0 (rotated: +0); the rope pair (dims 64, 65), x 128: even' -1.5078125 -> -193 -> -192 =
    # 0xF4 (step 16), odd' 0.5 or 0.50390625 -> 64 or 64.5 -> 64 = 0x68 (step 8)
    "": [{0: 0x7C, 1: 0xF0, 2: 0x80, 3: 0xF8, 4: 0x70, 5: 0x80},
         # row 1: amax 2 -> e = -7: NaN -> 0x7F, 2 -> 0x78, 1 -> 0x70; row 2 (2^127): Inf -> 0x7E,
         # 1 * 2^-126 -> 0, -3 -> -0; row 3: e = -22 (floor), x 2^22: 4 -> 0x48, -0.25 -> 0xA8;
         # row 4: e = 120: 0x78, 0xE8
         {0: 0x7F, 1: 0x78, 2: 0x70}, {0: 0x7E, 1: 0x00, 2: 0x80}, {0: 0x48, 1: 0xA8}, {0: 0x78, 1: 0xE8}],
    # rotated: +0 at 2 and 5; row 1: 1 = 2 + NaN * 0 = NaN, amax 1 -> e = -8: 0x7E, 0x7E, 1 -> 0x78;
    # row 2 (scale +Inf): Inf -> NaN, 1 -> NaN (rotated), -3 -> -0: 0x7E, 0x7E, 0x80
    "preset=vllm-triton": [{0: 0x7C, 1: 0xF0, 2: 0x00, 3: 0xF8, 4: 0x70, 5: 0x00},
                           {0: 0x7E, 1: 0x7E, 2: 0x78}, {0: 0x7E, 1: 0x7E, 2: 0x80}, {0: 0x48, 1: 0xA8},
                           {0: 0x78, 1: 0xE8}],
}  # fmt: skip
TOKEN_SCALE = {  # float32 2^e: (e + 127) << 23
    "": [0x3C000000, 0x3C000000, 0x7F000000, 0x34800000, 0x7B800000],
    "preset=vllm-triton": [0x3C000000, 0x3B800000, 0x7F800000, 0x34800000, 0x7B800000],  # 2^128 = +Inf
}


@pytest.mark.parametrize("preset", sorted(TOKEN_SCALE))
def test_fp8_token_presets(preset):
    data, scale = write("fp8_token", TOKEN_ROWS, preset)
    for row, (got, want) in enumerate(zip(data, TOKEN_DATA[preset])):
        assert got == byte_row(128, {**want, **({64: 0xF4, 65: 0x68} if row == 0 else {})}), row
    assert scale == [f32_bytes(b) for b in TOKEN_SCALE[preset]]


# =============================================================================================
# mxfp4 (D = 128): 4 blocks of 32, UE8M0 scales; a second token for the overflow class
# =============================================================================================
MXFP4_ROWS = [
    {
        0: 6.0, 1: -0.25, 2: -0.0, 3: -1.0, 4: 1.0, 5: -0.0,  # block 0: amax 6 -> e = 0 (127)
        32: NAN, 33: 3.0, 34: 1.5,  # block 1, NaN
        # block 2 is rope dims: the pair (64, 65), then (66, 67) = (Inf, 2) whose RoPE (cos 1, sin 0)
        # gives 67 = fma(Inf, 0, 2 * 1) = NaN in either order, and 68 = -3
        66: INF, 67: 2.0, 68: -3.0,
        # block 3, below the floor 6 * 2^-126: amax 2^-126 -> r = 2^-126 -> e = -126 (byte 1),
        # x 2^126: 1 -> code 2, -2^-127 -> -0.5 -> 0x9: byte 48 = 0x92
        96: 2.0**-126, 97: -(2.0**-127),
    },
    # overflow: BF16_MAX / 6 = 2^125.4 -> e = 126 (byte 253), x 2^-126: 3.98 -> 4 (code 6),
    # -2^126 -> -1 (0xA): byte 0 = 0xA6
    {0: BF16_MAX, 1: -(2.0**126)},
]  # fmt: skip
MXFP4_DATA = {
    # row 0: codes 6 -> 7, -0.25 -> -0 (8): byte 0 = 0x87; (-0, -1) 0xA8, (1, -0) 0x82; block 1 amax 3
    # -> 3/6 = 0.5 -> e = -1 (126), x 2: NaN -> 7, 6 -> 7, 3 -> 5; block 2 (254, x 2^-126): the rope
    # pair -> even' -0 (8), odd' +0; Inf -> 7, NaN -> 7, -3 -> -0 (8)
    "": [{0: 0x87, 1: 0xA8, 2: 0x82, 16: 0x77, 17: 0x05, 32: 0x08, 33: 0x77, 34: 0x08, 48: 0x92}, {0: 0xA6}],
    # rotated: +0 in (-0, -1) and (1, -0): 0xA0, 0x02; block 1: 33 is NaN, amax 1.5 -> e = -2 (125),
    # x 4: 1.5 -> 6 -> 7; block 2 as above
    "preset=vllm-triton": [{0: 0x87, 1: 0xA0, 2: 0x02, 16: 0x77, 17: 0x07, 32: 0x08, 33: 0x77, 34: 0x08,
                            48: 0x92}, {0: 0xA6}],
}  # fmt: skip
MXFP4_SCALE = {
    "": [[127, 126, 254, 1], [253, 1, 1, 1]],
    "preset=vllm-triton": [[127, 125, 254, 1], [253, 1, 1, 1]],
}


@pytest.mark.parametrize("preset", sorted(MXFP4_SCALE))
def test_mxfp4_presets(preset):
    data, scale = write("mxfp4", MXFP4_ROWS, preset)
    assert data == [byte_row(64, w) for w in MXFP4_DATA[preset]]
    assert scale == MXFP4_SCALE[preset]


# =============================================================================================
# bf16 rows (D = 128): the NoPE rotation and the RoPE order are visible bit for bit
# =============================================================================================
BF16_ROW = {0: -0.0, 1: -2.0, 2: 1.0, 3: -0.0, 4: INF, 5: 1.0, 6: NAN, 7: 5.0}


@pytest.mark.parametrize("preset", ["", "preset=vllm-triton"])
def test_bf16_presets(preset):
    (data,), (scale,) = write("bf16", [BF16_ROW], preset)
    rotated = bool(preset)
    assert scale == []
    # (-0, -2): -0 - (-2 * 0) = +0 when rotated; (1, -0): -0 + 1 * 0 = +0 when rotated
    assert data[0:4] == [0x00, 0x00 if rotated else 0x80, 0x00, 0xC0]
    assert data[4:8] == [0x80, 0x3F, 0x00, 0x00 if rotated else 0x80]
    # (Inf, 1): 1 + Inf * 0 = NaN when rotated; (NaN, 5): 5 + NaN * 0 = NaN when rotated
    assert data[8:10] == [0x80, 0x7F]  # +Inf
    assert is_bf16_nan(data[10], data[11]) if rotated else data[10:12] == [0x80, 0x3F]
    assert is_bf16_nan(data[12], data[13])
    assert is_bf16_nan(data[14], data[15]) if rotated else data[14:16] == [0xA0, 0x40]
    # the rope pair at dims 64, 65: even' 0xBFC1; odd' 0x3F00 (even_sin) or 0x3F01 (odd_cos)
    assert data[128:132] == [0xC1, 0xBF, 0x01 if rotated else 0x00, 0x3F]
    assert data[16:128] == [0] * 112 and data[132:] == [0] * 124
