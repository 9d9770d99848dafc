"""Encoders and decoders of every cache format, and the paged record addressing.

`encode_tokens` turns already-rounded float32 token values into (data record, scale record)
bytes; `write_records` puts them into a paged cache without synchronizing the device;
`read_records` and `decode_tokens` go back from cache bytes to values, for tests and for users
debugging a cache.
"""

from __future__ import annotations

import torch

from . import numerics as nx
from .formats import (
    AmaxFloor,
    CacheFormat,
    E4m3Nan,
    ElementCode,
    Fp4Zero,
    InfScale,
    Numerics,
    ScaleCode,
    ScaleFloor,
)


# ---- quantization blocks ------------------------------------------------------------------
def _f32_const(value: float, like: torch.Tensor) -> torch.Tensor:
    """fl32(value) as a device tensor: torch.full needs no host copy (CUDA-graph capturable)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _scale_quotient(fmt: CacheFormat, amax: torch.Tensor) -> torch.Tensor:
    """amax / fp_max as the format computes it: an IEEE division, or a multiply by fl(1 / fp_max)."""
    if fmt.divide_by_fp_max:
        return amax / fmt.fp_max
    return amax * _f32_const(1.0 / fmt.fp_max, amax)


def amax_floor(fmt: CacheFormat, num: Numerics | None = None) -> float:
    """The floor of a block's exponent: the format's, or 1e-8 for AmaxFloor.E8 (TensorRT-LLM)."""
    return 1e-8 if num is not None and num.amax_floor is AmaxFloor.E8 else fmt.amax_floor


def block_exponent(fmt: CacheFormat, amax: torch.Tensor, num: Numerics | None = None) -> torch.Tensor:
    """The UE8M0 exponent per block (int32), exact from the float32 bits of the quotient:
    ScaleFloor.AMAX (and formats without the choice): e = ceil(log2(max(amax, floor) / fp_max));
    ScaleFloor.SCALE: e = ceil(log2(max(amax / fp_max, floor))). A block holding Inf: e saturates
    at 127, or is 128 with InfScale.OVERFLOW / WRAPPED (its byte: ue8m0_byte)."""
    num = fmt.resolve_numerics(num)
    floor = amax_floor(fmt, num)
    if num.scale_floor is ScaleFloor.SCALE:
        r = torch.clamp_min(_scale_quotient(fmt, amax), floor)
    else:
        r = _scale_quotient(fmt, torch.clamp_min(amax, floor))
    e = nx.ceil_log2_exponent(r)
    if fmt.exponent_clamp is not None:
        e = e.clamp(*fmt.exponent_clamp)
    if num.inf_scale in (InfScale.OVERFLOW, InfScale.WRAPPED):
        e = torch.where(torch.isinf(amax), torch.full_like(e, 128), e)
    return e


def scale_multiplier(e: torch.Tensor) -> torch.Tensor:
    """2^-e used to scale values into the element range. e is clamped to [-126, 126] first
    (a difference only for blocks holding Inf), so the multiplier is a normal float32; e = 128
    (InfScale.OVERFLOW / WRAPPED) gives 0: every element of the block times 0."""
    m = nx.pow2_f32(-e.clamp(-126, 126))
    return torch.where(e == 128, torch.zeros_like(m), m)


def ue8m0_byte(e: torch.Tensor, inf_scale: InfScale | None = None) -> torch.Tensor:
    """e + 127 as a byte; e = 128 is 255, or 126 with InfScale.WRAPPED (int32(+Inf) + 127, wrapped)."""
    b = (e + 127).clamp(0, 255)
    if inf_scale is InfScale.WRAPPED:
        b = torch.where(e == 128, torch.full_like(b, 126), b)
    return b.to(torch.uint8)


def _quantize_blocks(fmt: CacheFormat, x: torch.Tensor, num: Numerics | None = None):
    """x [M, n] float32 -> (element values scaled to the element range [M, n], exponents [M, nb])."""
    m, n = x.shape
    blocks = x.reshape(m, n // fmt.quant_block, fmt.quant_block)
    e = block_exponent(fmt, nx.nan_ignoring_amax(blocks, dim=-1), num)
    y = blocks * scale_multiplier(e).unsqueeze(-1)
    return y.reshape(m, n), e


def e4m3_bytes(y: torch.Tensor, nan: E4m3Nan | None = None) -> torch.Tensor:
    """E4M3 bytes of values in element units; a NaN element is the byte the E4m3Nan choice names."""
    b = nx.e4m3_bytes(y)
    if nan not in (None, E4m3Nan.NAN):
        b = torch.where(torch.isnan(y), torch.full_like(b, int(nan.value, 16)), b)
    return b


def e4m3_group_scales(fmt: CacheFormat, amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 scale bytes per group: e4m3_rne_satfinite of amax / 6 (the format's quotient), clamped
    first where the format clamps. NaN never reaches it: amax ignores NaN."""
    r = _scale_quotient(fmt, amax)
    if fmt.scale_clamp is not None:
        r = r.clamp(*fmt.scale_clamp)
    return nx.e4m3_bytes(r)


