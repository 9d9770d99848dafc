"""The vLLM plugin: entry point `vllm.general_plugins` -> `install` (docs/vllm-plugin.md).

vLLM reaches its DeepSeek-V4 prologue only through direct calls from its attention layers, so the
plugin replaces those layers' methods on their classes (before or after the layers exist: they are
looked up through `self`):

- `DeepseekV4Attention._fused_qnorm_rope_kv_insert` (V4 and V4.1 trees): the SWA insert with Q
  written into a ScratchPool view instead of the tensor vLLM's op allocates on every call. The pool
  is reserved during vLLM's profile run (so its KV-cache sizing counts the bytes), one buffer per
  micro-batch when dual-batch overlap is on, and locked at the first real call.
- V4.1 `DeepseekCompressor.insert_cache` (compressed cache, 584 / 528 / 288 B and bf16 rows) and
  V4.1 `DeepseekV4Indexer._produce_k` (indexer keys, 132 / 68 B).
- `fused_indexer_q_rope_quant` as the V4 and V4.1 attention modules bound it (the indexer's Q: FP8 or
  MXFP4, weights folded): our index_q kernels, vLLM's outputs (compat.vllm_indexer).

Every branch vLLM's method has is kept: where we have no kernel or no scratch (the profile run
itself, full-cache bf16 / per-tensor FP8 SWA rows, context parallelism, SM100's UE8M0 indexer
scales, a call our kernels refuse) vLLM's own method runs, and a refusal or a missing reservation
is logged once. Bytes follow vLLM's writers: the `vllm` preset for its CUDA op, `vllm-triton` for
its Triton writers (runtime/presets.py).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable

import torch

from .. import ops
from ..compat import vllm as compat_vllm
from ..compat import vllm_indexer
from ..errors import InputError, ScratchError, UnsupportedError
from ..parity import NumericsError
from ..scratch import ScratchPool
from . import Installed, OpSeam, Seam, engine_version
from . import install as install_seams

log = logging.getLogger("vllm.attn_prologue")  # under vLLM's logger, so vLLM's handlers show it

VERSIONS = ("0.33.0", "0.34.0")  # checked against these wheels' sources
V4, V41 = "vllm.models.deepseek_v4.attention", "vllm.models.deepseek_v41.attention"
V41_COMPRESSOR = "vllm.models.deepseek_v41.compressor"
INSERT_PARAMETERS = ("self", "q", "kv", "positions", "attn_metadata")
WRITER_PARAMETERS = ("self", "latent", "positions", "rotary_emb")
# _C.fused_deepseek_v4_kv_rope_insert's schema (vLLM's CUDA extension, the same in 0.33.0 and 0.34.0)
KV_OP_PARAMETERS = ("kv", "k_cache", "slot_mapping", "position_ids", "cos_sin_cache", "cache_block_size",
                    "fp8_scale", "kv_mxfp8")  # fmt: skip

CUDA_OP = "preset=vllm"  # _C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert's bytes
TRITON_WRITERS = "preset=vllm-triton"  # rope_quant_insert's and indexer_k_norm_rope_store's
COMPRESSED_RECORDS = {584: "fp8_ds_mla", 528: "mxfp8", 288: "nvfp4_v41"}  # vLLM picks by record width
# vLLM's V4.1 records keep each token's scales right after its own values (its cache_utils.py: "The V4.1
# records are interleaved"), where our formats put a page's scales after all its values
V41_INLINE = (528, 288)
# what our kernels refuse without writing anything: vLLM's own method then runs
REFUSALS = (InputError, UnsupportedError, ScratchError, NumericsError)

_installed: Installed | None = None
pool = ScratchPool()  # this process's padded-Q scratch (one device per vLLM worker)
_claimed: set[tuple] = set()
_told: set[str] = set()


def install() -> Installed | None:
    """The entry point. vLLM calls its plugins once per process, but more than once does no harm."""
    global _installed
    if _installed is not None and _installed.replaced:
        return _installed
    if torch.version.hip:
        log.info("attn_prologue: a ROCm torch; our kernels are NVIDIA's, vLLM left untouched")
        return None
    seams = (
        Seam(V4, "DeepseekV4Attention._fused_qnorm_rope_kv_insert", INSERT_PARAMETERS,
             functools.partial(_swa_insert, v41=False)),
        Seam(V41, "DeepseekV4Attention._fused_qnorm_rope_kv_insert", INSERT_PARAMETERS,
             functools.partial(_swa_insert, v41=True)),
        Seam(V41_COMPRESSOR, "DeepseekCompressor.insert_cache", WRITER_PARAMETERS, _compressed_insert),
        Seam(V41, "DeepseekV4Indexer._produce_k", WRITER_PARAMETERS, _indexer_keys),
        Seam(V4, "fused_indexer_q_rope_quant", vllm_indexer.PARAMETERS, _indexer_q),
        Seam(V41, "fused_indexer_q_rope_quant", vllm_indexer.PARAMETERS, _indexer_q),
        # the KV-only insert of V4.1's replay path, its context parallelism and the DSpark drafter: our
        # kernels behind vLLM's own op, where vLLM's CUDA extension is loaded
        OpSeam("_C", compat_vllm.KV_NAME, KV_OP_PARAMETERS, _kv_only_op),
    )  # fmt: skip
    _load_vllm_extension()
    _installed = install_seams("vLLM", engine_version("vllm"), dict.fromkeys(VERSIONS, seams), log)
    return _installed


def _load_vllm_extension() -> None:
    """vLLM's CUDA platform imports the extension that defines its _C ops; a plugin may load first."""
    try:
        importlib.import_module("vllm._C_stable_libtorch")
    except (ImportError, OSError):  # no CUDA here (the library needs libcudart), or another vLLM build
        pass


