"""vLLM's indexer-Q function on top of attn_prologue (docs/index-q.md): the signature of vLLM's
`fused_indexer_q_rope_quant` (vllm/models/deepseek_v4/common/ops/fused_indexer_q.py, 0.33.0 / 0.34.0),
allocating and returning what vLLM's does, and a caller-owned form that allocates nothing.

    (q_fp8, weights_out) = fused_indexer_q_rope_quant(positions, index_q, cos_sin, weights, softmax_scale,
                                                      head_scale)
    ((q_packed, q_scale_i32), weights_out) = fused_indexer_q_rope_quant(..., use_fp4=True)

Bytes: vLLM's CuTe-DSL kernel's (preset `vllm`, its CUDA default) for bf16 rows, its Triton kernel's
(`vllm-triton`) for fp16 rows, which the CuTe-DSL kernel does not take.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..index_q import MXFP4_BLOCK
from ..index_q_ops import index_q_rope_quant

PARAMETERS = ("positions", "index_q", "index_q_cos_sin_cache", "index_weights", "index_weights_softmax_scale",
              "index_weights_head_scale", "use_fp4", "weights_out_dtype")  # fmt: skip


def vllm_numerics(dtype: torch.dtype) -> str:
    """The preset whose bytes vLLM writes for rows of this dtype."""
    return "vllm" if dtype == torch.bfloat16 else "vllm-triton"


def fused_indexer_q_rope_quant(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    use_fp4: bool = False,
    weights_out_dtype: torch.dtype = torch.float32,
):
    """vLLM's function: new outputs each call, in vLLM's types (FP8 values as float8_e4m3fn; MXFP4 scales as
    one int32 per (token, head), the 4 UE8M0 bytes reinterpreted, as DeepGEMM takes them)."""
    if not isinstance(index_q, torch.Tensor) or index_q.dim() != 3:
        raise InputError(
            f"index_q must be a [T, H, D] tensor, got {getattr(index_q, 'shape', type(index_q).__name__)}"
        )
    if not use_fp4 and weights_out_dtype != torch.float32:
        raise InputError(f"the FP8 path writes float32 weights (as vLLM's asserts), got {weights_out_dtype}")
    t, h, d = index_q.shape
    weights_out = torch.empty((t, h), dtype=weights_out_dtype, device=index_q.device)
    if use_fp4:
        packed = torch.empty((t, h, d // 2), dtype=torch.uint8, device=index_q.device)
        scales = torch.empty((t, h, d // MXFP4_BLOCK), dtype=torch.uint8, device=index_q.device)
        fused_indexer_q_rope_quant_out(
            positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
            index_weights_head_scale, packed, weights_out, scales,
        )  # fmt: skip
        return (packed, scales.view(torch.int32).squeeze(-1)), weights_out
    q_fp8 = torch.empty((t, h, d), dtype=torch.float8_e4m3fn, device=index_q.device)
    fused_indexer_q_rope_quant_out(
        positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
        index_weights_head_scale, q_fp8, weights_out,
    )  # fmt: skip
    return q_fp8, weights_out


def fused_indexer_q_rope_quant_out(
    positions, index_q, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
    index_weights_head_scale, q_out, weights_out, q_scales=None, numerics=None,
) -> None:  # fmt: skip
    """The caller-owned form: q_out (FP8: [T, H, D] e4m3; MXFP4: [T, H, D/2] uint8 with q_scales
    [T, H, D/32] uint8) and weights_out [T, H] written, nothing allocated. numerics: vLLM's by default."""
    index_q_rope_quant(
        index_q, positions, index_q_cos_sin_cache, index_weights, index_weights_softmax_scale,
        index_weights_head_scale, q_out, weights_out, q_scales, "mxfp4" if q_scales is not None else "fp8_token",
        numerics or vllm_numerics(index_q.dtype),
    )  # fmt: skip
