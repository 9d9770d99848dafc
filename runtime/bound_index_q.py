"""The bound indexer-Q op (`attn_prologue.bind_index_q`): index_q_rope_quant bound to one layer's heads,
format, numerics and scales, so that a call passes only its tensors and pays only the per-call checks."""

from __future__ import annotations

import torch

from . import index_q_ops
from .binding import bind_device, check_bind_args
from .dispatch import Runtime, default_runtime
from .errors import InputError, UnsupportedError
from .index_q import FORMATS, host_scales
from .launch import LaunchConfig
from .variants import Op, Request


class BoundIndexQOp:
    """index_q_rope_quant bound to one layer (made by `bind_index_q`, whose docstring says what each
    argument is)."""

    def __init__(
        self,
        *,
        num_heads: int,
        softmax_scale: float,
        head_scale: float,
        fmt: str = "fp8_token",
        dtype: torch.dtype = torch.bfloat16,
        weights_dtype: torch.dtype = torch.float32,
        numerics=None,
        checked: bool = True,
        device=None,
        config: LaunchConfig | None = None,
        runtime: Runtime | None = None,
    ):
        io = check_bind_args(dtype, 0.0, num_heads=num_heads)
        if fmt not in FORMATS:
            raise UnsupportedError(f"index_q quantizes as {' or '.join(FORMATS)}, not {fmt!r}")
        if weights_dtype not in (torch.float32, torch.bfloat16):
            raise InputError(f"weights_dtype must be torch.float32 or torch.bfloat16, got {weights_dtype}")
        index_q_ops.check_scales(softmax_scale, head_scale)
        device = bind_device(device, "bind_index_q")
        request = Request(Op.INDEX_Q, 128, index_q_ops.ROPE_DIM, fmt, io)
        self._shape = index_q_ops.IndexQCalls(request, device, num_heads, weights_dtype, numerics, checked, config,
                                  runtime or default_runtime())  # fmt: skip
        self.device, self.num_heads, self.fmt, self.dtype = device, num_heads, fmt, dtype
        self.weights_dtype, self.bits, self.errors = weights_dtype, self._shape.bits, self._shape.errors
        self._scales = host_scales(softmax_scale, head_scale, self.bits)

    def __call__(self, q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales=None) -> None:
        """Write q_out, weights_out (and q_scales for mxfp4) for the T rows of q (IndexQCalls.run says what
        each call checks)."""
        self._shape.run((q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales), self._scales)


def bind_index_q(
    *,
    num_heads: int,
    softmax_scale: float,
    head_scale: float,
    fmt: str = "fp8_token",
    dtype: torch.dtype = torch.bfloat16,
    weights_dtype: torch.dtype = torch.float32,
    numerics=None,
    checked: bool = True,
    device=None,
    config: LaunchConfig | None = None,
    runtime: Runtime | None = None,
) -> BoundIndexQOp:
    """Bind index_q_rope_quant to one layer's indexer (once per layer, at startup); call the result per step:
    `op(q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales=None)` (docs/index-q.md).

    num_heads: H, the index heads of q ([T, H, 128]). softmax_scale, head_scale: the layer's two weight
    scales (the FP8 row scale is folded into weights_out with them). fmt: "fp8_token" or "mxfp4". dtype:
    q's and weights' dtype (bfloat16 or float16); weights_dtype: weights_out's (float32 or bfloat16).
    numerics: a preset ("vllm", "vllm-triton", "sglang", "tokenspeed") or IndexQFlag bits (None: vLLM's
    CuTe-DSL kernel's). checked: count positions outside the table (`op.errors`). device: a CUDA device
    (None: the current one). config: force one LaunchConfig for every token count; runtime: a
    dispatch.Runtime instead of the process-wide one.

    Resolves the variant and loads its kernels (running its first-use self-test) now: InputError /
    UnsupportedError / NumericsError here, before any call. positions may be int64 or int32 per call (int32
    modules load on first use). The call allocates nothing and is CUDA-graph capturable after its first
    eager call with the same geometry."""
    return BoundIndexQOp(
        num_heads=num_heads, softmax_scale=softmax_scale, head_scale=head_scale, fmt=fmt, dtype=dtype,
        weights_dtype=weights_dtype, numerics=numerics, checked=checked, device=device, config=config,
        runtime=runtime,
    )  # fmt: skip