def _kv_only_op(schema) -> Callable[[], None]:
    """Ours behind vLLM's _C KV-only op (its CPU and CUDA kernels; vLLM's schema kept, vLLM's bytes by
    default: compat.vllm's numerics); returns what puts vLLM's kernels back."""
    return compat_vllm.register("_C", override=True, kv_only=True).close


def _indexer_q(original: Callable) -> Callable:
    """vLLM's indexer-Q function with our kernels behind it (vLLM's outputs and bytes); vLLM's own runs
    for tensors off the GPU and for a call ours refuse (e.g. a bf16 cos/sin table), logged once."""

    def fused_indexer_q_rope_quant(positions, index_q, index_q_cos_sin_cache, index_weights,
                                   index_weights_softmax_scale, index_weights_head_scale, use_fp4=False,
                                   weights_out_dtype=torch.float32):  # fmt: skip
        args = (positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
                index_weights_head_scale, use_fp4, weights_out_dtype)  # fmt: skip
        if _on_gpu(index_q):
            try:
                return vllm_indexer.fused_indexer_q_rope_quant(*args)
            except REFUSALS as exc:
                _tell_once("indexer_q", "the indexer's Q runs vLLM's kernel: ours refused the call (%s)", exc)
        return original(*args)

    fused_indexer_q_rope_quant.__wrapped__ = original
    return fused_indexer_q_rope_quant


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _tell_once(key: str, message: str, *args) -> None:
    if key not in _told:
        _told.add(key)
        log.warning("attn_prologue: " + message, *args)


def _attn_metadata():
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata


