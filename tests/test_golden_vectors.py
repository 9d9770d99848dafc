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
import struct

import pytest
import torch
from attn_prologue import codecs
from attn_prologue import numerics as nx
from attn_prologue import reference as ref
from attn_prologue.formats import FORMATS, Fp4Zero, Numerics, RotatedRow, ScaleFloor, get_format

NAN = float("nan")
INF = float("inf")
NEG_NAN = struct.unpack("<f", struct.pack("<I", 0xFFC00000))[0]  # NaN with the sign bit set


def f32_row(d: int, entries: dict[int, float]) -> torch.Tensor:
    """A [1, d] float32 row of zeros with the given entries set."""
    x = torch.zeros(1, d, dtype=torch.float32)
    for i, v in entries.items():
        x[0, i] = v
    return x


def is_bf16_nan(lo: int, hi: int) -> bool:
    """bf16 bits (little-endian bytes) are a NaN: exponent all ones, mantissa nonzero.

    The NaN payload of a float32 -> bf16 conversion is NOT pinned by the reference: torch's CPU
    vectorized conversion gives 0xFFFF, its scalar path 0x7FC0, CUDA / cvt.rn.bf16.f32 0x7FFF.
    docs/formats.md does not say which; these tests only require a NaN."""
    v = lo | (hi << 8)
    return (v & 0x7F80) == 0x7F80 and (v & 0x7F) != 0


def byte_row(n: int, entries: dict[int, int], fill: int = 0) -> list[int]:
    out = [fill] * n
    for i, v in entries.items():
        out[i] = v
    return out


def encode(name: str, x: torch.Tensor, kv_scale=None):
    data, scale = codecs.encode_tokens(get_format(name), x, kv_scale)
    assert data.dtype == torch.uint8 and scale.dtype == torch.uint8
    return data, scale


def insert_and_read(
    name: str, x: torch.Tensor, d: int, block_size: int, slot: int, page_pad: int, kv_scale=None
):
    """insert_kv one token into a poisoned cache; return (page bytes of its block, data, scale)
    read back at the offsets of docs/formats.md (computed here from the hand table below)."""
    db, sb = HAND_BYTES[name](d)
    page = block_size * (db + sb) + page_pad
    nblocks = slot // block_size + 2
    cache = torch.full((nblocks, page), 0xA5, dtype=torch.uint8)
    ref.insert_kv(cache, get_format(name), x, torch.tensor([slot]), block_size, kv_scale)
    blk, o = divmod(slot, block_size)
    data = cache[blk, o * db : (o + 1) * db]
    scale = cache[blk, block_size * db + o * sb : block_size * db + (o + 1) * sb]
    # Every other byte of the cache still holds the poison.
    touched = torch.zeros_like(cache, dtype=torch.bool)
    touched[blk, o * db : (o + 1) * db] = True
    touched[blk, block_size * db + o * sb : block_size * db + (o + 1) * sb] = True
    assert (cache[~touched] == 0xA5).all()
    return data, scale


# Bytes per token record from the table in docs/formats.md (not from formats.py):
# (data record bytes, scale record bytes) as a function of D.
HAND_BYTES = {
    "fp8_ds_mla": lambda d: (448 + 2 * 64, 7 + 1),  # 448 e4m3 + 64 bf16 | 7 UE8M0 + 1 pad
    "mxfp8": lambda d: (512, 16),  # 512 e4m3 | 16 UE8M0 (one per 32)
    "fp8_token": lambda d: (128, 4),  # 128 e4m3 | one float32
    "mxfp4": lambda d: (64, 4),  # 128 e2m1 packed two per byte | 4 UE8M0 (one per 32)
    "bf16": lambda d: (2 * d, 0),
    "fp8_tensor": lambda d: (d, 0),
    "nvfp4_v41": lambda d: (256, 32),  # 512 e2m1 packed two per byte | 32 E4M3 (one per 16)
    "nvfp4_dsv4": lambda d: (224 + 2 * 64, 28 + 4),  # 448 e2m1 + 64 bf16 | 28 E4M3 + 4 zero bytes
}


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


