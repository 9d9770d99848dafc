"""The indexer's Q prologue as a function and a torch op (docs/index-q.md):

    index_q_rope_quant(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out,
                       q_scales=None, fmt="fp8_token", numerics=None)

writes the caller's q_out (e4m3 bytes [T, H, D], or E2M1 pairs [T, H, D/2]), q_scales (mxfp4: UE8M0 bytes
[T, H, D/32]) and weights_out ([T, H], float32 or bf16) and allocates nothing. CUDA tensors in eager mode
run the kernel directly (a full validation once per shape, then cheap checks and one call); CPU tensors
and traced calls go through torch.ops.attn_prologue.index_q_rope_quant, whose CPU kernel is the reference.
"""

from __future__ import annotations

import math

import torch

from . import overlap
from .dispatch import CPU_ERRORS, MAX_BUCKET_LOG2, Runtime, default_runtime
from .errors import UnsupportedError
from .index_q import FORMATS, MXFP4_BLOCK, host_scales, index_q_reference, numerics_bits
from .torch_op import _library, check_traced, lazy_bits_kernel, refuse_meta
from .validate import _check_tensor, _fail
from .variants import INDEX_Q_HEAD_DIMS, Conversions, IoDtype, Op, Request

SCHEMA = (
    "index_q_rope_quant(Tensor q, Tensor positions, Tensor cos_sin_cache, Tensor weights, float softmax_scale, "
    "float head_scale, Tensor(a6!) q_out, Tensor(a7!) weights_out, Tensor(a8!)? q_scales=None, "
    'str fmt="fp8_token", str numerics="", bool checked=True) -> ()'
)
ROPE_DIM = 64  # the generated (D, R) is (128, 64): R is what the cos/sin table's width must be


