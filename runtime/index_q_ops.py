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
from .errors import InputError, UnsupportedError
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
               numerics, checked, config, conversions)  # fmt: skip
        shape = rt.calls.get(key)
    except (AttributeError, TypeError):
        pass
    if shape is None:  # the first call of a shape: every rule, then the shape's calls
        request = check(
            q, positions, cos_sin_cache, weights, softmax_scale, head_scale, q_out, weights_out, q_scales, fmt
        )
        if conversions is not None:
            request = Request(**{**request.__dict__, "conversions": Conversions(conversions)})
        shape = IndexQCalls(request, q.device, q.shape[1], weights_out.dtype, numerics, checked, config, rt)
        if key is not None:
            rt.calls[key] = shape
    else:
        check_scales(softmax_scale, head_scale)
    # the scales are per call; the shape's calls check the tensors (a full check when their geometry changes)
    shape.run((q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales),
              host_scales(softmax_scale, head_scale, shape.bits))  # fmt: skip


def shape_calls(rt, request, device, heads, weights_dtype, numerics, checked, config, pos_dtype) -> tuple:
    """What a shape's calls share: the numerics bits, the error counters and, per token-count bucket, the
    kernel and its arguments after head_scale (the scales come with each call)."""
    bits = numerics_bits(_parse(numerics), request.io_dtype.value, request.cache_format)
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


# the byte alignment each tensor's start needs, in call order (`check`; 0: the element size)
_ALIGN = (16, 0, 16, 2, 16, 0, 4)  # q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales


class IndexQCalls:
    """One shape's calls (device, dtypes, heads, format, numerics): per positions width and token-count
    bucket the kernel and its trailing arguments, the last accepted geometry, and the per-call check.
    The bound op and the one-call function both run through `run`."""

    def __init__(self, request, device, num_heads, weights_dtype, numerics, checked, config, runtime):
        self._rt, self._request, self.device, self.num_heads = runtime, request, device, num_heads
        self.fmt, self.weights_dtype = request.cache_format, weights_dtype
        self.dtype = request.io_dtype.torch_dtype
        self._args = (numerics, checked, config)
        self._calls_by_dtype: dict = {}
        self._use_positions(torch.int64)  # loads (and self-tests) now: errors before any call
        self._accepted = None  # per tensor, what the last call the full check accepted had (_full_check)

    def _use_positions(self, dtype) -> None:
        calls = self._calls_by_dtype.get(dtype)
        if calls is None:
            calls = self._calls_by_dtype[dtype] = shape_calls(
                self._rt, self._request, self.device, self.num_heads, self.weights_dtype, *self._args, dtype
            )  # fmt: skip
        self.bits, self.errors, self._calls = calls

    def run(self, tensors: tuple, scales: tuple) -> None:
        """Write the outputs of `tensors` (q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales)
        with the kernels' (weights_scale, head_scale). The full check runs unless the tensors have the last
        accepted call's geometry (shapes but T, strides, dtypes, devices, no lazy negation, no output that
        requires grad), aligned starts and written ranges that meet nothing else (on ints)."""
        q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales = tensors
        try:
            n = q.shape[0]
            ok = self._per_call_ok(tensors, n)
        except (AttributeError, TypeError, IndexError):  # not tensors: the full check names the argument
            ok = False
        if not ok:
            self._full_check(*tensors)
            n = q.shape[0]
        if n == 0:
            return
        fn, tail = self._calls[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(n), inlined
        codes = q_out if q_out.dtype is torch.uint8 else q_out.view(torch.uint8)
        if q_scales is None:
            fn(q, weights, codes, weights_out.view(torch.uint8), positions, cos_sin_cache, self.errors, *scales,
               *tail)  # fmt: skip
        else:
            fn(q, weights, codes, q_scales, weights_out.view(torch.uint8), positions, cos_sin_cache, self.errors,
               *scales, *tail)  # fmt: skip

    def _full_check(self, q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales) -> None:
        self._accepted = None
        check(q, positions, cos_sin_cache, weights, 1.0, 1.0, q_out, weights_out, q_scales, self.fmt)
        for t, name, dtype in ((q, "q", self.dtype), (weights_out, "weights_out", self.weights_dtype)):
            if t.dtype != dtype or t.device != self.device or t.shape[1] != self.num_heads:
                raise InputError(
                    f"{name} must be {dtype} [T, {self.num_heads}, ...] on {self.device} for this bound op, got "
                    f"{t.dtype} {list(t.shape)} on {t.device}"
                )
        self._use_positions(positions.dtype)
        # per tensor: whether it has T rows, its sizes (after T), strides, dtype, device, start alignment,
        # bytes between token rows and bytes of a row (cos_sin_cache: 0 and the table's bytes)
        self._accepted = tuple(
            None if t is None else (
                i != 2, tuple(t.shape[1:] if i != 2 else t.shape), t.stride(), t.dtype, t.get_device(),
                _ALIGN[i] or t.element_size(),
                *((t.stride(0) * t.element_size(), _row_bytes(t)) if i != 2 else (0, overlap.byte_range(t)[1] - t.data_ptr())),
            )
            for i, t in enumerate((q, positions, cos_sin_cache, weights, q_out, weights_out, q_scales))
        )  # fmt: skip

    def _per_call_ok(self, tensors, n: int) -> bool:
        """What the full check would say of a call, on ints, where it can say it without the full check."""
        accepted = self._accepted
        if accepted is None:
            return False
        ranges = []
        for t, a in zip(tensors, accepted):
            if t is None or a is None:
                if t is not a:
                    return False
                continue
            per_token, sizes, strides, dtype, device, align, step, row = a
            if (t.dtype is not dtype or t.stride() != strides or t.get_device() != device or t.is_neg()
                    or t.shape != ((n, *sizes) if per_token else sizes)):  # fmt: skip
                return False
            p = t.data_ptr()
            if p % align or step < 0:  # (a negative token stride: the full check decides each call)
                return False
            ranges.append((p, p + ((n - 1) * step + row if n else 0) if per_token else p + row))
        q_scales = tensors[6]
        if (tensors[4].requires_grad or tensors[5].requires_grad or q_scales is not None and q_scales.requires_grad) \
                and torch.is_grad_enabled():  # fmt: skip
            return False
        for i in range(4, len(ranges)):  # the written ones: q_out, weights_out (and q_scales)
            a0, a1 = ranges[i]
            for j, (b0, b1) in enumerate(ranges):
                if j != i and a0 < b1 and b0 < a1:
                    return False
        return True


def _row_bytes(t: torch.Tensor) -> int:
    """The bytes one token row of t spans (its sizes and strides after the first)."""
    if any(size == 0 for size in t.shape[1:]):
        return 0
    return (sum((size - 1) * abs(st) for size, st in zip(t.shape[1:], t.stride()[1:])) + 1) * t.element_size()


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
