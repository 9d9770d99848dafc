"""PyTorch reference of the op family (docs/op.md): the contract every kernel is checked against.

Vectorized over tokens and heads, runs on CPU and CUDA, never synchronizes the device, and traces
under torch.compile(fullgraph=True). Two operation orders:

* ``order="kernel"`` (default) follows this project's kernels operation by operation: the sum of
  squares is a fused multiply-add chain per lane followed by a butterfly over the lanes of a row,
  RoPE uses `fma` (even' = fma(e, c, -(o*s)), odd' = fma(e, s, o*c), or fma(o, c, e*s) with
  RopeOrder.ODD_COS on the KV path), 1/sqrt is IEEE sqrt then IEEE division. Kernel outputs then match bit for bit, q_out and the bf16 rope tail included.
* ``order="eager"`` is the plain textbook formula (torch.sum, rsqrt, separate multiply and add);
  it agrees with the kernel order within one bf16 ulp on stored values.
"""

from __future__ import annotations

import torch

from . import codecs
from . import numerics as nx
from .formats import CacheFormat, NopeRotation, Numerics, RopeOrder, RotatedRow, ScalePad, get_format
from .variants import QLayout

VEC = 8  # elements per 128-bit access of a 16-bit dtype: the kernels' lane mapping unit
WARP = 32