# =============================================================================================
# fp8_token: 128 e4m3 (one block) | one float32 2^e, e = ceil(log2(max(amax, 1e-4) * fl(1/448)))
# =============================================================================================
# fl(1/448): 1/448 = 2^-9 * 8/7 = 2^-9 * 1.001001001...b; bit 24 after the point is 1 with a
# nonzero rest, so it rounds UP: 0x3B124925 = (1/448) * (1 + 0.375 * 2^-23). Hence
# 448 * fl(1/448) = 1 + 0.375 * 2^-23 exactly, which rounds to 1.0 (below half an ulp): e = 0.
def test_fp8_token_reciprocal_constant():
    fl = struct.unpack("<f", struct.pack("<I", 0x3B124925))[0]
    assert torch.tensor(1.0 / 448, dtype=torch.float32).item() == fl


FP8_TOKEN_CASES = [
    # (entries, expected data entries, expected float32 scale bits)
    # amax 3: 3 * fl(1/448) = 0.0066964 -> e = -7 -> 2^-7 = 120 << 23 = 0x3C000000
    ({0: 3.0, 1: -1.0, 127: 2.0**-16}, {0: 0x7C, 1: 0xF0, 127: 0x01}, 0x3C000000),
    # zeros: 1e-4 * fl(1/448) = 2.2321e-7 -> e = -22 -> 105 << 23 = 0x34800000
    ({}, {}, 0x34800000),
    # amax 448: 1 + 0.375 * 2^-23 -> 1.0 -> e = 0 -> 0x3F800000; 448 -> 0x7E
    ({0: 448.0, 1: 2.0**-9}, {0: 0x7E, 1: 0x01}, 0x3F800000),
    # amax 896: 2 * (1 + 0.375 * 2^-23) -> 2.0 -> e = 1 -> 0x40000000; 896 / 2 = 448 -> 0x7E
    ({5: 896.0, 6: 3.0}, {5: 0x7E, 6: 0x3C}, 0x40000000),
    # amax 449 -> 1.0022 -> e = 1 -> 2.0; 224.5 -> 224 -> 0x76
    ({0: 449.0}, {0: 0x76}, 0x40000000),
    # Inf: Inf * fl(1/448) = Inf -> e = 127 (ceil_log2_exponent saturates at 127) -> 2^127 =
    # 254 << 23 = 0x7F000000 (largest finite power of two); Inf -> 448 (0x7E), NaN -> 0x7F,
    # 1.0 * 2^-126 -> 0
    ({5: INF, 6: NAN, 7: 1.0}, {5: 0x7E, 6: 0x7F, 7: 0x00}, 0x7F000000),
]


@pytest.mark.parametrize("case", range(len(FP8_TOKEN_CASES)))
def test_fp8_token_golden(case):
    entries, want_entries, bits = FP8_TOKEN_CASES[case]
    x = f32_row(128, entries)
    data, scale = encode("fp8_token", x)
    want = byte_row(128, want_entries)
    want_scale = list(struct.pack("<I", bits))  # float32 little-endian
    assert data[0].tolist() == want
    assert scale[0].tolist() == want_scale
    d2, s2 = insert_and_read("fp8_token", x, 128, block_size=5, slot=9, page_pad=12)
    assert d2.tolist() == want and s2.tolist() == want_scale
    vals, scales = codecs.decode_tokens(get_format("fp8_token"), data, scale, 128)
    assert scales[0, 0].item() == struct.unpack("<f", struct.pack("<I", bits))[0]
    if case == 0:
        assert vals[0, :2].tolist() == [3.0, -1.0] and vals[0, 127].item() == 2.0**-16


