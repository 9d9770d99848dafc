"""The bound indexer-Q op (`attn_prologue.bind_index_q`): index_q_rope_quant bound to one layer's heads,
format, numerics and scales, so that a call passes only its tensors and pays only the per-call checks."""

from __future__ import annotations

import torch

from . import index_q_ops, overlap
from .binding import bind_device, check_bind_args
from .dispatch import MAX_BUCKET_LOG2, Runtime, default_runtime
from .errors import InputError, UnsupportedError
from .index_q import FORMATS, host_scales
from .launch import LaunchConfig
from .variants import Op, Request

_OUTPUTS = ("q_out", "weights_out", "q_scales")
# the byte alignment each tensor's start needs (index_q_ops.check: 0 is the element size)
_ALIGN = {
    "q": 16,
    "positions": 0,
    "cos_sin_cache": 16,
    "weights": 2,
    "q_out": 16,
    "weights_out": 0,
    "q_scales": 4,
}


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
        self.device = bind_device(device, "bind_index_q")
        self.num_heads, self.fmt, self.dtype, self.weights_dtype = num_heads, fmt, dtype, weights_dtype
        self._rt, self._config, self._numerics, self._checked = (
            runtime or default_runtime(),
            config,
            numerics,
            checked,
        )
        self._request = Request(Op.INDEX_Q, 128, index_q_ops.ROPE_DIM, fmt, io)
        self._calls_by_dtype: dict = {}
        self._use_positions(torch.int64)  # binds (and self-tests) now: errors before any call
        self._scales = host_scales(softmax_scale, head_scale, self.bits)
        self._accepted = None  # the geometry (all but T) of the last call the full check accepted
        self._extents: tuple = ()

    def _use_positions(self, dtype) -> None:
        calls = self._calls_by_dtype.get(dtype)
        if calls is None:
            calls = self._calls_by_dtype[dtype] = index_q_ops.shape_calls(
                self._rt, self._request, self.device, self.num_heads, self.weights_dtype, self._numerics,
                self._checked, self._config, None, dtype,
            )  # fmt: skip
        self.bits, self.errors, self._calls = calls

    def __call__(self, q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales=None) -> None:
        """Write q_out, weights_out (and q_scales for mxfp4) for the T rows of q. The full check runs when
        the tensors' shapes (but T), strides, dtypes, devices or lazy bits are not the last accepted call's;
        every call checks that each per-token tensor has T rows, its data pointers' alignment and that the
        written bytes overlap nothing else."""
        tensors = (q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales)
        try:
            n = q.shape[0]
            geometry = tuple(
                None if t is None else (t.shape[1:], t.stride(), t.dtype, t.device, t.is_neg(), t.is_conj())
                for t in tensors
            ) + (cos_sin_cache.shape[0], torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in tensors[4:]))  # fmt: skip
            ok = geometry == self._accepted and self._per_call_ok(tensors, n)
        except (AttributeError, TypeError, IndexError):  # not tensors: the full check names the argument
            ok = False
        if not ok:
            self._full_check(*tensors)
            self._accepted = geometry
            n = q.shape[0]
        if n == 0:
            return
        fn, tail = self._calls[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(n), inlined
        scales = () if q_scales is None else (q_scales.view(torch.uint8),)
        fn(q, weights, q_out.view(torch.uint8), *scales, weights_out.view(torch.uint8), positions,
           cos_sin_cache, self.errors, *self._scales, *tail)  # fmt: skip

    def _full_check(self, q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales) -> None:
        index_q_ops.check(
            q, positions, cos_sin_cache, weights, 1.0, 1.0, q_out, weights_out, q_scales, self.fmt
        )
        for t, name, dtype in ((q, "q", self.dtype), (weights_out, "weights_out", self.weights_dtype)):
            if t.dtype != dtype or t.device != self.device or t.shape[1] != self.num_heads:
                raise InputError(
                    f"{name} must be {dtype} [T, {self.num_heads}, ...] on {self.device} for this bound op, got "
                    f"{t.dtype} {list(t.shape)} on {t.device}"
                )
        self._use_positions(positions.dtype)
        # per tensor: (bytes between token rows, bytes of one row); cos_sin_cache: (0, bytes of the table)
        self._extents = tuple(
            None if t is None else (0, overlap.byte_range(t)[1] - t.data_ptr()) if t is cos_sin_cache
            else (t.stride(0) * t.element_size(), _row_bytes(t))
            for t in (q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales)
        )  # fmt: skip

    def _per_call_ok(self, tensors, n: int) -> bool:
        """What the full check would say of a call of the accepted geometry, on ints: every per-token tensor
        has n rows, each start is aligned, and no written range meets another tensor's."""
        ranges = []
        for (name, align), t, extent in zip(_ALIGN.items(), tensors, self._extents):
            if t is None:
                continue
            if name != "cos_sin_cache" and t.shape[0] != n:
                return False
            p = t.data_ptr()
            if p % (align or t.element_size()):
                return False
            step, row = extent
            if step < 0:  # (a layout the full check took: it decides each call)
                return False
            ranges.append(
                (name, p, p + row if name == "cos_sin_cache" else p + (n - 1) * step + row if n else p)
            )
        for a, a0, a1 in ranges:
            if a in _OUTPUTS and any(b != a and a0 < b1 and b0 < a1 for b, b0, b1 in ranges):
                return False
        return True


def _row_bytes(t: torch.Tensor) -> int:
    """The bytes one token row of t spans (its sizes and strides after the first)."""
    if any(size == 0 for size in t.shape[1:]):
        return 0
    return (sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:])) + 1) * t.element_size()


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
