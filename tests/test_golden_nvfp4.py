"""Golden vectors of the NVFP4 records (nvfp4_v41, nvfp4_dsv4), derived BY HAND (conventions:
test_golden_vectors)."""

from __future__ import annotations

import math
import struct

import torch
from attn_prologue import codecs
from attn_prologue import numerics as nx
from attn_prologue.formats import Fp4Zero, Numerics, get_format

from .support.golden import (
    INF,
    NAN,
    byte_row,
    encode,
    encode_with,
    f32_row,
    insert_and_read,
)

# =============================================================================================
# NVFP4: E2M1 codes with one E4M3 scale per 16-wide group, no global scale
# =============================================================================================
# fl(1/6) = 0x3E2AAAAB = 11184811 * 2^-26 and 6 * 11184811 = 2^26 + 2, so fl(1/6) = (1/6)(1 + 2^-25):
# amax * fl(1/6) is amax / 6 times (1 + 2^-25) before its own rounding.
# fl(1/1.875) = fl(8/15): 8/15 = 0.1000 1000 1000...b; the bits past the 24th are 0.1000...b of an ulp
# (> half), so it rounds UP by 0.4667 ulp: fl(8/15) = (8/15)(1 + 0.875 * 2^-24).
NVFP4_X = {
    # group 1 (dims 16..31): amax 6
    16: 6.0,
    17: 0.25,  # e2m1 ties: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    18: 0.75,
    19: 1.25,
    20: 1.75,
    21: 2.5,
    22: 3.5,
    23: 5.0,
    24: -0.25,  # rounds to -0: the Fp4Zero choice decides 0x0 or 0x8
    25: -5.01,  # above the 4 / 6 tie: -6 = 0xF
    26: -0.0,
    27: 0.26,  # above the 0 / 0.5 tie: code 1
    # group 2 (dims 32..47): amax 11.25 = 6 * 1.875; the others are e2m1 ties times 1.875
    32: 11.25,
    33: 2.34375,  # 1.25 * 1.875
    34: 4.6875,  # 2.5 * 1.875
    35: 9.375,  # 5 * 1.875
    # group 3 (dims 48..63): one float32 ulp below 7.125 = 6 * 1.1875, an e4m3 midpoint times 6
    48: 7.125 - 2.0**-21,  # 0x40E3FFFF
    # group 4 (dims 64..79): tiny group
    64: 2.0**-12,
    65: 2.0**-10,
    66: -(2.0**-11),
    # group 5 (dims 80..95): amax / 6 above 448
    80: 3000.0,
    81: -1000.0,
    # group 6: NaN is ignored by amax
    96: NAN,
    97: 3.0,
    # group 7: Inf
    112: INF,
    113: -INF,
    114: 448.0,
    # dims 448..511 are the rotated rope dims
    448: 1.0,
    449: -0.5,
    511: -0.0,
}