# =============================================================================================
# mxfp4: 64 bytes packed e2m1 (element 2j low nibble) | 4 UE8M0; e = clamp(ceil(log2(amax/6)))
# =============================================================================================
def test_mxfp4_golden():
    x = f32_row(
        128,
        {
            # block 0: amax 6 -> 6/6 = 1 -> e = 0 -> byte 127
            0: 0.25,
            1: 0.75,  # codes 0, 2 -> byte 0 = 0x20 (element 0 in the low nibble)
            2: 1.25,
            3: 1.75,  # 2, 4 -> 0x42
            4: 2.5,
            5: 3.5,  # 4, 6 -> 0x64
            6: 5.0,
            7: 6.0,  # 6, 7 -> 0x76
            8: -0.25,
            9: -0.75,  # 0x8 (-0), 0xA -> 0xA8
            10: -5.0,
            11: -6.0,  # 0xE, 0xF -> 0xFE
            12: 0.26,
            13: 0.74,  # 1, 1 -> 0x11
            14: 1.0,
            15: 0.5,  # 2, 1 -> 0x12
            16: 3.0,
            17: 4.0,  # 5, 6 -> 0x65
            18: 1.5,
            19: 2.0,  # 3, 4 -> 0x43
            # block 1: amax 12 -> 2 -> e = 1 -> byte 128; values / 2
            32: 12.0,
            33: 1.0,  # 6 -> 7, 0.5 -> 1 -> byte 16 = 0x17
            34: 7.0,
            35: -3.0,  # 3.5 -> tie -> 6; -1.5 -> 0xB -> byte 17 = 0xB6
            # block 2 (64..95): zero -> amax floor 6 * 2^-126 -> r = 2^-126 -> e = -126 -> byte 1
            # block 3: amax 1 -> 1/6 = 0.1667 -> log2 = -2.585 -> e = -2 -> byte 125; values * 4
            96: 1.0,
            97: 0.3,  # 4 -> 6; 1.2 -> 2 (1.0) -> byte 48 = 0x26
            98: -0.125,
            99: 0.0625,  # -0.5 -> 0x9; 0.25 -> tie -> 0 -> byte 49 = 0x09
        },
    )
    data, scale = encode("mxfp4", x)
    want = byte_row(
        64,
        {
            0: 0x20,
            1: 0x42,
            2: 0x64,
            3: 0x76,
            4: 0xA8,
            5: 0xFE,
            6: 0x11,
            7: 0x12,
            8: 0x65,
            9: 0x43,
            16: 0x17,
            17: 0xB6,
            48: 0x26,
            49: 0x09,
        },
    )
    assert data.shape == (1, 64) and data[0].tolist() == want
    assert scale[0].tolist() == [127, 128, 1, 125]
    vals, _ = codecs.decode_tokens(get_format("mxfp4"), data, scale, 128)
    assert vals[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert vals[0, 32:36].tolist() == [12.0, 1.0, 8.0, -3.0]
    assert vals[0, 96:100].tolist() == [1.0, 0.25, -0.125, 0.0]
    d2, s2 = insert_and_read("mxfp4", x, 128, block_size=4, slot=3, page_pad=8)
    assert d2.tolist() == want and s2.tolist() == [127, 128, 1, 125]


def test_mxfp4_nan_inf():
    """Inf: e = 127 (saturated, and the mxfp4 clamp) -> byte 254; multiplier 2^-126; Inf -> +6 (0x7), -Inf -> 0xF;
    NaN (either sign) -> 0x7 (+6); amax ignores NaN."""
    x = f32_row(
        128,
        {
            0: INF,
            1: -INF,  # 0x7, 0xF -> byte 0 = 0xF7
            2: NAN,
            3: -1.0,  # 0x7, -2^-126 -> -0 = 0x8 -> byte 1 = 0x87
            4: 1e30,
            5: 0.0,  # 1e30 * 2^-126 -> 0; 0 -> byte 2 = 0x00
            6: NEG_NAN,
            7: -0.0,  # 0x7, 0x8 -> byte 3 = 0x87
            # block 1: NaN ignored, amax 1.5 -> 0.25 -> e = -2 -> byte 125; NaN -> 7, 6 -> 7: 0x77
            32: NAN,
            33: 1.5,
        },
    )
    data, scale = encode("mxfp4", x)
    assert data[0].tolist() == byte_row(64, {0: 0xF7, 1: 0x87, 2: 0x00, 3: 0x87, 16: 0x77})
    assert scale[0].tolist() == [254, 125, 1, 1]
    vals, _ = codecs.decode_tokens(get_format("mxfp4"), data, scale, 128)
    # 6 * 2^127 = 1.5 * 2^129 is beyond float32: the decoded values overflow to +-Inf.
    assert vals[0, 0].item() == INF and vals[0, 1].item() == -INF
    assert vals[0, 33].item() == 1.5 and vals[0, 32].item() == 1.5  # NaN came back as +6 * 2^-2


# =============================================================================================
# bf16 and fp8_tensor full-cache rows
# =============================================================================================
def test_bf16_golden():
    x = torch.tensor([[1.0, -2.0, 3.140625, 1 + 2.0**-8, 1 + 3 * 2.0**-8, NAN, -INF, -0.0]])
    data, scale = encode("bf16", x)
    assert scale.shape == (1, 0)
    got = data[0].tolist()
    assert is_bf16_nan(got[10], got[11])
    got[10] = got[11] = None
    assert got == [
        0x80,
        0x3F,  # 1.0 = 0x3F80
        0x00,
        0xC0,  # -2.0 = 0xC000
        0x49,
        0x40,  # 3.140625 = 0x4049
        0x80,
        0x3F,  # 1 + 2^-8: tie -> even 0x3F80
        0x82,
        0x3F,  # 1 + 3 * 2^-8: tie -> even 0x3F82
        None,
        None,  # NaN: any bf16 NaN (payload not pinned, see is_bf16_nan)
        0x80,
        0xFF,  # -Inf = 0xFF80
        0x00,
        0x80,  # -0 = 0x8000
    ]
    vals, _ = codecs.decode_tokens(get_format("bf16"), data, scale, 8)
    assert vals[0, :5].tolist() == [1.0, -2.0, 3.140625, 1.0, 1 + 2.0**-6]
    assert torch.isnan(vals[0, 5]) and vals[0, 6].item() == -INF
    d2, s2 = insert_and_read("bf16", x, 8, block_size=3, slot=4, page_pad=6)
    assert d2.tolist() == data[0].tolist() and s2.numel() == 0


def test_fp8_tensor_golden():
    half = torch.tensor(0.5)
    x = torch.tensor([[1.0, 300.0, -1000.0, NAN, INF, 2.0**-10, 0.1, -0.0]])
    data, scale = encode("fp8_tensor", x, half)
    assert scale.shape == (1, 0)
    assert data[0].tolist() == [
        0x40,  # 1 / 0.5 = 2 -> 0 1000 000
        0x7E,  # 600 -> saturates to 448
        0xFE,  # -2000 -> -448
        0x7F,  # NaN
        0x7E,  # Inf -> 448
        0x01,  # 2^-9: smallest subnormal
        0x25,  # 0.1f / 0.5 = 0.2f = 1.6 * 2^-3 -> 1.625 (M=5), E = 4 -> 0 0100 101
        0x80,  # -0
    ]
    vals, _ = codecs.decode_tokens(get_format("fp8_tensor"), data, scale, 8, half)
    assert vals[0, :3].tolist() == [1.0, 224.0, -224.0] and vals[0, 5].item() == 2.0**-10

    three = torch.tensor(3.0)
    x = torch.tensor([[1.0, 1344.0, 1400.0, -3.0]])
    data, _ = encode("fp8_tensor", x, three)
    # 1/3 = 0.33333334 = 1.333 * 2^-2 -> 1.375 (M=3), E = 5 -> 0x2B; 1344/3 = 448 -> 0x7E;
    # 1400/3 = 466.7 -> saturate 0x7E; -1 -> 0xB8
    assert data[0].tolist() == [0x2B, 0x7E, 0x7E, 0xB8]
    d2, _ = insert_and_read("fp8_tensor", x, 4, block_size=2, slot=1, page_pad=4, kv_scale=three)
    assert d2.tolist() == [0x2B, 0x7E, 0x7E, 0xB8]
    with pytest.raises(ValueError):
        encode("fp8_tensor", x)  # the scale tensor is required


# =============================================================================================
# Record placement with page padding, all formats
# =============================================================================================
FMT_D = {
    "fp8_ds_mla": 512,
    "mxfp8": 512,
    "fp8_token": 128,
    "mxfp4": 128,
    "bf16": 64,
    "fp8_tensor": 64,
    "nvfp4_v41": 512,
    "nvfp4_dsv4": 512,
}


@pytest.mark.parametrize("name", sorted(FMT_D))
@pytest.mark.parametrize("strided_view", [False, True])
def test_record_placement(name, strided_view):
    """Token o of a block: data record at o * data_bytes, scale record at
    block_size * data_bytes + o * scale_bytes; page padding and other tokens untouched."""
    d = FMT_D[name]
    db, sb = HAND_BYTES[name](d)
    bs, nblocks, pad = 4, 3, 24
    used = bs * (db + sb)
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, 256, (nblocks, used + pad), generator=g, dtype=torch.uint8)
    # k_cache's stride(0) = used + pad > block_size * bytes_per_token either way
    cache = base[:, :used] if strided_view else base
    assert cache.stride(0) == used + pad
    before = base.clone()
    x = torch.randn(5, d, generator=g).to(torch.bfloat16).to(torch.float32)
    kv_scale = torch.tensor(0.25) if name == "fp8_tensor" else None
    fmt = get_format(name)
    slots = torch.tensor([4 * 2 + 3, 1, -1, 4 * 1 + 0, -7])  # (blk 2, o 3), (0, 1), skip, (1, 0)
    ref.insert_kv(cache, fmt, x, slots, bs, kv_scale)
    data, scale = codecs.encode_tokens(fmt, x, kv_scale)
    expect = before.clone()
    for row, (blk, o) in ((0, (2, 3)), (1, (0, 1)), (3, (1, 0))):
        expect[blk, o * db : (o + 1) * db] = data[row]
        expect[blk, bs * db + o * sb : bs * db + (o + 1) * sb] = scale[row]
    assert torch.equal(base, expect)
    # and the bytes were really changed where written (random data vs random poison)
    assert not torch.equal(base, before)