def lanes_per_row(head_dim: int) -> int:
    """Lanes that share one row in the kernels: vector j of a row goes to lane j % lanes."""
    return min(WARP, head_dim // VEC)


def _check_order(order: str) -> None:
    if order not in ("kernel", "eager"):
        raise ValueError(f"order must be 'kernel' or 'eager', got {order!r}")


def sum_of_squares(x: torch.Tensor, order: str = "kernel") -> torch.Tensor:
    """sum(x^2) over the last dim (float32)."""
    if order == "eager":
        return (x * x).sum(dim=-1)
    d = x.shape[-1]
    lanes = lanes_per_row(d)
    per_lane = d // lanes
    # [..., V, lanes, VEC] -> [..., lanes, V * VEC]: each lane walks its vectors in order.
    xl = x.reshape(*x.shape[:-1], d // (lanes * VEC), lanes, VEC).transpose(-3, -2)
    xl = xl.reshape(*x.shape[:-1], lanes, per_lane)
    acc = torch.zeros(xl.shape[:-1], dtype=torch.float32, device=x.device)
    for i in range(per_lane):
        acc = nx.fma_f32(xl[..., i], xl[..., i], acc)
    while acc.shape[-1] > 1:  # butterfly: xor 1, 2, 4, ... pairs neighbours in order
        acc = acc[..., 0::2] + acc[..., 1::2]
    return acc[..., 0]


def rms_inverse(x: torch.Tensor, eps: float, order: str = "kernel") -> torch.Tensor:
    """1/sqrt(mean(x^2) + eps) over the last dim, keepdim."""
    ms = sum_of_squares(x, order) / x.shape[-1] + eps
    if order == "eager":
        return torch.rsqrt(ms).unsqueeze(-1)
    # IEEE sqrt (sqrt.rn.f32), then IEEE division. torch's eager CPU float32 sqrt is NOT correctly
    # rounded (off by one ulp for ~20% of inputs on AVX-512 builds); the float64 sqrt rounded to
    # float32 is (53 >= 2 * 24 + 2 bits makes the double rounding innocuous).
    return (1.0 / torch.sqrt(ms.double()).to(torch.float32)).unsqueeze(-1)


def rope_tail(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    order: str = "kernel",
    *,
    rope_order: RopeOrder | None = None,
    nope_rotation: NopeRotation | None = None,
) -> torch.Tensor:
    """GPT-J (interleaved pairs) RoPE on dims [D-R, D) of x [..., D]; cos/sin broadcast to
    [..., R/2]. RopeOrder.ODD_COS: odd' = fma(o, c, e*s) in the kernel order. NopeRotation.IDENTITY:
    the pairs of [0, D-R) go through the rotation with c = 1, s = 0, i.e. (e - o*0, o + e*0) in either
    order (adding a zero is exact, so only signed zeros, NaN and Inf are touched)."""
    d = x.shape[-1]
    head, tail = x[..., : d - rope_dim], x[..., d - rope_dim :]
    even, odd = tail[..., 0::2], tail[..., 1::2]
    if order == "eager":
        new_even = even * cos - odd * sin
        new_odd = even * sin + odd * cos
    else:
        new_even = nx.fma_f32(even, cos, -(odd * sin))
        if rope_order is RopeOrder.ODD_COS:
            new_odd = nx.fma_f32(odd, cos, even * sin)
        else:
            new_odd = nx.fma_f32(even, sin, odd * cos)
    rotated = torch.stack((new_even, new_odd), dim=-1).reshape(tail.shape)
    if nope_rotation is NopeRotation.IDENTITY:
        he, ho = head[..., 0::2], head[..., 1::2]
        head = torch.stack((he - ho * 0.0, ho + he * 0.0), dim=-1).reshape(head.shape)
    return torch.cat((head, rotated), dim=-1)


def _cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor, rope_dim: int):
    cs = cos_sin_cache.index_select(0, positions.to(torch.int64)).to(torch.float32)
    half = rope_dim // 2
    return cs[:, :half], cs[:, half:rope_dim]


# ---- the Q path ----------------------------------------------------------------------------
def q_values(
    q_in: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    *,
    apply_q_norm: bool = True,
    apply_q_rope: bool = True,
    order: str = "kernel",
) -> torch.Tensor:
    """Normalized and rotated Q [N, H, D] in float32 (not yet rounded); either step can be skipped."""
    _check_order(order)
    rope_dim = cos_sin_cache.shape[1]
    x = q_in.to(torch.float32)
    if apply_q_norm:
        x = x * rms_inverse(x, eps, order)
    if not apply_q_rope:
        return x
    cos, sin = _cos_sin(cos_sin_cache, positions, rope_dim)
    return rope_tail(x, cos.unsqueeze(1), sin.unsqueeze(1), rope_dim, order)


def q_layout_view(q_out: torch.Tensor, n: int, q_layout: QLayout | str = QLayout.HEAD_MAJOR) -> torch.Tensor:
    """q_out[:n] as [n, P, D] in the layout's element order: head-major is q_out itself; interleaved
    puts dim d of head h at (d // 16) * P * 16 + h * 16 + d % 16 of the token's P * D elements."""
    rows = q_out[:n]
    if QLayout(q_layout) is QLayout.HEAD_MAJOR:
        return rows
    p, d = q_out.shape[1], q_out.shape[2]
    chunks = rows.as_strided((n, d // 16, p, 16), (q_out.stride(0), 16 * p, 16, 1))  # [n, D/16, P, 16]
    return chunks.permute(0, 2, 1, 3)  # [n, P, D/16, 16]: flatten the last two for [n, P, D]


def store_q(
    q_out: torch.Tensor,
    q: torch.Tensor,
    *,
    q_scale=None,
    write_pad_heads: bool = True,
    q_layout: QLayout | str = QLayout.HEAD_MAJOR,
):
    """Round q [N, H, D] float32 into q_out's first N rows, heads [0, H) in the layout; zero heads [H, P)."""
    n, h, d = q.shape
    fp8 = q_out.dtype == torch.float8_e4m3fn
    if fp8:
        if q_scale is None:
            raise ValueError("an FP8 q_out needs q_scale (a float32 scale tensor)")
        values = nx.e4m3_bytes(q / q_scale.to(torch.float32).reshape(()))
    else:
        values = q.to(q_out.dtype)
    out = q_layout_view(q_out.view(torch.uint8) if fp8 else q_out, n, q_layout)
    if QLayout(q_layout) is QLayout.INTERLEAVED:
        values = values.reshape(n, h, d // 16, 16)
    out[:, :h] = values
    if write_pad_heads:
        out[:, h:] = 0


# ---- the KV path ---------------------------------------------------------------------------
def kv_values(
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    order: str = "kernel",
    numerics: Numerics | None = None,
) -> torch.Tensor:
    """The values a cache quantizes for kv rows [M, D]: (optional weighted RMSNorm, rounded through
    the I/O dtype), RoPE, rounded through the I/O dtype unless `numerics.rotated_row` is FP32.
    `numerics` (its RoPE fields: rope_order, nope_rotation, rotated_row; None: the defaults) is the
    resolved choice set, e.g. `fmt.resolve_numerics(...)`. float32 [M, D]."""
    _check_order(order)
    rope_dim = cos_sin_cache.shape[1]
    x = kv.to(torch.float32)
    if norm_weight is not None:
        x = nx.round_through((x * rms_inverse(x, eps, order)) * norm_weight.to(torch.float32), kv.dtype)
    cos, sin = _cos_sin(cos_sin_cache, positions, rope_dim)
    num = numerics or Numerics()
    rotated = rope_tail(
        x, cos, sin, rope_dim, order, rope_order=num.rope_order, nope_rotation=num.nope_rotation
    )
    if num.rotated_row is RotatedRow.FP32:
        return rotated
    return nx.round_through(rotated, kv.dtype)


def insert_kv(
    k_cache: torch.Tensor,
    fmt: CacheFormat,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    kv_scale: torch.Tensor | None = None,
    numerics: Numerics | None = None,
) -> None:
    num = fmt.resolve_numerics(numerics)
    data, scale = codecs.encode_tokens(fmt, values, kv_scale, num)
    if num.scale_pad is ScalePad.SKIP:  # the pad bytes keep what the cache held
        scale = scale[:, : fmt.num_scales(values.shape[1])]
    codecs.write_records(k_cache, fmt, values.shape[1], block_size, slot_mapping, data, scale)


# ---- the ops -------------------------------------------------------------------------------
def in_bounds(slot_mapping, positions, k_cache, cos_sin_cache, block_size):
    """(slots with every out-of-range row turned into a skip (-1), positions safe to read, and the
    mask of positions in [0, max_pos)): what the kernels do with out-of-range ids. A KV row whose slot
    is past the cache or whose position is outside the table is skipped; a Q token whose position is
    outside the table is written as zeros. Nothing is read or written out of bounds."""
    m = slot_mapping.shape[0]
    pos_ok = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    safe_positions = torch.where(pos_ok, positions, torch.zeros_like(positions))
    slots = slot_mapping.to(torch.int64)
    capacity = k_cache.shape[0] * block_size
    kv_ok = (slots < capacity) & pos_ok[:m]
    return torch.where(kv_ok, slots, torch.full_like(slots, -1)), safe_positions, pos_ok


def qnorm_rope_kv_insert(
    q_in: torch.Tensor,
    kv: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    block_size: int,
    cache_format: str = "fp8_ds_mla",
    *,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    apply_q_norm: bool = True,
    apply_q_rope: bool = True,
    q_layout: QLayout | str = QLayout.HEAD_MAJOR,
    write_pad_heads: bool = True,
    order: str = "kernel",
    numerics: Numerics | None = None,
) -> None:
    """The caller-owned op: q_out[:N, :H] and k_cache are written, nothing is allocated for the
    caller. Q for all N rows; KV for rows t < M = len(slot_mapping) with slot >= 0. `numerics`:
    the KV path's parity choices (None: the format's defaults, see formats.Numerics)."""
    fmt = get_format(cache_format)
    num = fmt.resolve_numerics(numerics)
    n = q_in.shape[0]
    m = slot_mapping.shape[0]
    slots, positions, pos_ok = in_bounds(slot_mapping, positions, k_cache, cos_sin_cache, block_size)
    q = q_values(
        q_in,
        positions[:n],
        cos_sin_cache,
        eps,
        apply_q_norm=apply_q_norm,
        apply_q_rope=apply_q_rope,
        order=order,
    )
    q = torch.where(pos_ok[:n].view(n, 1, 1), q, torch.zeros_like(q))
    vals = kv_values(kv[:m], positions[:m], cos_sin_cache, order=order, numerics=num)
    store_q(q_out, q, q_scale=q_scale, write_pad_heads=write_pad_heads, q_layout=q_layout)
    insert_kv(k_cache, fmt, vals, slots, block_size, kv_scale, num)


def kv_rope_insert(
    kv: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    block_size: int,
    cache_format: str = "fp8_ds_mla",
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
    order: str = "kernel",
    numerics: Numerics | None = None,
    compress_ratio: int = 1,
) -> None:
    """KV-only relatives: RoPE (after an optional weighted RMSNorm) and insert. With compress_ratio
    r > 1 (the compressed-cache and indexer-key writers) only rows with (positions[t] + 1) % r == 0
    are inserted, rotated at the group's first position positions[t] // r * r."""
    fmt = get_format(cache_format)
    num = fmt.resolve_numerics(numerics)
    m = slot_mapping.shape[0]
    slots, positions, _ = in_bounds(slot_mapping, positions, k_cache, cos_sin_cache, block_size)
    if compress_ratio != 1:
        boundary = (positions[:m] + 1) % compress_ratio == 0  # (out-of-range rows are skipped already)
        slots = torch.where(boundary, slots, torch.full_like(slots, -1))
        positions = torch.div(positions, compress_ratio, rounding_mode="floor") * compress_ratio
    vals = kv_values(
        kv[:m],
        positions[:m],
        cos_sin_cache,
        norm_weight=norm_weight,
        eps=eps,
        order=order,
        numerics=num,
    )
    insert_kv(k_cache, fmt, vals, slots, block_size, kv_scale, num)
