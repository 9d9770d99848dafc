"""Golden vectors of the indexer formats (fp8_token, mxfp4) and the full-cache rows (bf16,
fp8_tensor), record placement and the KV rounding, derived BY HAND (conventions: test_golden_vectors)."""

from __future__ import annotations

import struct

import pytest
import torch
from attn_prologue import codecs
from attn_prologue import reference as ref
from attn_prologue.formats import get_format

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
