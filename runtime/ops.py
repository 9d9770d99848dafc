"""The one-call entry points on CUDA tensors: validate once per shape, then one kernel call.

Per call, after the key's dict hit, the shape's native plan (native/fastpath.h) does the checks
below and the kernel call in C; where the native module is unavailable, the same checks run here
in Python. Per call, the hot path does the checks the compiled function cannot (M <= N, N' >= N, P >= H, the
cache's block size, a uint8 cache: TVM-FFI lets an int8 one through; a cache with blocks and a rope
table with rows), the overlap check (what the
call writes against itself and every input, on byte ranges), a dict hit for the shape's launchers
and one call. TVM-FFI itself checks dtypes, ranks, D, strides, 16-byte alignment,
devices and equal row counts of q_in, kv and positions (one symbolic token count in the compiled
signature) before launching. When it or the cheap checks refuse a call, the full validation
(validate.py) raises a typed error naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import native, overlap, validate
from .dispatch import MAX_BUCKET_LOG2, Runtime, default_runtime
from .errors import InputError
from .formats import Numerics, get_format
from .launch import LaunchConfig
from .variants import Conversions, q_flags

QKV_TENSORS = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
KV_TENSORS = ("kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
SCALES = ("kv_scale", "q_scale")  # their order in every signature that has them


@dataclass(frozen=True)
class ShapeCalls:
    """What a shape's calls share: per token-count bucket, the kernel and its arguments after the
    caller's tensors; the cache bytes per token the block-size check needs; and the native plan
    (native/fastpath.h: the same checks and call in C; None where the module is unavailable)."""

    calls: tuple[tuple[object, tuple], ...]
    bytes_per_token: int
    needs_kv_scale: bool
    native: object = None


def leading(tensors: tuple[str, ...], kv_scale, q_scale) -> tuple[str, ...]:
    """The caller's positional arguments: its tensors, then the scales it passes."""
    return tensors + tuple(n for n, t in zip(SCALES, (kv_scale, q_scale)) if t is not None)


def shape_calls(launchers, lead: tuple[str, ...], cache_format: str, head_dim: int, **values) -> ShapeCalls:
    fmt = get_format(cache_format)
    calls = tuple((la.fn, la.tail(lead, **values)) for la in launchers)
    bytes_per_token = fmt.bytes_per_token(head_dim)
    need = values["block_size"] * bytes_per_token
    if "q_in" in lead:
        plan = native_plan("one_call_qkv_plan", calls, need, fmt.needs_tensor_scale, "q_scale" in lead)
    else:
        plan = native_plan("one_call_kv_plan", calls, need, fmt.needs_tensor_scale, "norm_weight" in lead)
    return ShapeCalls(calls, bytes_per_token, fmt.needs_tensor_scale, plan)


def native_plan(kind: str, calls, *args):
    """The C plan of these calls (fastpath.c's `kind` constructor), or None: no native module, or a
    kernel that is not a TVM-FFI function (the CPU tests' Python stand-ins)."""
    fp = native.fastpath()
    if fp is None or not all(hasattr(fn, "__chandle__") for fn, _ in calls):
        return None
    return getattr(fp, kind)(list(calls), *args)


data_ptr = torch.Tensor.data_ptr  # unbound: anything but a tensor raises TypeError (-> full validation)
# A lazily negated view's stored bits are not its values: asked per call of every tensor (the native
# plan asks torch too, or reads the flag in place). A conjugation bit lives on complex tensors only,
# whose dtype the compiled function refuses before launching.
is_neg = torch.Tensor.is_neg

# The per-call overlap checks below compute each argument's [start, end) bytes from its data pointer,
# row count and row stride, in the layout the compiled function accepts (unit inner strides, compact
# ids, tables and scales): a call in another layout is refused by that function before it launches,
# so for every launched call these are the ranges overlap.check_disjoint computes. They are read on
# every call rather than cached per argument: proving a tensor unchanged costs as many reads (version
# counters do not exist for inference tensors, `.data =` bumps none) and q_in, kv are new every call.


