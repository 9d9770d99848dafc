"""The chunk-interleaved Q layout of a flat buffer, from its definition (op.md): the oracle of the
interleaved copy kinds (attn_prologue.lab.copy_kernel, `_qi`). Nothing here calls the code under test."""

from __future__ import annotations

import torch

HEADS = 64  # the interleaved copy's token: 64 heads of 512 bf16 values, 32 chunks of 16 values (32 bytes)
CHUNKS = 32


def interleaved_copy(src: torch.Tensor, chunk: int) -> torch.Tensor:
    """What an interleaved copy of flat `src` writes, `chunk` elements a chunk (8 int32 words, or 2
    16-byte vectors): each whole token with chunk c of head h at chunk c * HEADS + h, the elements past
    the last whole token as they are."""
    token = HEADS * CHUNKS * chunk
    whole = src.numel() // token * token
    out = src.clone()
    out[:whole] = src[:whole].view(-1, HEADS, CHUNKS, chunk).transpose(1, 2).reshape(-1)
    return out
