"""Golden vectors for every cache format, derived BY HAND (docs/formats.md).

Nothing here is computed by the code under test: every expected byte is a literal, and the comment
next to it says how it was derived. The conventions used in the derivations:

* e4m3 (float8_e4m3fn): byte = s EEEE MMM, bias 7. Normal: (1 + M/8) * 2^(E-7), E in 1..15;
  subnormal (E = 0): M/8 * 2^-6 = M * 2^-9. 0x7E = 1.75 * 2^8 = 448 is the largest finite value,
  0x7F / 0xFF are NaN. Rounding is to nearest, ties to the even mantissa (M even).
* e2m1 (fp4): code s EMM, magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Ties go to the
  even code.
* UE8M0 scale byte: value 2^(byte - 127); e = ceil(log2(max(amax, floor) / fp_max)).
* bf16: the upper 16 bits of the float32, rounded to nearest even, stored little-endian.
"""

from __future__ import annotations

import math

import torch
from attn_prologue import codecs
from attn_prologue import numerics as nx
from attn_prologue import reference as ref
from attn_prologue.formats import FORMATS, get_format

from .support.golden import (
    HAND_BYTES,
    INF,
    NAN,
    NEG_NAN,
    byte_row,
    encode,
    f32_row,
    insert_and_read,
    is_bf16_nan,
)


def test_format_table_matches_spec():
    """formats.py byte counts equal the spec table (584 / 528 / 132 / 68 / 288 / 384 / 2D / D)."""
    for name, d in (
        ("fp8_ds_mla", 512),
        ("mxfp8", 512),
        ("fp8_token", 128),
        ("mxfp4", 128),
        ("bf16", 96),
        ("fp8_tensor", 96),
        ("nvfp4_v41", 512),
        ("nvfp4_dsv4", 512),
    ):
        fmt = get_format(name)
        db, sb = HAND_BYTES[name](d)
        assert (fmt.data_bytes(d), fmt.scale_bytes(d)) == (db, sb), name
    assert get_format("fp8_ds_mla").bytes_per_token(512) == 584
    assert get_format("mxfp8").bytes_per_token(512) == 528
    assert get_format("fp8_token").bytes_per_token(128) == 132
    assert get_format("mxfp4").bytes_per_token(128) == 68
    assert get_format("nvfp4_v41").bytes_per_token(512) == 288
    assert get_format("nvfp4_dsv4").bytes_per_token(512) == 384
    assert set(FORMATS) == set(HAND_BYTES)


# =============================================================================================
# Scalar conversions (numerics.py), hand table
# =============================================================================================
E4M3_TABLE = [
    (0.0, 0x00),
    (-0.0, 0x80),  # sign of zero kept
    (1.0, 0x38),  # 2^0: E = 7 -> 0 0111 000
    (-2.0, 0xC0),  # 2^1: E = 8 -> 1 1000 000
    (0.5, 0x30),  # 2^-1: E = 6 -> 0 0110 000
    (448.0, 0x7E),  # 1.75 * 2^8: E = 15, M = 6 -> 0 1111 110
    (384.0, 0x7C),  # 1.5 * 2^8: E = 15, M = 4
    (2.0**-6, 0x08),  # smallest normal: E = 1, M = 0
    (2.0**-9, 0x01),  # smallest subnormal: M = 1 -> 1/8 * 2^-6
    (7 * 2.0**-9, 0x07),  # largest subnormal
    (2.0**-10, 0x00),  # half of the smallest subnormal: tie between 0 and 0x01 -> even 0x00
    (3 * 2.0**-10, 0x02),  # 1.5 * 2^-9: tie between 0x01 and 0x02 -> even 0x02
    (2.0**-10 + 2.0**-20, 0x01),  # just above the tie -> up
    (7.5 * 2.0**-9, 0x08),  # tie between largest subnormal 0x07 and smallest normal 0x08 -> 0x08
    (2.0**-11, 0x00),  # below half of 2^-9
    (-(2.0**-11), 0x80),  # rounds to -0
    (1.0625, 0x38),  # 1 + 1/16: tie 1.0 (M=0) / 1.125 (M=1) -> even M=0
    (1.1875, 0x3A),  # 1.125 + 1/16: tie M=1 / M=2 -> M=2
    (432.0, 0x7E),  # tie between 416 (0x7D, M=5) and 448 (M=6) -> 448
    (431.0, 0x7D),  # below the tie -> 416 = 1.625 * 2^8
    (460.0, 0x7E),  # above 448: satfinite -> 448
    (1e30, 0x7E),  # saturates to 448
    (-1e30, 0xFE),  # saturates to -448
    (INF, 0x7E),  # +Inf saturates (cvt.rn.satfinite)
    (-INF, 0xFE),
    (NAN, 0x7F),  # NaN -> canonical 0x7F
    (NEG_NAN, 0x7F),  # negative NaN -> also 0x7F (not 0xFF)
]