def qkv_disjoint(
    q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale,
    n, h, d, n_out, p, m, kb, kw, need,
) -> bool:  # fmt: skip
    """What check_qkv checks of overlap, for any n: q_out's rows and k_cache's pages apart, and q_out
    and k_cache disjoint from each other and from every input (q_in too, unless it is q_out: in
    place, P == H). False also for a cos_sin_cache without rows (the validation's refusal)."""
    qo, s_qo, kc, s_kc = data_ptr(q_out), q_out.stride()[0], data_ptr(k_cache), k_cache.stride()[0]
    cb = cos_sin_cache.nbytes
    if (n_out > 1 and s_qo < p * d) or (kb > 1 and s_kc < need) or not cb:  # (no table rows: refused too)
        return False
    qi, s_qi, kp = data_ptr(q_in), q_in.stride()[0], data_ptr(kv)
    sp, pp, cp = data_ptr(slot_mapping), data_ptr(positions), data_ptr(cos_sin_cache)
    # rows' ranges: [start, start + (rows - 1) * row stride + row bytes), empty for no rows
    inputs = (
        (kp, kp + (n - 1) * 2 * kv.stride()[0] + 2 * d if n else kp),
        (sp, sp + slot_mapping.nbytes),
        (pp, pp + 8 * n),
        (cp, cp + cb),
    )
    if not (p == h and qi == qo and s_qi == s_qo):
        inputs += ((qi, qi + (n - 1) * 2 * s_qi + 2 * h * d if n else qi),)
    if kv_scale is not None or q_scale is not None:
        inputs += scale_ranges(kv_scale, q_scale)
    q_end = qo + ((n_out - 1) * s_qo + p * d) * (1 if q_scale is not None else 2) if n_out else qo
    return overlap.disjoint(qo, q_end, kc, kc + (kb - 1) * s_kc + kw, inputs)  # (kb >= 1: checked before)


def scale_ranges(*scales) -> tuple:
    """The byte ranges of the one-element float32 scales given."""
    return tuple((x, x + 4) for x in (data_ptr(t) for t in scales if t is not None))


def kv_disjoint(
    kv, norm_weight, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, m, d, ms, n_pos, kb, kw, need
) -> bool:
    """What check_kv checks of overlap, for any number of slots ms: k_cache's pages apart and k_cache
    disjoint from every input (kv [m, D], positions [n_pos], norm_weight [D]). False also for a
    cos_sin_cache without rows."""
    kc, s_kc, cb = data_ptr(k_cache), k_cache.stride()[0], cos_sin_cache.nbytes
    if (kb > 1 and s_kc < need) or not cb:  # (no table rows: refused too)
        return False
    kp, sp, pp, cp = data_ptr(kv), data_ptr(slot_mapping), data_ptr(positions), data_ptr(cos_sin_cache)
    inputs = (
        (kp, kp + (m - 1) * 2 * kv.stride()[0] + 2 * d if m else kp),
        (sp, sp + slot_mapping.nbytes),
        (pp, pp + 8 * n_pos),
        (cp, cp + cb),
    )
    if norm_weight is not None:
        w = data_ptr(norm_weight)
        inputs += ((w, w + 2 * d),)
    if kv_scale is not None:
        inputs += scale_ranges(kv_scale)
    return overlap.disjoint(kc, kc + (kb - 1) * s_kc + kw, 0, 0, inputs)  # (kb >= 1: checked before)


def _conversions(conversions: str | Conversions | None) -> Conversions | None:
    return Conversions(conversions) if isinstance(conversions, str) else conversions


