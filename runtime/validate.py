"""Validation of the caller's tensors, before anything is written.

Every entry point runs these checks on its slow path (first call of a shape, or when a cheap
per-call check or the compiled function's own argument check refuses a call); each failure is a
typed InputError / UnsupportedError naming the argument and what it must be.
"""

from __future__ import annotations

import math

import torch

from . import overlap
from .errors import InputError, UnsupportedError
from .formats import get_format
from .variants import (
    INTERLEAVED_PADDED_HEADS,
    IoDtype,
    Op,
    QLayout,
    QOut,
    Request,
    find,
)

SLOT_DTYPES = (torch.int64, torch.int32)

FP8 = torch.float8_e4m3fn


def _fail(msg: str):
    raise InputError(msg)


def _check_tensor(name: str, t, device: torch.device) -> None:
    """A tensor on the call's device whose stored bits are its values."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, expected {device} (every tensor of a call must be on one device)")
    if t.is_neg() or t.is_conj():
        refuse_lazy_view(name, t)


def refuse_lazy_view(name: str, t: torch.Tensor):
    """InputError for a lazily negated or conjugated view: its stored bits are not its values."""
    lazy, fix = ("negated", "resolve_neg") if t.is_neg() else ("conjugated", "resolve_conj")
    _fail(
        f"{name} is a lazily {lazy} view (its stored bits are not its values, and the kernels read and "
        f"write stored bits): pass a tensor without the bit, e.g. {name}.{fix}()"
    )


def _check_device(name: str, t: torch.Tensor) -> torch.device:
    """The call's device (that of its first tensor): CUDA (the kernels) or CPU (the reference)."""
    if t.device.type not in ("cuda", "cpu"):
        held = " (meta tensors hold no data: nothing would be written)" if t.device.type == "meta" else ""
        _fail(
            f"{name} is on {t.device}: the ops take CUDA tensors, or CPU tensors (the PyTorch reference){held}"
        )
    return t.device


def check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not 0 <= eps < math.inf:
        _fail(f"eps must be a finite, non-negative float, got {eps!r}")


def check_positive_int(name: str, value) -> None:
    """A count or size: a Python int > 0 (not a bool, a float or a NumPy integer)."""
    if type(value) is not int or value <= 0:
        _fail(f"{name} must be a positive int, got {value!r}")


def _check_aligned(name: str, t: torch.Tensor, align: int) -> None:
    if t.data_ptr() % align:
        _fail(
            f"{name} data pointer must be {align}-byte aligned (got address % {align} = {t.data_ptr() % align})"
        )


def _check_rows(name: str, t: torch.Tensor, ndim: int, head_dim: int, dtype) -> None:
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(f"{name} dtype must be {dtype}, got {t.dtype}")
    if t.shape[-1] != head_dim:
        _fail(f"{name} last dim must be head_dim={head_dim}, got {t.shape[-1]}")
    if t.stride(-1) != 1 or (ndim == 3 and t.stride(1) != head_dim and t.shape[1] > 1):
        _fail(f"{name} must be contiguous within a row (strides {t.stride()}, need (*, {head_dim}, 1))")
    if t.shape[0] > 1 and t.stride(0) % 8:
        _fail(f"{name} row stride {t.stride(0)} must be a multiple of 8 elements (16 bytes)")
    _check_aligned(name, t, 16)


def check_supported(request: Request) -> None:
    """UnsupportedError (the reason `list --why` gives, and the nearest generated variants, named
    without an arch) unless a module exists for the request on every arch; the dispatcher then
    finds the device's own."""
    find(request, None)