def test_decode_overflow_near_float32_max():
    """Not an encoding error but a float32 limit of the readers: the largest bf16 value
    (2 - 2^-7) * 2^127 = 3.3895e38 has amax / 448 = 2^119.19 -> e = 120 -> byte 247, and
    x * 2^-120 = 255 rounds to 256 = 2^8 (step 16 in [128, 256): 255 is nearer 256) -> 0x78.
    float(e4m3) * 2^(byte - 127) = 2^8 * 2^120 = 2^128 overflows float32 to +Inf on decode."""
    x = f32_row(512, {0: 3.3895313892515355e38})  # bf16 0x7F7F
    data, scale = encode("fp8_ds_mla", x)
    assert data[0, 0].item() == 0x78 and scale[0, 0].item() == 247
    vals, _ = codecs.decode_tokens(get_format("fp8_ds_mla"), data, scale, 512)
    assert vals[0, 0].item() == INF


def test_kv_values_are_rounded_before_quantization():
    """docs/op.md KV step 3: the rotated values are rounded through the I/O dtype (bf16) and the
    quantizer sees the rounded values. mxfp8 quantizes the rope dims, so a double rounding is
    visible: pair 0 of the rope (dims 448, 449) = (1.0, 0) with cos = c = 1.0625 + 2^-20 and
    sin = 0 gives even' = 1.0 * c - 0 * 0 = c exactly (both orders).
      rounded:   bf16(c) = 1.0625 (1 + 2^-4; 2^-20 is far below half a bf16 ulp);
                 block 14 (dims 448..479) amax 1.0625 -> 1.0625/448 = 0.00237 -> log2 = -8.72
                 -> e = -8 -> byte 119; 1.0625 * 256 = 272: tie between 256 (M=0) and 288
                 (M=1) -> even -> 256 = 2^8 -> 0 1111 000 = 0x78.
      unrounded: c * 256 = 272 + 2^-12 -> above the tie -> 288 -> 0x79 (what a missing rounding
                 would store)."""
    d, r, bs = 512, 64, 1
    c = 1.0625 + 2.0**-20
    cs = torch.zeros(1, r, dtype=torch.float32)
    cs[0, : r // 2] = 1.0
    cs[0, 0] = c  # cos of pair 0; every sin 0
    assert cs[0, 0].item() == c  # c is a float32
    kv = torch.zeros(1, d, dtype=torch.bfloat16)
    kv[0, 448] = 1.0
    for order in ("kernel", "eager"):
        cache = torch.full((1, 528 + 16), 0xA5, dtype=torch.uint8)
        ref.kv_rope_insert(kv, cache, torch.tensor([0]), torch.tensor([0]), cs, bs, "mxfp8", order=order)
        assert cache[0, 448].item() == 0x78
        assert cache[0, 449].item() == 0x00
        assert cache[0, 512 + 14].item() == 119


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
# default POSITIVE. Byte j of the data record holds dims 2j (low nibble) and 2j + 1 (high nibble).
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
    12: 0xF0,  # -0.25 -> -0 -> +0 (POSITIVE); -5.01 -> -6 = 0xF
    13: 0x10,  # -0.0 -> 0 (POSITIVE); 0.26 -> 1 (0.5)
    16: 0x27,  # dims 32, 33: 11.25 / 1.875 = 6 -> 7; 2.34375 / 1.875 = 1.25 exactly, a tie -> 2
    17: 0x64,  # 4.6875 / 1.875 = 2.5 tie -> 4; 9.375 / 1.875 = 5 tie -> 6
    24: 0x07,  # dim 48: (7.125 - 2^-21) / 1.25 = 5.7 -> 7
    32: 0x10,  # dims 64, 65 (s = 2^-9): 2^-12 -> 0.125 -> 0; 2^-10 -> 0.5 -> 1
    33: 0x00,  # dim 66: -2^-11 / 2^-9 = -0.25, tie -> -0 -> +0 (POSITIVE)
    40: 0xC7,  # dims 80, 81 (s = 448): 6.70 -> saturate 7; -2.23 -> -2 = 0xC
    48: 0x77,  # dims 96, 97 (s = 0.5): NaN -> 0x7 (+6); 3 / 0.5 = 6 -> 7
    56: 0xF7,  # dims 112, 113 (s = 448): Inf -> 7; -Inf -> 0xF
    57: 0x02,  # dim 114: 448 / 448 = 1 -> 2
    224: 0xD7,  # dims 448, 449 (s = 0.171875): 5.82 -> 7; -2.91 -> -3 = 0xD
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
    assert v[16:28].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -6.0, 0.0, 0.5]
    assert v[33].item() == 1.875 and v[48].item() == 7.5 and v[65].item() == 2.0**-10
    assert v[80].item() == 2688.0 and v[112].item() == 2688.0 and v[448].item() == 6 * 0.171875
    d2, s2 = insert_and_read("nvfp4_v41", x, 512, block_size=3, slot=4, page_pad=48)
    assert d2.tolist() == byte_row(256, NVFP4_V41_DATA) and s2.tolist() == NVFP4_V41_SCALE


def test_nvfp4_v41_signed_zero_choice():
    """Fp4Zero.SIGNED (FlashMLA's reference): the values that round to zero keep their sign."""
    data, scale = encode_with("nvfp4_v41", _nvfp4_x(), Numerics(fp4_zero=Fp4Zero.SIGNED))
    want = dict(NVFP4_V41_DATA)
    want[12] = 0xF8  # -0.25 -> 0x8
    want[13] = 0x18  # -0.0 -> 0x8
    want[33] = 0x08  # -2^-11 -> -0.25 units -> 0x8
    want[255] = 0x80  # dim 511: -0.0 (group 31, s = 2^-9) -> 0x8 in the high nibble
    assert data[0].tolist() == byte_row(256, want)
    assert scale[0].tolist() == NVFP4_V41_SCALE


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


# =============================================================================================
# Parity choices (formats.Numerics)
# =============================================================================================
def encode_with(name: str, x: torch.Tensor, numerics: Numerics):
    return codecs.encode_tokens(get_format(name), x, None, numerics)


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