def _quantize_e4m3_groups(fmt: CacheFormat, x: torch.Tensor):
    """x [M, n] float32 -> (values in E2M1 units [M, n], scale bytes [M, n / 16])."""
    m, n = x.shape
    groups = x.reshape(m, n // fmt.quant_block, fmt.quant_block)
    sbytes = e4m3_group_scales(fmt, nx.nan_ignoring_amax(groups, dim=-1))
    s = nx.e4m3_values(sbytes).unsqueeze(-1)
    if fmt.divide_by_scale:
        y = groups / s  # IEEE division: an exact tie x = t * s stays a tie
    else:
        # a multiply by fl(1/s), 0 when s rounded to 0 (every code then encodes a zero)
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        y = groups * inv
    return y.reshape(m, n), sbytes


def e2m1_codes(y: torch.Tensor, fp4_zero: Fp4Zero | None) -> torch.Tensor:
    """E2M1 codes of values in element units, with the sign of zero results by the choice (EXACT is
    applied to the values before they are scaled: encode_tokens)."""
    codes = nx.e2m1_codes(y)
    if fp4_zero is Fp4Zero.POSITIVE:
        codes = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    return codes


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[M, n] codes -> [M, n/2] bytes, element 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)


def encode_tokens(
    fmt: CacheFormat,
    x: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    numerics: Numerics | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token values [M, D] float32 (as the cache quantizes them) -> (data record bytes
    [M, data_bytes], scale record bytes [M, scale_bytes]) as uint8. `numerics`: parity choices,
    None fields (or None) take the format's defaults."""
    num = fmt.resolve_numerics(numerics)
    m, d = x.shape
    nq, tail = fmt.dims(d)
    xq = x[:, :nq]
    if num.fp4_zero is Fp4Zero.EXACT:
        xq = xq + 0.0  # an exact -0.0 is quantized as +0.0 (-0.0 + 0.0 = +0.0; nothing else changes)
    parts = []
    scale = x.new_empty((m, 0), dtype=torch.uint8)
    if fmt.element is ElementCode.BF16:
        parts.append(xq.to(torch.bfloat16).view(torch.uint8).reshape(m, 2 * nq))
    elif fmt.scale is ScaleCode.TENSOR_F32:
        if kv_scale is None:
            raise ValueError(f"format {fmt.name} needs kv_scale (a float32 scale tensor)")
        y = xq / kv_scale.to(torch.float32).reshape(())
        parts.append(e4m3_bytes(y, num.e4m3_nan))
    elif fmt.scale is ScaleCode.E4M3:
        y, scale = _quantize_e4m3_groups(fmt, xq)
        parts.append(pack_e2m1(e2m1_codes(y, num.fp4_zero)))
    else:
        y, e = _quantize_blocks(fmt, xq, num)
        if fmt.element is ElementCode.E4M3:
            parts.append(e4m3_bytes(y, num.e4m3_nan))
        else:
            parts.append(pack_e2m1(e2m1_codes(y, num.fp4_zero)))
        if fmt.scale is ScaleCode.UE8M0:
            scale = ue8m0_byte(e, num.inf_scale)
        else:  # F32_POW2
            scale = nx.pow2_f32_bytes(e).reshape(m, 4 * e.shape[1])
    if fmt.scale_pad_bytes:
        scale = torch.cat((scale, scale.new_zeros((m, fmt.scale_pad_bytes))), dim=1)
    if tail:
        parts.append(x[:, nq:].to(torch.bfloat16).view(torch.uint8).reshape(m, 2 * tail))
    data = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return data, scale


def decode_tokens(
    fmt: CacheFormat,
    data: torch.Tensor,
    scale: torch.Tensor,
    head_dim: int,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data record bytes, scale record bytes) -> (values [M, D] float32, per-block scales [M, nb]).

    Values are dequantized (element value x block scale); the bf16 rope tail is returned as is.
    A UE8M0 byte of 255 decodes as NaN."""
    m = data.shape[0]
    nq, tail = fmt.dims(head_dim)
    scales = torch.ones((m, 0), dtype=torch.float32, device=data.device)
    if fmt.element is ElementCode.BF16:
        vals = data[:, : 2 * nq].contiguous().view(torch.bfloat16).to(torch.float32)
    elif fmt.scale is ScaleCode.TENSOR_F32:
        if kv_scale is None:
            raise ValueError(f"format {fmt.name} needs kv_scale to decode")
        vals = nx.e4m3_values(data[:, :nq].contiguous()) * kv_scale.to(torch.float32).reshape(())
    else:
        if fmt.element is ElementCode.E4M3:
            elems = nx.e4m3_values(data[:, :nq].contiguous())
        else:
            elems = nx.e2m1_values(unpack_e2m1(data[:, : nq // 2]))
        nb = fmt.num_scales(head_dim)
        if fmt.scale is ScaleCode.UE8M0:
            scales = nx.ue8m0_values(scale[:, :nb])
        elif fmt.scale is ScaleCode.E4M3:
            scales = nx.e4m3_values(scale[:, :nb].contiguous())
        else:
            scales = scale[:, : 4 * nb].contiguous().view(torch.float32)
        vals = (elems.reshape(m, nb, fmt.quant_block) * scales.unsqueeze(-1)).reshape(m, nq)
    if tail:
        start = data.shape[1] - 2 * tail
        t = data[:, start:].contiguous().view(torch.bfloat16).to(torch.float32)
        vals = torch.cat((vals, t), dim=1)
    return vals, scales


# ---- paged addressing -------------------------------------------------------------------------
def record_byte_index(
    fmt: CacheFormat, head_dim: int, block_size: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For slots [M] (non-negative), the block index [M] and the byte columns inside the block of
    the data record [M, data_bytes] and the scale record [M, scale_bytes]. All int64."""
    slots = slots.to(torch.int64)
    block = torch.div(slots, block_size, rounding_mode="floor")
    o = slots - block * block_size
    db, sb = fmt.data_bytes(head_dim), fmt.scale_bytes(head_dim)
    ar_d = torch.arange(db, device=slots.device, dtype=torch.int64)
    ar_s = torch.arange(sb, device=slots.device, dtype=torch.int64)
    data_cols = fmt.data_offset(head_dim, block_size, o).unsqueeze(1) + ar_d
    scale_cols = fmt.scale_offset(head_dim, block_size, o).unsqueeze(1) + ar_s
    return block, data_cols, scale_cols


def write_records(
    k_cache: torch.Tensor,
    fmt: CacheFormat,
    head_dim: int,
    block_size: int,
    slots: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Write each row's records at its slot; rows with a negative slot leave every byte alone.

    Without a device sync a masked scatter cannot drop rows, so skipped rows are redirected: they
    write the first valid row's bytes to that row's location (a duplicate write of identical
    values), or, when no row is valid, the cache's own bytes back to block 0. Scatters with
    duplicate indices of identical values are deterministic, and no atomic is needed (torch.compile
    has none for uint8). Two valid rows with the same slot are undefined, as in the kernel. A `scale`
    narrower than the scale record writes its first bytes only (ScalePad.SKIP leaves the pad alone)."""
    if slots.shape[0] == 0:
        return
    valid = slots >= 0
    donor = torch.argmax(valid.to(torch.int32)).view(1)  # first valid row (0 when there is none)
    any_valid = valid.any()
    slots64 = slots.to(torch.int64)
    target = torch.where(
        valid,
        slots64,
        torch.where(any_valid, slots64.index_select(0, donor).clamp_min(0), torch.zeros_like(slots64)),
    )
    block, dcols, scols = record_byte_index(fmt, head_dim, block_size, target)
    for cols, new in ((dcols, data), (scols[:, : scale.shape[1]], scale)):
        if cols.shape[1] == 0:
            continue
        rows = block.unsqueeze(1).expand_as(cols)
        old = k_cache[rows, cols]
        values = torch.where(valid.unsqueeze(1), new, torch.where(any_valid, new.index_select(0, donor), old))
        k_cache.index_put_((rows, cols), values)


def read_records(
    k_cache: torch.Tensor, fmt: CacheFormat, head_dim: int, block_size: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Data and scale record bytes of the tokens at slots [M] (all non-negative)."""
    block, dcols, scols = record_byte_index(fmt, head_dim, block_size, slots)
    data = k_cache[block.unsqueeze(1).expand_as(dcols), dcols]
    scale = k_cache[block.unsqueeze(1).expand_as(scols), scols]
    return data, scale


def decode_cache(
    k_cache: torch.Tensor,
    fmt: CacheFormat,
    head_dim: int,
    block_size: int,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [M, D] and block scales of the tokens stored at slots: a cache debugging aid."""
    data, scale = read_records(k_cache, fmt, head_dim, block_size, slots)
    return decode_tokens(fmt, data, scale, head_dim, kv_scale)
