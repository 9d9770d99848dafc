"""Golden vectors of the parity choices (formats.Numerics), field by field, derived BY HAND
(conventions: test_golden_vectors)."""

from __future__ import annotations

import pytest
import torch
from attn_prologue import reference as ref
from attn_prologue.formats import Fp4Zero, Numerics, RotatedRow, ScaleFloor, get_format

from .support.golden import (
    INF,
    byte_row,
    encode,
    encode_with,
    f32_row,
)

# =============================================================================================
# Parity choices (formats.Numerics)
# =============================================================================================
# UE8M0 scale floor. ScaleFloor.SCALE is the convention of FlashMLA's reference quantizer
# (deepseek-ai/FlashMLA tests/quant.py @ 520fec6a, `_cast_scale_inv_to_ue8m0`: 2^ceil(log2(
# clamp_min(amax / 448, 1e-4)))) and SGLang's V4.1 writer (sgl-project/sglang
# python/sglang/kernels/jit/include/sgl_kernel/deepseek_v4/kv_layout.cuh @ 2005a302, `store_row_fp8`:
# the exponent byte floored at 114). fl32(1e-4) = 1.00000005e-4 = 2^-13.29, so the floor gives
# e = -13 -> byte 114.
#   amax 0:    AMAX: 1e-4 / 448 = 2.2321e-7 = 2^-22.09 -> e = -22 -> 105 | SCALE: 1e-4 -> 114
#   amax 0.01: AMAX: 0.01 / 448 = 2.2321e-5 = 2^-15.45 -> e = -15 -> 112; 0.01 * 2^15 = 327.68 ->
#              step 32 in [256, 512): 320 = 1.25 * 2^8 -> 0 1111 010 = 0x7A
#              SCALE: max(2.2321e-5, 1e-4) -> e = -13 -> 114; 0.01 * 2^13 = 81.92 -> step 8 in
#              [64, 128): 80 = 1.25 * 2^6 -> 0 1101 010 = 0x6A
#   amax 0.04: 0.04 / 448 = 8.93e-5 = 2^-13.45: both give e = -13 -> 114 (they differ only where the
#              floors give different ceilings); 0.04 * 2^13 = 327.68 -> 0x7A
#   amax 448:  e = 0 -> 127 in both; 448 -> 0x7E
SCALE_FLOOR_CASES = {
    # name: (block size, {dim: value}, {ScaleFloor: (data entries, scale record)})
    "fp8_ds_mla": (
        64,
        {64: 0.01, 128: 0.04, 192: 448.0},
        {
            ScaleFloor.AMAX: ({64: 0x7A, 128: 0x7A, 192: 0x7E}, [105, 112, 114, 127, 105, 105, 105, 0]),
            ScaleFloor.SCALE: ({64: 0x6A, 128: 0x7A, 192: 0x7E}, [114, 114, 114, 127, 114, 114, 114, 0]),
        },
    ),
    "mxfp8": (
        32,
        {32: 0.01, 64: 0.04, 96: 448.0},
        {
            ScaleFloor.AMAX: ({32: 0x7A, 64: 0x7A, 96: 0x7E}, [105, 112, 114, 127] + [105] * 12),
            ScaleFloor.SCALE: ({32: 0x6A, 64: 0x7A, 96: 0x7E}, [114, 114, 114, 127] + [114] * 12),
        },
    ),
}


@pytest.mark.parametrize("name", sorted(SCALE_FLOOR_CASES))
@pytest.mark.parametrize("floor", list(ScaleFloor))
def test_scale_floor_choice(name, floor):
    _, entries, want = SCALE_FLOOR_CASES[name]
    x = f32_row(512, entries)
    data, scale = encode_with(name, x, Numerics(scale_floor=floor))
    want_data, want_scale = want[floor]
    n = 576 if name == "fp8_ds_mla" else 512
    assert data[0].tolist() == byte_row(n, want_data)
    assert scale[0].tolist() == want_scale
    if floor is ScaleFloor.AMAX:  # the default: the same bytes as no choice at all
        assert torch.equal(encode(name, x)[1], scale)


def test_fp4_zero_choice_mxfp4():
    """mxfp4 keeps its signed zeros by default (test_mxfp4_golden); POSITIVE clears them:
    block 0 byte 4 holds -0.25 (tie -> -0) and -0.75 (-> -1.0 = 0xA): 0xA8 signed, 0xA0 positive."""
    x = f32_row(128, {0: 6.0, 8: -0.25, 9: -0.75, 10: -0.1})
    signed, _ = encode("mxfp4", x)
    positive, _ = encode_with("mxfp4", x, Numerics(fp4_zero=Fp4Zero.POSITIVE))
    assert signed[0, 4].item() == 0xA8 and positive[0, 4].item() == 0xA0
    assert signed[0, 5].item() == 0x08 and positive[0, 5].item() == 0x00  # -0.1 -> -0


