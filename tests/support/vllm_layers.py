"""Minimally built vLLM DeepSeek-V4 layer objects for the plugin tests (CPU here, CUDA in tests/gpu).

The plugin's replacements are plain functions on vLLM's classes that read a handful of the layer's
attributes; these stand-ins carry exactly those attributes (the names vLLM 0.33.0 / 0.34.0 give
them), with fresh random inputs and caches of random bytes, so every byte a call must not write
keeps its poison."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

D, R, MAX_POS, EPS = 512, 64, 4096, 1e-6


def cos_sin(device, identity: bool = False, seed: int = 0) -> torch.Tensor:
    """[MAX_POS, R] float32, cos then sin; `identity` makes RoPE the identity (cos 1, sin 0)."""
    if identity:
        return torch.cat((torch.ones(MAX_POS, R // 2), torch.zeros(MAX_POS, R // 2)), 1).to(device)
    theta = torch.rand(MAX_POS, R // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.cat((theta.cos(), theta.sin()), 1).to(device)


def random_bytes(shape, device, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).to(
        device
    )


def rows(n: int, d: int, device, seed: int, heads: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n, d) if heads is None else (n, heads, d)
    return (torch.randn(shape, generator=g) * 3).to(torch.bfloat16).to(device)


def slots_and_positions(n: int, capacity: int, device, seed: int, m: int | None = None):
    """Distinct slots in [0, capacity) (every 4th skipped with -1) and positions in [0, MAX_POS)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(capacity, generator=g)[: (n if m is None else m)]
    slots[::4] = -1
    return slots.to(device), torch.randint(0, MAX_POS, (n,), generator=g).to(device)


def swa_layer(*, heads: int, padded: int, record: int, block_size: int, blocks: int, device,
              v41: bool = False, mxfp8: bool = False, interleaved: bool = False, seed: int = 0,
              max_tokens: int = 64, cache_dtype=torch.uint8, page_pad: int | None = None) -> SimpleNamespace:  # fmt: skip
    """A DeepseekV4Attention as _fused_qnorm_rope_kv_insert reads it; the SWA cache as vLLM shapes it:
    [blocks, block_size * record] bytes per page, plus padding for the 584 B record (vLLM rounds a V4
    page up to a multiple of 576 bytes; V4.1 pages of 32 or 64 tokens need none), or `page_pad`."""
    if cache_dtype == torch.uint8:
        pad = (64 if record == 584 else 0) if page_pad is None else page_pad
        cache = random_bytes((blocks, block_size * record + pad), device, seed)
    else:
        cache = rows(blocks * block_size, D, device, seed).view(blocks, block_size, D).to(cache_dtype)
    layer = SimpleNamespace(
        n_local_heads=heads, padded_heads=padded, head_dim=D, eps=EPS, max_num_batched_tokens=max_tokens,
        swa_cache_layer=SimpleNamespace(kv_cache=cache, prefix="layers.0.swa"),
        rotary_emb=SimpleNamespace(cos_sin_cache=cos_sin(device, seed=seed)),
    )  # fmt: skip
    if v41:
        layer.kv_mxfp8, layer.accepts_unnormed_unroped_query, layer.use_pcp = mxfp8, interleaved, False
        layer._pads_q_by_copy = False
    return layer


def swa_metadata(layer, slots: torch.Tensor, block_size: int) -> dict:
    return {layer.swa_cache_layer.prefix: SimpleNamespace(slot_mapping=slots, block_size=block_size)}


def compressor(*, record: int | None, block_size: int, blocks: int, ratio: int, device, seed: int = 0,
               dtype=torch.uint8) -> SimpleNamespace:  # fmt: skip
    """A V4.1 DeepseekCompressor as insert_cache reads it: its cache layer in the static forward context."""
    width = record if dtype == torch.uint8 else D
    if dtype == torch.uint8:
        cache = random_bytes((blocks, block_size, width), device, seed)
    else:
        cache = rows(blocks * block_size, D, device, seed).view(blocks, block_size, D).to(dtype)
    prefix = "layers.0.compressed"
    return SimpleNamespace(
        k_cache_prefix=prefix, compress_ratio=ratio,
        _static_forward_context={prefix: SimpleNamespace(kv_cache=cache)},
    )  # fmt: skip


def indexer(*, fp4: bool, block_size: int, blocks: int, ratio: int, device, seed: int = 0) -> SimpleNamespace:
    """A V4.1 DeepseekV4Indexer as _produce_k reads it: wk is the identity on a [N, 128] latent here
    (vLLM's is a linear layer returning (output, bias))."""
    record = 68 if fp4 else 132
    weight = (torch.rand(128, generator=torch.Generator().manual_seed(seed)) + 0.5).to(torch.bfloat16)
    return SimpleNamespace(
        use_fp4_kv=fp4, compress_ratio=ratio, owns_k=True,
        wk=lambda latent: (latent, None),
        k_norm=SimpleNamespace(weight=weight.to(device), variance_epsilon=EPS),
        k_cache=SimpleNamespace(kv_cache=random_bytes((blocks, block_size, record), device, seed),
                                prefix="layers.0.indexer"),
    )  # fmt: skip


@contextlib.contextmanager
def forward_context(attn_metadata):
    """vLLM's own override_forward_context, with a context holding only attn_metadata (what the
    replacements read)."""
    from vllm.forward_context import override_forward_context

    with override_forward_context(SimpleNamespace(attn_metadata=attn_metadata)):
        yield


def written_pages(pages, block_size: int, record: int):
    """(pages, block size) our op is handed for vLLM's pages of this record: vLLM's V4.1 records (528,
    288 B) keep each token's scales after its values, which is our layout for one-token pages."""
    if record in (528, 288):
        return pages.reshape(-1).view(-1, record), 1
    return pages, block_size