def test_e4m3_scalar_table():
    x = torch.tensor([v for v, _ in E4M3_TABLE], dtype=torch.float32)
    got = nx.e4m3_bytes(x).tolist()
    assert got == [b for _, b in E4M3_TABLE]


E2M1_TABLE = [
    (0.0, 0x0),
    (-0.0, 0x8),
    (0.25, 0x0),  # tie 0 (code 0) / 0.5 (code 1) -> even code 0
    (0.26, 0x1),
    (0.74, 0x1),
    (0.75, 0x2),  # tie 0.5 (1) / 1.0 (2) -> 2
    (1.25, 0x2),  # tie 1.0 (2) / 1.5 (3) -> 2
    (1.75, 0x4),  # tie 1.5 (3) / 2.0 (4) -> 4
    (2.5, 0x4),  # tie 2 (4) / 3 (5) -> 4
    (3.5, 0x6),  # tie 3 (5) / 4 (6) -> 6
    (5.0, 0x6),  # tie 4 (6) / 6 (7) -> 6
    (5.01, 0x7),
    (6.0, 0x7),
    (7.0, 0x7),
    (1e30, 0x7),
    (INF, 0x7),  # saturate to 6
    (-7.0, 0xF),
    (-INF, 0xF),  # saturate to -6 (sign bit 0x8)
    (-0.75, 0xA),
    (-0.1, 0x8),  # -0.1 -> -0: sign kept
    (NAN, 0x7),
    (NEG_NAN, 0x7),  # e2m1 has no NaN: stored as +6
]


def test_e2m1_scalar_table():
    x = torch.tensor([v for v, _ in E2M1_TABLE], dtype=torch.float32)
    assert nx.e2m1_codes(x).tolist() == [c for _, c in E2M1_TABLE]
    # decode: magnitudes by code
    codes = torch.arange(16, dtype=torch.uint8)
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert nx.e2m1_values(codes).tolist() == want