# nvfp4_v41: s = e4m3(clamp(amax * fl(1/6), 2^-9, 448)), codes e2m1(x / s) (IEEE division), Fp4Zero
# default SIGNED (FlashMLA, SGLang @2005a302, FlashInfer, vLLM's Triton writer). Byte j of the data record
# holds dims 2j (low nibble) and 2j + 1 (high nibble).
NVFP4_V41_SCALE = (
    [
        0x01,  # g0: amax 0 -> 0 -> clamp to 2^-9 -> e4m3 0x01 (smallest subnormal); codes 0
        0x38,  # g1: 6 * fl(1/6) = 1 + 2^-25 -> float32 1.0 (below half an ulp, 2^-24) -> 0 0111 000
        0x3F,  # g2: 11.25 * fl(1/6) = 1.875 (1 + 2^-25) -> 1.875 (0.94 * 2^-24 < 2^-24) -> 0 0111 111
        # g3: (7.125 - 2^-21) * fl(1/6) = 1.1875 - 1.48 * 2^-25 -> float32 1.1875 (within half an ulp):
        # the e4m3 tie between 1.125 (M=1) and 1.25 (M=2) -> even M=2 -> 0 0111 010. (amax / 6
        # = 1.1875 - 2^-21/6 rounds to 1.1875 - 2^-23, below the tie: 0x39. This pins the multiply.)
        0x3A,
        0x01,  # g4: 2^-10 * fl(1/6) = 1.6e-4 < 2^-9 -> clamp -> 0x01
        0x7E,  # g5: 3000 * fl(1/6) = 500 -> clamp 448 -> 0 1111 110
        0x30,  # g6: amax 3 (NaN ignored) -> 0.5 (1 + 2^-25) -> 0.5 -> 0 0110 000
        0x7E,  # g7: Inf * fl(1/6) = Inf -> clamp 448
    ]
    + [0x01] * 20  # g8..g27: zero
    # g28 (dims 448..463): amax 1 -> fl(1/6) = 0.16666667 = 1.3333 * 2^-3 -> nearer 1.375 (M=3)
    # than 1.25 -> 0.171875, E = 4 -> 0 0100 011
    + [0x23]
    + [0x01] * 3  # g29..g31: zero (dim 511 holds -0)
)
NVFP4_V41_DATA = {
    8: 0x07,  # dims 16, 17: 6 / 1 -> 7; 0.25 tie -> 0
    9: 0x22,  # 0.75 tie -> 2 (1.0); 1.25 tie -> 2 (1.0)
    10: 0x44,  # 1.75 tie -> 4 (2.0); 2.5 tie -> 4 (2.0)
    11: 0x66,  # 3.5 tie -> 6 (4.0); 5.0 tie -> 6 (4.0)
    12: 0xF8,  # -0.25 -> -0 keeps its sign (SIGNED): 0x8; -5.01 -> -6 = 0xF
    13: 0x18,  # -0.0 -> 0x8 (SIGNED); 0.26 -> 1 (0.5)
    16: 0x27,  # dims 32, 33: 11.25 / 1.875 = 6 -> 7; 2.34375 / 1.875 = 1.25 exactly, a tie -> 2
    17: 0x64,  # 4.6875 / 1.875 = 2.5 tie -> 4; 9.375 / 1.875 = 5 tie -> 6
    24: 0x07,  # dim 48: (7.125 - 2^-21) / 1.25 = 5.7 -> 7
    32: 0x10,  # dims 64, 65 (s = 2^-9): 2^-12 -> 0.125 -> 0; 2^-10 -> 0.5 -> 1
    33: 0x08,  # dim 66: -2^-11 / 2^-9 = -0.25, tie -> -0 -> 0x8 (SIGNED)
    40: 0xC7,  # dims 80, 81 (s = 448): 6.70 -> saturate 7; -2.23 -> -2 = 0xC
    48: 0x77,  # dims 96, 97 (s = 0.5): NaN -> 0x7 (+6); 3 / 0.5 = 6 -> 7
    56: 0xF7,  # dims 112, 113 (s = 448): Inf -> 7; -Inf -> 0xF
    57: 0x02,  # dim 114: 448 / 448 = 1 -> 2
    224: 0xD7,  # dims 448, 449 (s = 0.171875): 5.82 -> 7; -2.91 -> -3 = 0xD
    255: 0x80,  # dim 511: -0.0 (group 31, s = 2^-9) -> 0x8 in the high nibble (SIGNED)
}