# ---- the padded-Q scratch ------------------------------------------------------------------------
def _micro_batches() -> int:
    """vLLM's micro-batches in flight (2 with dual-batch overlap), from the config vLLM sets around
    its profile run."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    parallel = getattr(config, "parallel_config", None)
    return parallel.num_ubatches if parallel is not None and parallel.use_ubatching else 1


def _micro_batch() -> int:
    from vllm.v1.worker.ubatching import dbo_current_ubatch_id

    return dbo_current_ubatch_id()


def reserve(layer, q: torch.Tensor) -> None:
    """The profile run: reserve [max_num_batched_tokens, padded_heads, head_dim] per micro-batch
    (shared by every layer of that shape), before vLLM measures the memory left for its KV cache."""
    if pool.locked or layer.padded_heads == layer.n_local_heads:
        return  # locked: a later dummy run; P == H: Q is written in place, no scratch
    tokens = max(int(getattr(layer, "max_num_batched_tokens", 0)), q.shape[0])
    pool.reserve(max_tokens=tokens, padded_heads=layer.padded_heads, head_dim=q.shape[2], dtype=q.dtype,
                 micro_batches=_micro_batches(), device=q.device)  # fmt: skip


def q_view(layer, q: torch.Tensor, layout: str) -> torch.Tensor | None:
    """This call's q_out: a view of the reserved buffer (zero-once: pads were zeroed at reservation and
    only kernels with this H and layout write it), or None (told once) when none fits."""
    n, h, d = q.shape
    where = dict(padded_heads=layer.padded_heads, head_dim=d, dtype=q.dtype, micro_batch=_micro_batch(),
                 device=q.device)  # fmt: skip
    key = (h, layout, *where.values())
    try:
        if key not in _claimed:
            pool.claim(h, q_layout=layout, **where)
            _claimed.add(key)
        return pool.view(n, **where)
    except ScratchError as exc:
        _tell_once(f"scratch {key}", "no padded-Q scratch for this call (%s); vLLM's allocating op runs", exc)
        return None


# ---- the replacements ----------------------------------------------------------------------------
def _refused(what: str, exc: Exception) -> None:
    _tell_once(
        f"{what} {type(exc).__name__}", "%s: our kernels refused the call (%s); vLLM's own runs", what, exc
    )


def _swa_insert(original, *, v41: bool):
    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        if not isinstance(attn_metadata, dict):  # the profile run: vLLM pads Q itself
            reserve(self, q)
            return original(self, q, kv, positions, attn_metadata)
        if not pool.locked:
            pool.lock()  # the first real call: the KV cache is sized, nothing may be allocated from now on
        cache = self.swa_cache_layer.kv_cache
        if cache.dtype != torch.uint8 or getattr(self, "use_pcp", False):
            return original(self, q, kv, positions, attn_metadata)  # full-cache rows, context parallel
        meta = attn_metadata[self.swa_cache_layer.prefix]
        fmt = "mxfp8" if getattr(self, "kv_mxfp8", False) else "fp8_ds_mla"
        interleaved = v41 and self.accepts_unnormed_unroped_query
        page_view, block_size = cache.view(cache.shape[0], -1), meta.block_size
        if fmt == "mxfp8":
            page_view, block_size = token_pages(page_view, block_size, 528), 1
        if page_view is None:
            _tell_once("padded V4.1 pages", "padded V4.1 SWA pages are no layout of ours; vLLM's op runs")
            return original(self, q, kv, positions, attn_metadata)
        writes = (page_view, meta.slot_mapping, positions, self.rotary_emb.cos_sin_cache)
        try:
            if interleaved and self.n_local_heads == self.padded_heads:  # vLLM's pad_to = 0: no Q work
                ops.kv_rope_insert(kv, *writes, block_size, fmt, numerics=CUDA_OP)
                return q
            layout = "interleaved" if interleaved else "head_major"
            q_out = q if self.n_local_heads == self.padded_heads else q_view(self, q, layout)
            if q_out is None:
                return original(self, q, kv, positions, attn_metadata)
            ops.qnorm_rope_kv_insert(
                q, kv, q_out, *writes, self.eps, block_size, fmt, numerics=CUDA_OP,
                write_pad_heads=False, apply_q_norm=not v41, apply_q_rope=not interleaved, q_layout=layout,
            )  # fmt: skip
            return q_out
        except REFUSALS as exc:
            _refused("the SWA insert", exc)
            return original(self, q, kv, positions, attn_metadata)

    _fused_qnorm_rope_kv_insert.__wrapped__ = original
    return _fused_qnorm_rope_kv_insert


def token_pages(pages: torch.Tensor, block_size: int, record: int) -> torch.Tensor | None:
    """vLLM's V4.1 pages as our writers take them: with pages unpadded (stride = block_size x record), a
    token's values-then-scales record is our layout for pages of one token, so the cache is written as
    [blocks x block_size, record] with block size 1 and the same slot ids. None for padded pages."""
    if pages.stride(0) != block_size * record:
        return None
    return pages.as_strided((pages.shape[0] * block_size, record), (record, 1))


def pages(cache: torch.Tensor) -> torch.Tensor | None:
    """A [num_blocks, block_size, record] cache as the [num_blocks, page_bytes] uint8 pages our writers
    take (page_bytes = its block stride, padding included), or None when its records are not packed."""
    if cache.dim() != 3 or cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
        return None
    size = cache.element_size()
    flat = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return flat.as_strided((cache.shape[0], cache.stride(0) * size), (cache.stride(0) * size, 1))


def _compressed_insert(original):
    def insert_cache(self, latent, positions, rotary_emb):
        if latent is None:
            return original(self, latent, positions, rotary_emb)
        attn_metadata = _attn_metadata()
        layer = self._static_forward_context[self.k_cache_prefix]
        cache = layer.kv_cache
        if cache.dtype == torch.uint8:
            fmt = COMPRESSED_RECORDS.get(cache.shape[-1])
        else:
            fmt = "bf16" if cache.dtype == torch.bfloat16 else None  # per-tensor FP8 rows: vLLM's
        page_view, block_size = pages(cache), cache.shape[1]
        if page_view is not None and cache.dtype == torch.uint8 and cache.shape[-1] in V41_INLINE:
            page_view, block_size = token_pages(page_view, block_size, cache.shape[-1]), 1
        if fmt is None or page_view is None or not isinstance(attn_metadata, dict):
            return original(self, latent, positions, rotary_emb)
        slots = attn_metadata[self.k_cache_prefix].slot_mapping
        try:
            ops.kv_rope_insert(latent, page_view, slots, positions, rotary_emb.cos_sin_cache, block_size,
                               fmt, numerics=TRITON_WRITERS, compress_ratio=self.compress_ratio)  # fmt: skip
        except REFUSALS as exc:
            _refused("the compressed-cache insert", exc)
            original(self, latent, positions, rotary_emb)

    insert_cache.__wrapped__ = original
    return insert_cache


def _mx_indexer_scales() -> bool:
    """SM100's indexer FP8 keys carry four UE8M0 bytes instead of the fp32 scale: not a record of ours."""
    from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

    return mqa_logits_use_mx_scales()


def _indexer_keys(original):
    def _produce_k(self, latent, positions, rotary_emb):
        attn_metadata = _attn_metadata()
        if not isinstance(attn_metadata, dict) or latent is None:
            return original(self, latent, positions, rotary_emb)  # the profile run
        page_view = pages(self.k_cache.kv_cache)
        if page_view is None or (not self.use_fp4_kv and _mx_indexer_scales()):
            return original(self, latent, positions, rotary_emb)
        slots = attn_metadata[self.k_cache.prefix].slot_mapping
        k_pre, _ = self.wk(latent)
        try:
            ops.kv_rope_insert(
                k_pre, page_view, slots, positions, rotary_emb.cos_sin_cache, self.k_cache.kv_cache.shape[1],
                "mxfp4" if self.use_fp4_kv else "fp8_token", norm_weight=self.k_norm.weight,
                eps=self.k_norm.variance_epsilon, numerics=TRITON_WRITERS, compress_ratio=self.compress_ratio,
            )  # fmt: skip
        except REFUSALS as exc:
            _refused("the indexer-key insert", exc)
            original(self, latent, positions, rotary_emb)

    _produce_k.__wrapped__ = original
    return _produce_k