def qnorm_rope_kv_insert(
    q_in,
    kv,
    q_out,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    eps,
    block_size,
    cache_format="fp8_ds_mla",
    kv_scale=None,
    q_scale=None,
    *,
    write_pad_heads=True,
    checked=True,
    numerics=None,
    apply_q_norm=True,
    apply_q_rope=True,
    q_layout="head_major",
    config: LaunchConfig | None = None,
    conversions=None,
    runtime: Runtime | None = None,
) -> ShapeCalls | None:
    """The fused op: writes q_out[:N, :H], zeroes the pad heads [H, P), and inserts rows
    t < len(slot_mapping) with slot >= 0 into k_cache. Nothing is allocated.

    CUDA tensors in eager mode: validate, pick the variant and config for this device and shape,
    launch (returns the shape's ShapeCalls, which the C++ torch op caches). CPU tensors, and every
    call while torch.compile traces, go through torch.ops.attn_prologue.qnorm_rope_kv_insert (the
    reference on CPU; returns None); `checked`, `config` and `conversions` then do not apply. A
    `runtime` given runs its kernels whatever the device (the CPU tests' stand-ins).
    `write_pad_heads=False` skips zeroing the pads in eager mode: only for a q_out whose pads are
    known to be zero (a buffer only kernels with this H write); bound ops track that themselves.
    `numerics`: the KV path's parity choices (formats.Numerics or its string form; None: the
    format's defaults). `apply_q_norm` / `apply_q_rope` False skip that Q step; `q_layout`
    "interleaved" writes FlashMLA's chunk-interleaved Q (variants.QLayout). Slot ids int64 or int32."""
    if torch.compiler.is_compiling() or not (runtime or getattr(q_in, "is_cuda", True)):
        check_scalar_types(eps, block_size)
        torch.ops.attn_prologue.qnorm_rope_kv_insert(
            q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, cache_format,
            kv_scale, q_scale, numerics_text(numerics), apply_q_norm, apply_q_rope, q_layout,
        )  # fmt: skip
        return None
    rt = runtime or default_runtime()
    fp = native.fastpath()
    if fp is not None:  # key, lookup, the checks below and the call, in C (native/fastpath.h)
        shape = fp.run_qkv(rt.calls, q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size,
                           cache_format, kv_scale, q_scale, write_pad_heads, checked, numerics, apply_q_norm,
                           apply_q_rope, q_layout, config, conversions)  # fmt: skip
        if shape is not None:
            return shape
    args = (q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, cache_format, kv_scale,
            q_scale, write_pad_heads, checked, numerics, apply_q_norm, apply_q_rope, q_layout, config, conversions)  # fmt: skip
    key = None
    try:
        n, h, d = q_in.shape
        n_out, p, _ = q_out.shape
        nwh = p if write_pad_heads else h
        key = fp.qkv_key(*args) if fp is not None else (
            q_in.get_device(), q_in.dtype, cache_format, d, h, nwh, cos_sin_cache.shape[1], kv_scale is not None,
            q_scale is not None, type(eps), type(block_size), eps, block_size, checked, numerics, apply_q_norm,
            apply_q_rope, q_layout, slot_mapping.dtype, config, conversions)  # fmt: skip
        shape = rt.calls[key]
        if shape.native is not None:
            raise LookupError  # its plan refused the call: the full validation below says why
        m, (kb, kw) = slot_mapping.shape[0], k_cache.shape
        ok = (
            m <= n
            and n_out >= n
            and p >= h
            and type(block_size) is int
            and block_size > 0
            and kb > 0
            and kw >= (need := block_size * shape.bytes_per_token)
            and eps >= 0
            and k_cache.dtype is torch.uint8  # the compiled function accepts an int8 cache (same width)
            and (kv_scale is not None) == shape.needs_kv_scale
            and qkv_disjoint(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale,
                             q_scale, n, h, d, n_out, p, m, kb, kw, need)
            and not q_out.requires_grad  # autograd would not see the write
            and not (is_neg(q_in) or is_neg(kv) or is_neg(q_out) or is_neg(k_cache) or is_neg(slot_mapping)
                     or is_neg(positions) or is_neg(cos_sin_cache) or (kv_scale is not None and is_neg(kv_scale))
                     or (q_scale is not None and is_neg(q_scale)))
        )  # fmt: skip
    except (LookupError, AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        request, device, h, p = validate.check_qkv(
            q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, cache_format,
            q_scale=q_scale, kv_scale=kv_scale, q_layout=q_layout,
        )  # fmt: skip
        flags = get_format(cache_format).numerics_flags(numerics)  # NumericsError for a choice it lacks
        # valid input: the try block computed the key; only the launchers for it were missing
        shape = rt.calls.get(key) if key is not None else None
        if shape is None:
            request = _with_conversions(request, conversions)
            launchers = rt.launchers(
                request,
                device,
                heads=h,
                written=nwh,
                config=config,
                slots32=slot_mapping.dtype == torch.int32,
                numerics=flags,
            )
            shape = shape_calls(
                launchers, leading(QKV_TENSORS, kv_scale, q_scale), cache_format, d, errors=rt.errors_buffer(device),
                eps=float(eps), block_size=block_size, n_write_heads=nwh, checked=int(bool(checked)),
                numerics=flags, q_flags=q_flags(bool(apply_q_norm), bool(apply_q_rope)),
            )  # fmt: skip
            if key is not None:
                rt.calls[key] = shape
    if n == 0:
        return shape
    fn, tail = shape.calls[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(n), inlined
    out = q_out if q_scale is None else q_out.view(torch.uint8)
    scales = (
        () if kv_scale is None and q_scale is None else tuple(t for t in (kv_scale, q_scale) if t is not None)
    )
    try:
        fn(q_in, kv, out, k_cache, slot_mapping, positions, cos_sin_cache, *scales, *tail)
    except Exception as exc:  # TVM-FFI refused an argument before launching: say precisely which
        validate.check_qkv(
            q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size, cache_format,
            q_scale=q_scale, kv_scale=kv_scale, q_layout=q_layout,
        )  # fmt: skip
        raise InputError(f"kernel argument check failed: {exc}") from exc
    return shape


def kv_rope_insert(
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size,
    cache_format="fp8_ds_mla",
    norm_weight=None,
    eps=1e-6,
    kv_scale=None,
    *,
    checked=True,
    numerics=None,
    compress_ratio=1,
    config: LaunchConfig | None = None,
    conversions=None,
    runtime: Runtime | None = None,
) -> ShapeCalls | None:
    """KV-only relatives: RoPE (after an optional weighted RMSNorm), quantize, insert. compress_ratio
    r > 1: the compressed-cache writer (and, with norm_weight, the indexer-key writer): only rows with
    (positions[t] + 1) % r == 0 are inserted, rotated at positions[t] // r * r. CUDA tensors in eager
    mode run here (returning the shape's ShapeCalls); CPU tensors and traced calls go through
    torch.ops.attn_prologue.kv_rope_insert, as for qnorm_rope_kv_insert."""
    if torch.compiler.is_compiling() or not (runtime or getattr(kv, "is_cuda", True)):
        check_scalar_types(eps, block_size)
        torch.ops.attn_prologue.kv_rope_insert(
            kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format, norm_weight, eps,
            kv_scale, numerics_text(numerics), compress_ratio,
        )  # fmt: skip
        return None
    rt = runtime or default_runtime()
    fp = native.fastpath()
    if fp is not None:
        shape = fp.run_kv(rt.calls, kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format,
                          norm_weight, eps, kv_scale, checked, numerics, compress_ratio, config, conversions)  # fmt: skip
        if shape is not None:
            return shape
    args = (kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format, norm_weight, eps, kv_scale,
            checked, numerics, compress_ratio, config, conversions)  # fmt: skip
    norm = () if norm_weight is None else (norm_weight,)
    key = None
    try:
        m, d = kv.shape
        key = fp.kv_key(*args) if fp is not None else (
            kv.get_device(), kv.dtype, cache_format, d, cos_sin_cache.shape[1], bool(norm), kv_scale is not None,
            type(eps), type(block_size), eps, block_size, checked, numerics, compress_ratio, slot_mapping.dtype,
            config, conversions)  # fmt: skip
        shape = rt.calls[key]
        if shape.native is not None:
            raise LookupError
        ms, n_pos, (kb, kw) = slot_mapping.shape[0], positions.shape[0], k_cache.shape
        ok = (
            ms <= m
            and ms <= n_pos
            and type(block_size) is int
            and block_size > 0
            and kb > 0
            and kw >= (need := block_size * shape.bytes_per_token)
            and eps >= 0
            and k_cache.dtype is torch.uint8
            and (kv_scale is not None) == shape.needs_kv_scale
            and kv_disjoint(kv, norm_weight, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, m, d,
                            ms, n_pos, kb, kw, need)
            and not (is_neg(kv) or is_neg(k_cache) or is_neg(slot_mapping) or is_neg(positions)
                     or is_neg(cos_sin_cache) or (norm_weight is not None and is_neg(norm_weight))
                     or (kv_scale is not None and is_neg(kv_scale)))
        )  # fmt: skip
    except (LookupError, AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        request, device = validate.check_kv(
            kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format,
            norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, compress_ratio=compress_ratio,
        )  # fmt: skip
        flags = get_format(cache_format).numerics_flags(numerics)
        shape = rt.calls.get(key) if key is not None else None
        if shape is None:
            launchers = rt.launchers(
                _with_conversions(request, conversions), device, config=config,
                slots32=slot_mapping.dtype == torch.int32, numerics=flags, compress_ratio=compress_ratio,
            )  # fmt: skip
            tensors = ("kv", "norm_weight", *KV_TENSORS[1:]) if norm else KV_TENSORS
            values = dict(
                errors=rt.errors_buffer(device), block_size=block_size, checked=int(bool(checked)),
                numerics=flags, compress_ratio=compress_ratio,
            )  # fmt: skip
            if norm:
                values["eps"] = float(eps)
            shape = shape_calls(launchers, leading(tensors, kv_scale, None), cache_format, d, **values)
            if key is not None:
                rt.calls[key] = shape
    m = slot_mapping.shape[0]
    if m == 0:
        return shape
    fn, tail = shape.calls[min((m - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(m), inlined
    scale = () if kv_scale is None else (kv_scale,)
    try:
        fn(kv, *norm, k_cache, slot_mapping, positions, cos_sin_cache, *scale, *tail)
    except Exception as exc:
        validate.check_kv(
            kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format,
            norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, compress_ratio=compress_ratio,
        )  # fmt: skip
        raise InputError(f"kernel argument check failed: {exc}") from exc
    return shape


def check_scalar_types(eps, block_size) -> None:
    """What the torch ops' schema would convert (a bool block_size to 1) or refuse untyped (a float
    one), refused here first; their values are checked by the validation behind the op."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, torch.SymInt)):
        raise InputError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int, torch.SymFloat)):
        raise InputError(f"eps must be a finite, non-negative float, got {eps!r}")


def numerics_text(numerics) -> str:
    """The torch ops' spelling of the parity choices ("" for the format defaults)."""
    n = Numerics.of(numerics)
    return "" if n is None else n.text()


def _with_conversions(request, conversions):
    """The request with the caller's conversions choice ("native" / "portable"), if any."""
    cv = _conversions(conversions)
    return request if cv is None else replace(request, conversions=cv)