# nvfp4_dsv4: FlashInfer's SM120 writer (formats.py names the file and commit): s =
# e4m3_satfinite(amax / 6), IEEE division, no clamp; codes e2m1(x * fl(1/s)), all zero when s is 0;
# Fp4Zero default SIGNED (the hardware conversion keeps the sign); dims 448..511 stored as bf16.
NVFP4_DSV4_SCALE = (
    [
        0x00,  # g0: 0 / 6 = 0 -> e4m3 0x00; codes x * 0 = 0
        0x38,  # g1: 6 / 6 = 1
        0x3F,  # g2: 11.25 / 6 = 1.875 exactly
        0x39,  # g3: (7.125 - 2^-21) / 6 -> 1.1875 - 2^-23, below the 1.125 / 1.25 tie -> 1.125 = 0 0111 001
        0x00,  # g4: 2^-10 / 6 = 1.6e-4 < 2^-10 (half the smallest subnormal) -> 0x00
        0x7E,  # g5: 3000 / 6 = 500 -> satfinite 448
        0x30,  # g6: 3 / 6 = 0.5
        0x7E,  # g7: Inf / 6 = Inf -> satfinite 448
    ]
    + [0x00] * 20  # g8..g27: zero
    + [0x00] * 4  # footer bytes 28..31: written as 0
)
NVFP4_DSV4_DATA = {
    8: 0x07,  # s = 1, fl(1/1) = 1: as nvfp4_v41 ...
    9: 0x22,
    10: 0x44,
    11: 0x66,
    12: 0xF8,  # ... but -0.25 -> -0 keeps its sign (SIGNED): 0x8; -5.01 -> 0xF
    13: 0x18,  # -0.0 -> 0x8; 0.26 -> 1
    # s = 1.875: t * 1.875 * fl(8/15) = t (1 + 0.875 * 2^-24) rounds ABOVE each tie t (the excess
    # is 1.09, 2.19, 4.38 x 2^-24 against half ulps of 1, 2, 4 x 2^-24), so ties go up:
    16: 0x37,  # dims 32, 33: 6.0000005 -> 7; 1.2500001 -> 3 (1.5), where nvfp4_v41 stores 2
    17: 0x75,  # 2.5000002 -> 5 (3.0); 5.0000005 -> 7 (6.0)
    24: 0x07,  # dim 48: 7.125 * fl(1/1.125) = 6.33 -> 7
    32: 0x00,  # dims 64, 65: s = 0 -> x * 0 = +0 -> 0
    33: 0x08,  # dim 66: -2^-11 * 0 = -0 -> 0x8 (SIGNED)
    40: 0xC7,  # dims 80, 81: 3000 * fl(1/448) = 6.70 -> 7; -2.23 -> 0xC
    48: 0x77,  # NaN * 2 -> 0x7; 3 * 2 = 6 -> 7
    56: 0xF7,  # Inf * fl(1/448) = Inf -> 7; -Inf -> 0xF
    57: 0x02,  # 448 * fl(1/448) = 1 + 0.375 * 2^-23 -> 1.0 -> 2
    # rope tail as bf16 little-endian at 224 + 2 * (dim - 448)
    224: 0x80,  # 1.0 = 0x3F80
    225: 0x3F,
    226: 0x00,  # -0.5 = 0xBF00
    227: 0xBF,
    350: 0x00,  # -0.0 = 0x8000
    351: 0x80,
}


def _nvfp4_x() -> torch.Tensor:
    return f32_row(512, NVFP4_X)


def test_nvfp4_x_is_what_the_derivations_assume():
    x = _nvfp4_x()
    assert struct.pack("<f", x[0, 48].item()) == struct.pack("<I", 0x40E3FFFF)
    fl_sixth = torch.tensor(1.0 / 6, dtype=torch.float32)
    assert struct.pack("<f", fl_sixth.item()) == struct.pack("<I", 0x3E2AAAAB)
    # the group-3 vector discriminates: amax / 6 would give the other scale byte
    assert nx.e4m3_bytes(x[0, 48:49] / 6).item() == 0x39
    assert nx.e4m3_bytes(x[0, 48:49] * fl_sixth).item() == 0x3A


