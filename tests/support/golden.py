"""Helpers of the golden-vector tests (tests/test_golden_*.py): hand-built rows, byte rows, and the
cache round trip every format's golden vectors go through. Nothing here computes an expected byte."""

from __future__ import annotations

import struct

import torch
from attn_prologue import codecs
from attn_prologue import reference as ref
from attn_prologue.formats import Numerics, get_format

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


def encode_with(name: str, x: torch.Tensor, numerics: Numerics | str | None):
    """encode_tokens with parity choices (a Numerics, its string spelling, or a preset)."""
    return codecs.encode_tokens(get_format(name), x, None, numerics)