def check_common(
    *,
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size: int,
    cache_format: str,
    head_dim: int,
    rope_dim: int,
    io_dtype,
    device: torch.device,
    n_tokens: int,
    kv_scale=None,
    norm_weight=None,
) -> None:
    """Checks shared by every op; n_tokens is the row count positions must have."""
    fmt = get_format(cache_format)
    for name, t in (
        ("kv", kv),
        ("k_cache", k_cache),
        ("slot_mapping", slot_mapping),
        ("positions", positions),
        ("cos_sin_cache", cos_sin_cache),
    ):
        _check_tensor(name, t, device)
    _check_rows("kv", kv, 2, head_dim, io_dtype)
    if (
        slot_mapping.dtype not in SLOT_DTYPES
        or slot_mapping.dim() != 1
        or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1)
    ):
        _fail(
            f"slot_mapping must be a contiguous 1-D int64 or int32 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if (
        positions.dtype != torch.int64
        or positions.dim() != 1
        or (positions.numel() > 1 and positions.stride(0) != 1)
    ):
        _fail(
            f"positions must be a contiguous 1-D int64 tensor, got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.shape[0] != n_tokens:
        _fail(f"positions has {positions.shape[0]} rows, expected {n_tokens} (one per token)")
    m = slot_mapping.shape[0]
    if m > kv.shape[0]:
        _fail(f"slot_mapping has {m} rows but kv has only {kv.shape[0]} (need M <= rows of kv)")
    if m > n_tokens:
        _fail(f"slot_mapping has {m} rows, more than the {n_tokens} tokens")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        _fail(
            f"cos_sin_cache must be float32 [max_pos, {rope_dim}], got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.shape[0] == 0:
        _fail("cos_sin_cache has no rows: every position would be out of range")
    if not cos_sin_cache.is_contiguous():
        _fail("cos_sin_cache must be contiguous")
    _check_aligned("cos_sin_cache", cos_sin_cache, 16)
    check_positive_int("block_size", block_size)
    if k_cache.dtype != torch.uint8 or k_cache.dim() != 2:
        _fail(
            f"k_cache must be a 2-D uint8 view [num_blocks, block_bytes], got {k_cache.dtype} {tuple(k_cache.shape)}"
        )
    if k_cache.shape[0] == 0:
        _fail("k_cache has no blocks (shape (0, ...)): no slot could be written")
    if k_cache.stride(1) != 1 or (k_cache.shape[0] > 1 and k_cache.stride(0) % 16):
        _fail(
            f"k_cache must have byte stride 1 and a block stride that is a multiple of 16, got strides {k_cache.stride()}"
        )
    need = fmt.block_bytes(head_dim, block_size)
    if k_cache.shape[1] < need:
        _fail(
            f"k_cache block holds {k_cache.shape[1]} bytes but block_size={block_size} {cache_format} tokens need {need} "
            f"({fmt.bytes_per_token(head_dim)} per token): block_size is inconsistent with the cache"
        )
    if k_cache.shape[0] > 1 and k_cache.stride(0) < need:
        _fail(f"k_cache block stride {k_cache.stride(0)} is smaller than the {need} bytes of a block")
    _check_aligned("k_cache", k_cache, 16)
    if fmt.needs_tensor_scale:
        if kv_scale is None:
            _fail(
                f"cache format {cache_format} needs kv_scale (a float32 tensor with one element on {device})"
            )
        _check_scale("kv_scale", kv_scale, device)
    elif kv_scale is not None:
        _fail(f"cache format {cache_format} takes no kv_scale")
    if norm_weight is not None:
        _check_tensor("norm_weight", norm_weight, device)
        if (
            norm_weight.dtype != io_dtype
            or norm_weight.shape != (head_dim,)
            or not norm_weight.is_contiguous()
        ):
            _fail(
                f"norm_weight must be a contiguous [{head_dim}] {io_dtype} tensor, got {norm_weight.dtype} {tuple(norm_weight.shape)}"
            )
        _check_aligned("norm_weight", norm_weight, 16)


def _check_scale(name: str, t, device) -> None:
    _check_tensor(name, t, device)
    if t.dtype != torch.float32 or t.numel() != 1:
        _fail(f"{name} must be a float32 tensor with one element, got {t.dtype} {tuple(t.shape)}")


def check_qkv(
    q_in,
    kv,
    q_out,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    eps,
    block_size,
    cache_format,
    *,
    q_scale=None,
    kv_scale=None,
    q_layout: QLayout | str = QLayout.HEAD_MAJOR,
):
    """Validate a qnorm_rope_kv_insert call; returns (request, device, H, P)."""
    layout = check_q_layout(q_layout)
    if not isinstance(q_in, torch.Tensor):
        _fail(f"q_in must be a torch.Tensor, got {type(q_in).__name__}")
    device = _check_device("q_in", q_in)
    _check_tensor("q_in", q_in, device)
    io = IoDtype.of_torch(q_in.dtype)
    if io is None:
        _fail(f"q_in dtype must be bfloat16 or float16, got {q_in.dtype}")
    if q_in.dim() != 3:
        _fail(f"q_in must be [N, H, D], got shape {tuple(q_in.shape)}")
    n, h, d = q_in.shape
    rope_dim = (
        cos_sin_cache.shape[-1]
        if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() == 2
        else -1
    )
    _check_rows("q_in", q_in, 3, d, q_in.dtype)
    _check_tensor("q_out", q_out, device)
    if q_out.requires_grad:
        _fail(
            "q_out requires grad: the op writes it in place, which autograd would not record; pass one that "
            "does not (allocate it under torch.no_grad(), or q_out.requires_grad_(False) on a leaf)"
        )
    out_dtype = FP8 if q_scale is not None else q_in.dtype
    if q_out.dtype != out_dtype:
        hint = " (an FP8 q_out needs q_scale)" if q_out.dtype == FP8 else ""
        _fail(f"q_out dtype must be {out_dtype}, got {q_out.dtype}{hint}")
    if q_out.dim() != 3 or q_out.shape[2] != d:
        _fail(f"q_out must be [N', P, {d}], got shape {tuple(q_out.shape)}")
    if q_out.shape[0] < n:
        _fail(f"q_out has {q_out.shape[0]} rows, fewer than the {n} tokens of q_in")
    p = q_out.shape[1]
    if p < h:
        _fail(f"q_out has P={p} heads, fewer than the H={h} heads of q_in (need P >= H)")
    if (
        q_out.stride(2) != 1
        or (p > 1 and q_out.stride(1) != d)
        or (q_out.shape[0] > 1 and (q_out.stride(0) % 16 or q_out.stride(0) < p * d))
    ):
        _fail(f"q_out must be [N', P, D] with rows contiguous and apart (strides {q_out.stride()})")
    _check_aligned("q_out", q_out, 16)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[0] != n:
        _fail(
            f"kv must be [N, D] with one row per token: got {tuple(getattr(kv, 'shape', ()))} for {n} tokens of q_in"
        )
    if q_scale is not None:
        _check_scale("q_scale", q_scale, device)
    check_eps(eps)
    if layout is QLayout.INTERLEAVED:
        if p not in INTERLEAVED_PADDED_HEADS:
            _fail(
                f"the interleaved Q layout is read by kernels that take P in {INTERLEAVED_PADDED_HEADS} heads, got P={p}"
            )
        if q_out.data_ptr() == q_in.data_ptr():
            _fail("an interleaved q_out cannot be written in place of q_in")
    request = Request(
        Op.QKV, d, rope_dim, cache_format, io, QOut.FP8 if q_scale is not None else QOut.IO, q_layout=layout
    )
    check_supported(request)
    check_common(
        kv=kv,
        k_cache=k_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        block_size=block_size,
        cache_format=cache_format,
        head_dim=d,
        rope_dim=rope_dim,
        io_dtype=q_in.dtype,
        device=device,
        n_tokens=n,
        kv_scale=kv_scale,
    )
    overlap.check_qkv(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale)
    return request, device, h, p


def check_kv(
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size,
    cache_format,
    *,
    norm_weight=None,
    eps=1e-6,
    kv_scale=None,
    compress_ratio=1,
):
    check_compress_ratio(cache_format, compress_ratio)
    if not isinstance(kv, torch.Tensor):
        _fail(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    _check_tensor("kv", kv, _check_device("kv", kv))
    io = IoDtype.of_torch(kv.dtype)
    if io is None:
        _fail(f"kv dtype must be bfloat16 or float16, got {kv.dtype}")
    if kv.dim() != 2:
        _fail(f"kv must be [M, D], got shape {tuple(kv.shape)}")
    rope_dim = (
        cos_sin_cache.shape[-1]
        if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() == 2
        else -1
    )
    check_eps(eps)
    request = Request(
        Op.KV_NORM if norm_weight is not None else Op.KV, kv.shape[1], rope_dim, cache_format, io
    )
    check_supported(request)
    check_common(
        kv=kv,
        k_cache=k_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        block_size=block_size,
        cache_format=cache_format,
        head_dim=kv.shape[1],
        rope_dim=rope_dim,
        io_dtype=kv.dtype,
        device=kv.device,
        n_tokens=positions.shape[0] if isinstance(positions, torch.Tensor) and positions.dim() == 1 else -1,
        kv_scale=kv_scale,
        norm_weight=norm_weight,
    )
    overlap.check_kv(kv, norm_weight, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale)
    return request, kv.device


def check_q_layout(q_layout) -> QLayout:
    try:
        return QLayout(q_layout)
    except ValueError:
        raise InputError(
            f"q_layout must be one of {', '.join(x.value for x in QLayout)}, got {q_layout!r}"
        ) from None


def check_compress_ratio(cache_format: str, compress_ratio) -> None:
    """A ratio the format's compressed writers take (formats.CacheFormat.compress_ratios)."""
    ratios = get_format(cache_format).compress_ratios
    if type(compress_ratio) is not int or compress_ratio not in ratios:
        raise UnsupportedError(
            f"compress_ratio={compress_ratio!r} is not one {cache_format} caches are written with; "
            f"supported: {', '.join(map(str, ratios))}"
        )