def test_nvfp4_v41_golden():
    x = _nvfp4_x()
    data, scale = encode("nvfp4_v41", x)
    assert data.shape == (1, 256) and scale.shape == (1, 32)
    assert data[0].tolist() == byte_row(256, NVFP4_V41_DATA)
    assert scale[0].tolist() == NVFP4_V41_SCALE
    vals, scales = codecs.decode_tokens(get_format("nvfp4_v41"), data, scale, 512)
    assert scales[0, :8].tolist() == [2.0**-9, 1.0, 1.875, 1.25, 2.0**-9, 448.0, 0.5, 448.0]
    v = vals[0]
    assert v[16:28].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -6.0, -0.0, 0.5]
    assert v[33].item() == 1.875 and v[48].item() == 7.5 and v[65].item() == 2.0**-10
    assert v[80].item() == 2688.0 and v[112].item() == 2688.0 and v[448].item() == 6 * 0.171875
    d2, s2 = insert_and_read("nvfp4_v41", x, 512, block_size=3, slot=4, page_pad=48)
    assert d2.tolist() == byte_row(256, NVFP4_V41_DATA) and s2.tolist() == NVFP4_V41_SCALE


def test_nvfp4_v41_zero_choices():
    """Fp4Zero.POSITIVE: every value that rounds to zero is +0; Fp4Zero.EXACT: only the exact -0.0
    inputs (dims 26 and 511) become +0, -0.25 and -2^-11 (which round to zero) keep their sign."""
    x = _nvfp4_x()
    data, scale = encode_with("nvfp4_v41", x, Numerics(fp4_zero=Fp4Zero.POSITIVE))
    want = dict(NVFP4_V41_DATA)
    want[12] = 0xF0  # -0.25 -> +0
    want[13] = 0x10  # -0.0 -> +0
    want[33] = 0x00  # -2^-11 -> -0.25 units -> +0
    want[255] = 0x00  # dim 511: -0.0 -> +0
    assert data[0].tolist() == byte_row(256, want)
    assert scale[0].tolist() == NVFP4_V41_SCALE
    data, _ = encode_with("nvfp4_v41", x, "fp4_zero=exact")
    want = dict(NVFP4_V41_DATA)
    want[13] = 0x10  # dim 26 holds -0.0 -> +0; dim 27 0.26 -> 1
    want[255] = 0x00  # dim 511: -0.0 -> +0
    assert data[0].tolist() == byte_row(256, want)


def test_nvfp4_dsv4_golden():
    x = _nvfp4_x()
    data, scale = encode("nvfp4_dsv4", x)
    assert data.shape == (1, 352) and scale.shape == (1, 32)
    assert data[0].tolist() == byte_row(352, NVFP4_DSV4_DATA)
    assert scale[0].tolist() == NVFP4_DSV4_SCALE
    vals, scales = codecs.decode_tokens(get_format("nvfp4_dsv4"), data, scale, 512)
    assert scales[0, :8].tolist() == [0.0, 1.0, 1.875, 1.125, 0.0, 448.0, 0.5, 448.0]
    v = vals[0]
    assert v[33].item() == 1.5 * 1.875 and v[35].item() == 6 * 1.875
    assert (v[64:80] == 0).all()  # the tiny group is lost: its scale rounded to 0
    assert v[448:450].tolist() == [1.0, -0.5] and math.copysign(1, v[511].item()) < 0  # tail as is
    d2, s2 = insert_and_read("nvfp4_dsv4", x, 512, block_size=5, slot=7, page_pad=64)
    assert d2.tolist() == byte_row(352, NVFP4_DSV4_DATA) and s2.tolist() == NVFP4_DSV4_SCALE
    # Fp4Zero.POSITIVE: the three negative zeros become +0
    data, _ = encode_with("nvfp4_dsv4", x, Numerics(fp4_zero=Fp4Zero.POSITIVE))
    want = dict(NVFP4_DSV4_DATA)
    want[12], want[13], want[33] = 0xF0, 0x10, 0x00
    assert data[0].tolist() == byte_row(352, want)