def _rows(name: str, t, shape: tuple, dtypes: tuple, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    _check_tensor(name, t, device)  # on the call's device, without a lazy negation or conjugation
    if t.dtype not in dtypes:
        _fail(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != shape:
        _fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _inner(name: str, t: torch.Tensor, align: int) -> None:
    """Rows of contiguous values (only the token stride is free), `align`-byte aligned."""
    want = tuple(math.prod(t.shape[i + 1 :]) for i in range(1, t.dim()))
    if t.numel() and tuple(t.stride()[1:]) != want:
        _fail(
            f"{name} must be contiguous within a token (strides {list(want)} after the first), got {list(t.stride())}"
        )
    if t.numel() and (t.data_ptr() % align or (t.shape[0] > 1 and t.stride(0) * t.element_size() % align)):
        _fail(f"{name} must start and have token rows at {align}-byte boundaries")


def check_scales(softmax_scale, head_scale) -> None:
    """Finite numbers, not bools (the torch op's schema would take True as 1.0)."""
    for name, value in (("softmax_scale", softmax_scale), ("head_scale", head_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(f"{name} must be a finite float, got {value!r}")


def check(
    q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales, fmt
) -> Request:
    """Every rule of a call, in one place: the typed error naming the argument, before anything is written."""
    if fmt not in FORMATS:
        raise UnsupportedError(f"index_q quantizes as {' or '.join(FORMATS)}, not {fmt!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        _fail(f"q must be a [T, H, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    io = IoDtype.of_torch(q.dtype)
    if io is None:
        _fail(f"q must be bfloat16 or float16, got {q.dtype}")
    refuse_meta(q=q, positions=positions, cos_sin_cache=cos_sin_cache, weights=weights, q_out=q_out, weights_out=weights_out, q_scales=q_scales)  # fmt: skip
    t, h, d = q.shape
    if (d, ROPE_DIM) not in INDEX_Q_HEAD_DIMS:
        raise UnsupportedError(f"index_q rows are generated for (D, R) in {INDEX_Q_HEAD_DIMS}; q has D={d}")
    dev = q.device
    mx = fmt == "mxfp4"
    _rows("q", q, (t, h, d), (q.dtype,), dev)
    _inner("q", q, 16)
    _rows("positions", positions, (t,), (torch.int64, torch.int32), dev)
    _inner("positions", positions, positions.element_size())
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] == 0:
        _fail("cos_sin_cache must be a float32 [max_pos, R] tensor with rows")
    _rows("cos_sin_cache", cos_sin_cache, (cos_sin_cache.shape[0], ROPE_DIM), (torch.float32,), dev)
    if not cos_sin_cache.is_contiguous() or cos_sin_cache.data_ptr() % 16:
        _fail("cos_sin_cache must be contiguous and 16-byte aligned")
    _rows("weights", weights, (t, h), (q.dtype,), dev)
    _inner("weights", weights, 2)
    codes = (t, h, d // 2) if mx else (t, h, d)
    _rows("q_out", q_out, codes, (torch.uint8,) if mx else (torch.uint8, torch.float8_e4m3fn), dev)
    _inner("q_out", q_out, 16)
    _rows("weights_out", weights_out, (t, h), (torch.float32, torch.bfloat16), dev)
    _inner("weights_out", weights_out, weights_out.element_size())
    if mx:
        _rows("q_scales", q_scales, (t, h, d // MXFP4_BLOCK), (torch.uint8,), dev)
        _inner("q_scales", q_scales, 4)
    elif q_scales is not None:
        _fail("q_scales is for fmt='mxfp4' (the FP8 row scale is folded into weights_out)")
    check_scales(softmax_scale, head_scale)
    for name, out in (("q_out", q_out), ("weights_out", weights_out), ("q_scales", q_scales)):
        if out is not None and out.requires_grad and torch.is_grad_enabled():
            _fail(f"{name} requires grad: the op writes it in place (pass a tensor that does not)")
    overlap.check_disjoint(
        {"q_out": q_out, "weights_out": weights_out, "q_scales": q_scales},
        {"q": q, "positions": positions, "cos_sin_cache": cos_sin_cache, "weights": weights},
    )
    return Request(Op.INDEX_Q, d, ROPE_DIM, fmt, io)


def index_q_rope_quant(
    q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales=None,
    fmt="fp8_token", numerics=None, *, checked=True, config=None, conversions=None, runtime: Runtime | None = None,
) -> None:  # fmt: skip
    """RoPE + FP8 / MXFP4 quantization of the indexer's Q, index weights folded (module docstring).
    numerics: None (vLLM's CuTe-DSL kernel's bits), a preset ("vllm", "vllm-triton", "sglang", "tokenspeed") or IndexQFlag bits."""
    if torch.compiler.is_compiling() or not (runtime or getattr(q, "is_cuda", True)):
        check_scales(softmax_scale, head_scale)
        text = numerics if isinstance(numerics, str) else ("" if numerics is None else str(int(numerics)))
        torch.ops.attn_prologue.index_q_rope_quant(
            q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales, fmt,
            text, checked,
        )  # fmt: skip
        return
    rt = runtime or default_runtime()
    key = shape = None
    try:
        key = (Op.INDEX_Q, q.device, q.dtype, tuple(q.shape[1:]), fmt, weights_out.dtype, q_out.dtype,
               numerics, checked, config, conversions, positions.dtype)  # fmt: skip
        shape = rt.calls.get(key)
    except (AttributeError, TypeError):
        pass
    request = check(
        q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales, fmt
    )
    if shape is None:
        shape = shape_calls(rt, request, q.device, q.shape[1], weights_out.dtype, numerics, checked, config,
                            conversions, positions.dtype)  # fmt: skip
        if key is not None:
            rt.calls[key] = shape
    n = q.shape[0]
    if n == 0:
        return
    bits, errors, calls = shape
    fn, tail = calls[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]
    # the scales are per call; every other argument is the shape's
    ws, hs = host_scales(softmax_scale, head_scale, bits)
    scales = () if q_scales is None else (q_scales.view(torch.uint8),)
    fn(q, weights, q_out.view(torch.uint8), *scales, weights_out.view(torch.uint8), positions, cos_sin_cache,
       errors, ws, hs, *tail)  # fmt: skip


def shape_calls(
    rt, request, device, heads, weights_dtype, numerics, checked, config, conversions, pos_dtype
) -> tuple:
    """What a shape's calls share: the numerics bits, the error counters and, per token-count bucket, the
    kernel and its arguments after head_scale (the scales come with each call)."""
    bits = numerics_bits(_parse(numerics), request.io_dtype.value, request.cache_format)
    if conversions is not None:
        request = Request(**{**request.__dict__, "conversions": Conversions(conversions)})
    # (each index_q kernel is compiled for its calls' bits: the branches of the others fold away)
    launchers = rt.launchers(
        request,
        device,
        heads=heads,
        written=heads,
        config=config,
        numerics=bits,
        fold_numerics=True,
        positions32=pos_dtype == torch.int32,
    )
    lead = ("q_in", "weights", "q_out", *(("q_scales",) if request.cache_format == "mxfp4" else ()),
            "weights_out", "positions", "cos_sin_cache", "errors", "weights_scale", "head_scale")  # fmt: skip
    values = dict(
        weights_bf16=int(weights_dtype == torch.bfloat16), numerics=bits, checked=int(bool(checked))
    )
    return bits, rt.errors_buffer(device), tuple((la.fn, la.tail(lead, **values)) for la in launchers)


def _parse(numerics):
    if isinstance(numerics, str) and numerics.strip().isdigit():
        return int(numerics)
    return numerics or None


# ---- the torch op -------------------------------------------------------------------------------
def _cpu(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales=None,
         fmt="fp8_token", numerics="", checked=True):  # fmt: skip
    check(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales, fmt)
    codes, scales, w, bad = index_q_reference(
        q,
        positions,
        cos_sin_cache,
        weights,
        softmax_scale,
        head_scale,
        fmt,
        _parse(numerics),
        weights_out.dtype,
    )
    q_out.view(torch.uint8).copy_(codes)
    weights_out.copy_(w)
    if scales is not None:
        q_scales.copy_(scales)
    if checked and bad:
        CPU_ERRORS[1] += bad


def _cuda(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales=None,
          fmt="fp8_token", numerics="", checked=True):  # fmt: skip
    index_q_rope_quant(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out,
                       q_scales, fmt, _parse(numerics), checked=checked, runtime=default_runtime())  # fmt: skip


def _fake(
    q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales=None, *_
):
    check_traced(
        overlap.check_disjoint,
        written={"q_out": q_out, "weights_out": weights_out, "q_scales": q_scales},
        inputs={"q": q, "positions": positions, "cos_sin_cache": cos_sin_cache, "weights": weights},
    )


_library.define(SCHEMA)
_library.impl("index_q_rope_quant", _cpu, "CPU")
_library.impl("index_q_rope_quant", _cuda, "CUDA")
_library.impl("index_q_rope_quant", torch.library.fallthrough_kernel, "Autograd")
for _key in ("Negative", "Conjugate"):
    _library.impl(
        "index_q_rope_quant", lazy_bits_kernel(torch.ops.attn_prologue.index_q_rope_quant.default), _key
    )
torch.library.register_fake("attn_prologue::index_q_rope_quant", _fake, lib=_library)