def test_ue8m0_decode_table():
    b = torch.tensor([0, 1, 105, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = nx.ue8m0_values(b)
    assert v[:7].tolist() == [2.0**-127, 2.0**-126, 2.0**-22, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(v[7])  # 255 is the UE8M0 NaN code


# =============================================================================================
# fp8_ds_mla: 448 e4m3 (7 blocks of 64) + 64 bf16 rope | 7 UE8M0 + 1 pad
# =============================================================================================
DS_A = {
    # block 0 (dims 0..63): all zero. amax = 0 -> floor 1e-4 (f32 1.00000005e-4) -> /448 =
    # 2.2321e-7 -> log2 = -22.095 -> e = -22 -> byte 127 - 22 = 105. Data all 0x00.
    # block 1 (dims 64..127): amax = 448 exactly -> 448/448 = 1 -> e = 0 -> byte 127, x * 2^0.
    64: (448.0, 0x7E),  # 1.75 * 2^8
    65: (-448.0, 0xFE),
    66: (1.0, 0x38),
    67: (-2.0, 0xC0),
    68: (0.5, 0x30),
    69: (2.0**-9, 0x01),  # smallest e4m3 subnormal
    70: (2.0**-10, 0x00),  # tie to even -> 0
    71: (3 * 2.0**-10, 0x02),  # 1.5 subnormal units: tie -> even 2 units
    72: (2.0**-10 + 2.0**-20, 0x01),  # above the tie -> 1 unit
    73: (-(2.0**-9), 0x81),
    74: (7 * 2.0**-9, 0x07),  # largest subnormal
    75: (2.0**-6, 0x08),  # smallest normal
    76: (1.0625, 0x38),  # mantissa tie -> even (1.0)
    77: (1.1875, 0x3A),  # mantissa tie -> even (1.25)
    78: (432.0, 0x7E),  # tie 416/448 -> 448 (M=6 even)
    79: (431.0, 0x7D),  # 416
    80: (15 * 2.0**-11, 0x04),  # 3.75 subnormal units -> 4 units
    81: (7.5 * 2.0**-9, 0x08),  # tie between 0x07 and 0x08 -> 0x08 (M: 7 odd, 0 even)
    82: (2.0**-11, 0x00),
    83: (-(2.0**-11), 0x80),  # -0
    # block 2 (dims 128..191): amax 896 = 2 * 448 -> r = 2 -> e = 1 -> byte 128; values * 2^-1.
    128: (896.0, 0x7E),  # -> 448
    129: (3.0, 0x3C),  # -> 1.5 = 1.5 * 2^0: E = 7, M = 4 -> 0 0111 100
    130: (-1.0, 0xB0),  # -> -0.5
    131: (2.0**-9, 0x00),  # -> 2^-10: the scale turns a representable value into a tie -> 0
    # block 3 (dims 192..255): amax 3.0 -> 3/448 = 0.0066964 -> log2 = -7.2224 -> e = -7 ->
    # byte 120; values * 2^7.
    192: (3.0, 0x7C),  # 384 = 1.5 * 2^8: E = 15, M = 4 -> 0 1111 100
    193: (-3.0, 0xFC),
    194: (1.0, 0x70),  # 128 = 2^7: E = 14 -> 0 1110 000
    195: (0.01, 0x3A),  # 0.01f * 128 = 1.28 -> between 1.25 (M=2) and 1.375: 1.25 -> 0 0111 010
    196: (2.0**-16, 0x01),  # 2^-9 -> smallest subnormal
    # block 4 (dims 256..319): amax 449 -> 449/448 = 1.0022 -> e = 1 -> byte 128; values / 2.
    256: (449.0, 0x76),  # 224.5 -> grid step 16 in [128, 256): 224 = 1.75 * 2^7 -> 0 1110 110
    257: (448.0, 0x76),  # 224
    # block 5 (dims 320..383): amax 56 = 448 * 2^-3 -> r = 2^-3 exactly -> e = -3 -> byte 124.
    320: (56.0, 0x7E),  # 56 * 8 = 448
    321: (-7.0, 0xE6),  # -56 = -1.75 * 2^5: E = 12, M = 6 -> 1 1100 110
    # block 6 (dims 384..447): amax 1e-4 (the floor itself; 1e-5 is below it) -> e = -22 ->
    # byte 105; values * 2^22.
    384: (1e-5, 0x62),  # 9.99999975e-6 * 2^22 = 41.943 -> step 4 in [32, 64): 40 = 1.25 * 2^5
    #                     (41.94 - 40 = 1.94 < 44 - 41.94 = 2.06) -> 0 1100 010
    385: (1e-4, 0x7D),  # 1.00000005e-4 * 2^22 = 419.43 -> step 32: 416 = 1.625 * 2^8 -> 0x7D
}
DS_A_SCALE = [105, 127, 128, 120, 128, 124, 105, 0]  # 7 UE8M0 bytes + pad byte 0
# Rope tail (dims 448..511) stored as bf16, little-endian, at data bytes 448 + 2 * (dim - 448).
DS_A_TAIL = {
    448: (1.0, (0x80, 0x3F)),  # bf16 0x3F80
    449: (-2.0, (0x00, 0xC0)),  # 0xC000
    450: (3.140625, (0x49, 0x40)),  # 1.5703125 * 2: exp 128 -> 0x40xx, mantissa 73 = 0x49
    451: (1 + 3 * 2.0**-8, (0x82, 0x3F)),  # tie between 0x3F81 (odd) and 0x3F82 -> 0x3F82
    452: (1 + 2.0**-8, (0x80, 0x3F)),  # tie between 0x3F80 and 0x3F81 -> 0x3F80
    453: (2.0**-133, (0x01, 0x00)),  # bf16 subnormal: 2^-126 * 1/128 -> 0x0001
    511: (-0.0, (0x00, 0x80)),
}


def _ds_a():
    x = f32_row(512, {i: v for i, (v, _) in DS_A.items()})
    for i, (v, _) in DS_A_TAIL.items():
        x[0, i] = v
    data = byte_row(576, {i: b for i, (_, b) in DS_A.items()})
    for i, (_, (lo, hi)) in DS_A_TAIL.items():
        data[448 + 2 * (i - 448)] = lo
        data[448 + 2 * (i - 448) + 1] = hi
    return x, data, DS_A_SCALE


def test_fp8_ds_mla_golden():
    x, want_data, want_scale = _ds_a()
    data, scale = encode("fp8_ds_mla", x)
    assert data.shape == (1, 576) and scale.shape == (1, 8)
    assert data[0].tolist() == want_data
    assert scale[0].tolist() == want_scale

    # Decode: e4m3 value * 2^(byte - 127); the tail is the bf16 value.
    vals, scales = codecs.decode_tokens(get_format("fp8_ds_mla"), data, scale, 512)
    assert scales[0].tolist() == [2.0**-22, 1.0, 2.0, 2.0**-7, 2.0, 2.0**-3, 2.0**-22]
    v = vals[0]
    assert v[64].item() == 448.0 and v[70].item() == 0.0 and v[71].item() == 2.0**-8
    assert v[128].item() == 896.0 and v[131].item() == 0.0
    assert v[195].item() == 1.25 / 128  # 0x3A = 1.25, * 2^-7
    assert v[256].item() == 448.0  # 224 * 2
    assert v[384].item() == 40 * 2.0**-22
    assert v[448].item() == 1.0 and v[451].item() == 1 + 2.0**-6 and v[453].item() == 2.0**-133

    # The same token through insert_kv lands at token o's data / scale offsets, pad byte 0.
    d2, s2 = insert_and_read("fp8_ds_mla", x, 512, block_size=3, slot=5, page_pad=40)
    assert d2.tolist() == want_data and s2.tolist() == want_scale


def test_fp8_ds_mla_nan_inf():
    """NaN/Inf as implemented (numerics.py): amax ignores NaN; NaN -> 0x7F. A block holding Inf:
    ceil_log2_exponent saturates at 127 like cvt.rp.satfinite.ue8m0x2.f32 (Inf -> 127, not 128),
    so the scale byte is 127 + 127 = 254 (the largest finite UE8M0, not the NaN code 255), and the
    elements are scaled by 2^-126 (e clamped to 126 for the multiplier only): Inf saturates to
    448, finite values flush to +-0. Decoded: 448 * 2^127 overflows to +-Inf, the rest is 0."""
    x = f32_row(
        512,
        {
            # block 0: NaN ignored by amax -> amax 3 -> e = -7 -> byte 120.
            0: NAN,
            1: 3.0,
            2: -1.0,
            # block 1: +Inf -> e = 127 (saturated) -> byte 254.
            64: INF,
            65: 1.0,
            66: -INF,
            67: NAN,
            68: 1e30,
            69: -5.0,
            # tail
            448: NAN,
            449: INF,
            450: -INF,
        },
    )
    x[0, 128:192] = NAN  # block 2 all NaN -> amax 0 -> floor -> byte 105; all bytes 0x7F
    data, scale = encode("fp8_ds_mla", x)
    want = byte_row(
        576,
        {
            0: 0x7F,  # NaN
            1: 0x7C,  # 3 * 128 = 384
            2: 0xF0,  # -1 * 128 = -128 = -2^7: 1 1110 000
            64: 0x7E,  # Inf * 2^-126 = Inf -> saturate 448
            65: 0x00,  # 2^-126 -> 0
            66: 0xFE,  # -Inf -> -448
            67: 0x7F,  # NaN
            68: 0x00,  # 1e30 * 2^-126 = 1.2e-8 -> 0
            69: 0x80,  # -5 * 2^-126 -> -0
            # 448, 449: bf16 NaN, checked below (the NaN payload is not pinned, see is_bf16_nan)
            450: 0x80,
            451: 0x7F,  # bf16 +Inf 0x7F80
            452: 0x80,
            453: 0xFF,  # bf16 -Inf 0xFF80
        },
    )
    for i in range(128, 192):
        want[i] = 0x7F
    got = data[0].tolist()
    assert is_bf16_nan(got[448], got[449])
    want[448], want[449] = got[448], got[449]
    assert got == want
    assert scale[0].tolist() == [120, 254, 105, 105, 105, 105, 105, 0]
    vals, _ = codecs.decode_tokens(get_format("fp8_ds_mla"), data, scale, 512)
    b1 = vals[0, 64:70].tolist()
    assert b1[0] == INF and b1[1] == 0.0 and b1[2] == -INF and b1[4] == 0.0 and b1[5] == 0.0
    assert math.isnan(b1[3])
    assert (vals[0, 70:128] == 0).all()
    assert vals[0, 1].item() == 3.0 and torch.isnan(vals[0, 0])
    assert torch.isnan(vals[0, 448]) and vals[0, 449].item() == INF and vals[0, 450].item() == -INF


def test_fp8_ds_mla_kv_rope_insert_end_to_end():
    """kv_rope_insert with hand-checkable rotations: position 0 has cos = 1, sin = 0 (identity);
    position 1 has cos = 0, sin = 1 (even' = -odd, odd' = even), exact in both orders."""
    d, r, bs = 512, 64, 2
    cs = torch.zeros(2, r, dtype=torch.float32)
    cs[0, : r // 2] = 1.0  # pos 0: cos 1, sin 0
    cs[1, r // 2 :] = 1.0  # pos 1: cos 0, sin 1
    kv = torch.zeros(3, d, dtype=torch.bfloat16)
    kv[0, 0] = 3.0  # block 0 amax 3 -> byte 120, 384 -> 0x7C
    kv[0, 448], kv[0, 449] = 1.0, 2.0  # pos 0: unchanged -> 0x3F80, 0x4000
    kv[1, 64] = 448.0  # block 1 -> byte 127, 0x7E
    kv[1, 448], kv[1, 449] = 1.0, 2.0  # pos 1: -> (-2, 1) -> 0xC000, 0x3F80
    kv[1, 450], kv[1, 451] = 0.5, -0.25  # -> (0.25, 0.5) -> 0x3E80, 0x3F00
    kv[2, :] = 7.0  # skipped row (slot -1)
    positions = torch.tensor([0, 1, 1])
    slots = torch.tensor([3, 0, -1])  # row 0 -> block 1 o 1; row 1 -> block 0 o 0
    page = bs * 584 + 32
    for order in ("kernel", "eager"):
        cache = torch.full((2, page), 0xA5, dtype=torch.uint8)
        ref.kv_rope_insert(kv, cache, slots, positions, cs, bs, "fp8_ds_mla", order=order)
        # row 0 at block 1: data [576, 1152), scale [2*576 + 8, 2*576 + 16) = [1160, 1168)
        want0 = byte_row(576, {0: 0x7C, 448: 0x80, 449: 0x3F, 450: 0x00, 451: 0x40})
        assert cache[1, 576:1152].tolist() == want0
        assert cache[1, 1160:1168].tolist() == [120, 105, 105, 105, 105, 105, 105, 0]
        # row 1 at block 0: data [0, 576), scale [1152, 1160)
        want1 = byte_row(
            576,
            {
                64: 0x7E,
                448: 0x00,
                449: 0xC0,
                450: 0x80,
                451: 0x3F,
                452: 0x80,
                453: 0x3E,
                454: 0x00,
                455: 0x3F,
            },
        )
        assert cache[0, 0:576].tolist() == want1
        assert cache[0, 1152:1160].tolist() == [105, 127, 105, 105, 105, 105, 105, 0]
        # untouched: block 0 token 1 records, block 1 token 0 records, the page padding
        assert (cache[0, 576:1152] == 0xA5).all() and (cache[0, 1160:] == 0xA5).all()
        assert (cache[1, 0:576] == 0xA5).all() and (cache[1, 1152:1160] == 0xA5).all()
        assert (cache[1, 1168:] == 0xA5).all()


# =============================================================================================
# mxfp8: 512 e4m3 (16 blocks of 32, rope dims quantized too) | 16 UE8M0, no pad
# =============================================================================================
def test_mxfp8_golden():
    x = f32_row(
        512,
        {
            # block 0 (0..31): zero -> byte 105
            32: 448.0,
            33: 2.0**-9,  # block 1: amax 448 -> e = 0 -> 127; 0x7E, 0x01
            64: 896.0,
            65: 3.0,  # block 2: amax 896 -> e = 1 -> 128; 448 -> 0x7E, 1.5 -> 0x3C
            96: 3.0,
            97: 1.0,  # block 3: amax 3 -> e = -7 -> 120; 384 -> 0x7C, 128 -> 0x70
            384: NAN,
            385: 448.0,  # block 12: NaN ignored -> amax 448 -> 127; 0x7F, 0x7E
            416: INF,
            417: 2.0,  # block 13: Inf -> e = 127 (saturated) -> 254; 0x7E, 2*2^-126 -> 0
            # block 15 (480..511) holds rope dims, quantized like the rest:
            480: 1.0,
            481: -0.5,  # amax 1 -> 1/448 = 0.002232 -> log2 = -8.807 -> e = -8 -> 119;
            # 1 * 256 = 2^8 -> 0 1111 000 = 0x78; -0.5 * 256 = -128 -> 1 1110 000 = 0xF0
        },
    )
    data, scale = encode("mxfp8", x)
    want = byte_row(
        512,
        {
            32: 0x7E,
            33: 0x01,
            64: 0x7E,
            65: 0x3C,
            96: 0x7C,
            97: 0x70,
            384: 0x7F,
            385: 0x7E,
            416: 0x7E,
            417: 0x00,
            480: 0x78,
            481: 0xF0,
        },
    )
    assert data.shape == (1, 512) and data[0].tolist() == want
    want_scale = [105, 127, 128, 120] + [105] * 8 + [127, 254, 105, 119]
    assert scale[0].tolist() == want_scale
    vals, _ = codecs.decode_tokens(get_format("mxfp8"), data, scale, 512)
    assert vals[0, 480].item() == 1.0 and vals[0, 481].item() == -0.5 and vals[0, 65].item() == 3.0
    assert vals[0, 416].item() == INF and (vals[0, 417:448] == 0).all()  # 448 * 2^127 -> Inf
    d2, s2 = insert_and_read("mxfp8", x, 512, block_size=4, slot=6, page_pad=16)
    assert d2.tolist() == want and s2.tolist() == want_scale