def test_rotated_row_choice():
    """RotatedRow.FP32 (vLLM's Triton compressed writer) quantizes the float32 RoPE output: the
    case of test_kv_values_are_rounded_before_quantization, where c * 256 = 272 + 2^-12 is above
    the 256 / 288 tie -> 288 = 1.125 * 2^8 -> 0 1111 001 = 0x79 (the default stores 0x78); the
    scale is the same (amax 1.0625 + 2^-20 -> e = -8 -> 119)."""
    d, r = 512, 64
    c = 1.0625 + 2.0**-20
    cs = torch.zeros(1, r, dtype=torch.float32)
    cs[0, : r // 2] = 1.0
    cs[0, 0] = c
    kv = torch.zeros(1, d, dtype=torch.bfloat16)
    kv[0, 448] = 1.0
    for rotated, byte in ((RotatedRow.IO_ROUNDED, 0x78), (RotatedRow.FP32, 0x79)):
        cache = torch.full((1, 528), 0xA5, dtype=torch.uint8)
        ref.kv_rope_insert(
            kv,
            cache,
            torch.tensor([0]),
            torch.tensor([0]),
            cs,
            1,
            "mxfp8",
            numerics=Numerics(rotated_row=rotated),
        )
        assert cache[0, 448].item() == byte and cache[0, 512 + 14].item() == 119


def test_numerics_a_format_does_not_have_is_refused():
    with pytest.raises(ValueError, match="nvfp4_v41 has no scale_floor choice"):
        encode_with("nvfp4_v41", torch.zeros(1, 512), Numerics(scale_floor=ScaleFloor.SCALE))
    with pytest.raises(ValueError, match="fp8_ds_mla has no fp4_zero choice"):
        encode_with("fp8_ds_mla", torch.zeros(1, 512), Numerics(fp4_zero=Fp4Zero.SIGNED))
    assert get_format("mxfp8").resolve_numerics(Numerics()) == get_format("mxfp8").numerics


def test_field_values_no_preset_uses():
    """The values only the field spelling reaches, by hand:
    mxfp8 inf_scale=126: block 0 = (Inf, 2, -3) -> byte 126 and every element x * 0: Inf -> NaN ->
    0x7F (e4m3_nan default), 2 -> +0, -3 -> -0 (0x80); the zero blocks keep byte 105.
    nvfp4_dsv4 scale_pad=skip: group 0 amax 1 -> 1 / 6 = 1.333 * 2^-3 -> e4m3 1.375 * 2^-3 (0x23, nearer
    than 1.25), the zero groups 0x00; the footer's 4 pad bytes keep the cache's poison (0xA5).
    fp8_tensor nope_rotation=identity (kv_scale 1, position 0 with cos 1, sin 0): (-0, -2) ->
    (-0 - (-2 * 0), -2 + -0 * 0) = (+0, -2): bytes 0x00, 0xC0 (the default keeps 0x80 for the -0)."""
    data, scale = encode_with("mxfp8", f32_row(512, {0: INF, 1: 2.0, 2: -3.0}), "inf_scale=126")
    assert data[0, :3].tolist() == [0x7F, 0x00, 0x80] and scale[0].tolist() == [126] + [105] * 15
    cache = torch.full((1, 2 * 384), 0xA5, dtype=torch.uint8)
    fmt = get_format("nvfp4_dsv4")
    ref.insert_kv(cache, fmt, f32_row(512, {0: 1.0}), torch.tensor([1]), 2, numerics="scale_pad=skip")
    footer = cache[0, 2 * 352 + 32 : 2 * 352 + 64].tolist()  # token 1's scale record
    assert footer == [0x23] + [0x00] * 27 + [0xA5] * 4
    cs = torch.cat((torch.ones(1, 16), torch.zeros(1, 16)), dim=1)
    kv = torch.tensor([[-0.0, -2.0] + [0.0] * 62], dtype=torch.bfloat16)
    for numerics, first in (("", 0x80), ("nope_rotation=identity", 0x00)):
        cache = torch.full((1, 64), 0xA5, dtype=torch.uint8)
        ref.kv_rope_insert(kv, cache, torch.tensor([0]), torch.tensor([0]), cs, 1, "fp8_tensor",
                           kv_scale=torch.tensor(1.0), numerics=numerics)  # fmt: skip
        assert cache[0, :3].tolist() == [first, 0xC0, 0x00]
