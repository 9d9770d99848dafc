"""The sparse indexer's Q prologue: GPT-J RoPE on the last R dims of each [D] head row, then FP8 or MXFP4
quantization with the index weights folded (docs/index-q.md). Its numerics as data (the `numerics` bits of
its kernels, the engine presets) and its PyTorch reference, which every kernel is compared against.

Per (token t, head h) row x of index Q [T, H, D] (D = 128, R = 64 in DeepSeek-V4):
  1. the pairs (x[D-R+2i], x[D-R+2i+1]) rotate by cos/sin of positions[t] (fma(e, c, -(o*s)),
     fma(o, c, e*s)), the rotated values rounded through the I/O dtype (bf16 under ROTATED_BF16);
  2. fp8_token: one power-of-two scale p = 2^ceil(log2(max(amax, 1e-4) * fl(1/448))) per row, codes
     e4m3(x * 2^-log2 p), no scale tensor: weights_out = weights[t, h] * softmax_scale * head_scale * p;
     mxfp4: a UE8M0 byte e = ceil(log2(max(amax, 6 * 2^-126) * fl(1/6))) + 127 per 32 values, codes
     e2m1(x * 2^(127-e)), two a byte (even element in the low nibble), weights_out = weights * softmax_scale *
     head_scale (float32 or bf16);
  3. a token whose position is outside the cos/sin table gets zeros in every output and is counted.
"""

from __future__ import annotations

import enum

import torch

from . import numerics as nx
from .errors import did_you_mean
from .parity import NumericsError
from .variants import INDEX_Q_FORMATS as FORMATS  # (element and block as the indexer keys' records)

FP8_FLOOR = 1e-4  # vLLM's amax floor of the indexer Q's FP8 scale
MXFP4_FLOOR = 6.0 * 2.0**-126  # and of the MXFP4 block scale (DeepSeek-V4's inference/kernel.py)
MXFP4_BLOCK = 32


class IndexQFlag(enum.IntFlag):
    """Bits of the index-Q kernels' run-time `numerics` argument: where the engines' kernels differ."""

    # weights_out = ((w * p) * softmax_scale) * head_scale, each product rounded (vLLM's Triton kernel);
    # unset: (w * fl(softmax_scale * head_scale)) * p, the scale product taken in double on the host
    # (vLLM's CuTe-DSL kernel). p = 1 for mxfp4.
    SEPARATE_SCALES = 1
    # an Inf amax saturates the scale as log2/exp2 do (fp8: p = Inf, codes x / Inf = x * 0; mxfp4: byte 254,
    # codes x * 2^-127); unset: the CuTe-DSL kernel's bit arithmetic, whose exponent field 255 gives p = Inf
    # and, for the codes, 2^(127 - e) with 254 - 255 wrapped in 32 bits: -Inf (mxfp4: byte 255)
    INF_SATURATES = 2
    # the rotated values rounded through bf16 whatever the I/O dtype (vLLM's Triton kernel on fp16 rows)
    ROTATED_BF16 = 4


# Engine presets: (bits, I/O dtypes the engine's kernel takes, what it equals)
VLLM_SOURCE = "vllm 0.33.0 / 0.34.0, vllm/models/deepseek_v4"
PRESETS: dict[str, tuple[int, tuple[str, ...], str]] = {
    "vllm": (
        0,
        ("bf16",),
        f"{VLLM_SOURCE}/nvidia/ops/fused_indexer_q_cutedsl.py (IndexerQFp8Kernel, IndexerQMxFp4Kernel): "
        "the CUDA default; bf16 rows only",
    ),
    "vllm-triton": (
        IndexQFlag.SEPARATE_SCALES | IndexQFlag.INF_SATURATES | IndexQFlag.ROTATED_BF16,
        ("bf16", "fp16"),
        f"{VLLM_SOURCE}/common/ops/fused_indexer_q.py (FusedIndexerQRope*TritonKernel): vLLM's fallback",
    ),
}


def numerics_bits(numerics, io_dtype: str = "bf16") -> int:
    """The kernels' `numerics` bits for None (the defaults: vLLM's CuTe-DSL kernel), a preset name
    ("vllm", "preset=vllm-triton"; any case), or bits given as an int."""
    if numerics is None:
        return 0
    if isinstance(numerics, bool) or not isinstance(numerics, (int, str)):
        raise NumericsError(f"index-Q numerics must be a preset name or int bits, got {numerics!r}")
    if isinstance(numerics, int):
        if numerics < 0 or numerics & ~int(sum(IndexQFlag)):
            raise NumericsError(f"index-Q numerics bits {numerics} are not IndexQFlag bits")
        return numerics
    name = numerics.strip().lower().removeprefix("preset=")
    if name not in PRESETS:
        raise NumericsError(
            f"no index-Q preset {numerics!r}{did_you_mean(name, list(PRESETS))}; presets: {', '.join(PRESETS)}"
        )
    bits, dtypes, _ = PRESETS[name]
    if io_dtype not in dtypes:
        raise NumericsError(
            f"preset {name} is defined for {'/'.join(dtypes)} rows (its engine's kernel takes no {io_dtype})"
        )
    return int(bits)


def host_scales(softmax_scale: float, head_scale: float, bits: int) -> tuple[float, float]:
    """The kernels' (weights_scale, head_scale) arguments: the two scales, or their product in double
    (rounded to float32 by the call) and 1."""
    if bits & IndexQFlag.SEPARATE_SCALES:
        return float(softmax_scale), float(head_scale)
    return float(softmax_scale) * float(head_scale), 1.0


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _pow2_from_field(e: torch.Tensor) -> torch.Tensor:
    """The float32 whose bits are e << 23 in 32-bit arithmetic: 2^(e-127) for e in 1..254, Inf for 255, and
    for e = -1 (254 - 255 wrapped, as the kernels' unsigned arithmetic has it) 0xFF800000, -Inf."""
    bits = (e.to(torch.int64) << 23) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def rotate(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, bits: int) -> torch.Tensor:
    """Step 1 as float32 [T, H, D]; positions outside the table rotate by row 0 (their outputs are zeroed)."""
    x = q.to(torch.float32).clone()
    d, r = q.shape[-1], cos_sin_cache.shape[-1]
    pos = positions.long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache.to(torch.float32)[pos]  # [T, R]
    c, s = cs[:, None, : r // 2], cs[:, None, r // 2 :]
    e, o = x[..., d - r :: 2], x[..., d - r + 1 :: 2]
    c, s = c.expand_as(e), s.expand_as(e)
    re = nx.fma_f32(e, c, -(o * s))
    ro = nx.fma_f32(o, c, e * s)
    rounding = torch.bfloat16 if bits & IndexQFlag.ROTATED_BF16 else q.dtype
    x[..., d - r :: 2] = nx.round_through(re, rounding)
    x[..., d - r + 1 :: 2] = nx.round_through(ro, rounding)
    return x


def _exponent_field(amax: torch.Tensor, floor: float, fp_max: float) -> torch.Tensor:
    """ceil(log2(fl(max(amax, floor) * fl(1/fp_max)))) + 127 from the float32 bits: 255 for an Inf amax."""
    r = torch.maximum(amax, _f32(floor)) * _f32(1.0 / fp_max)
    return (r.view(torch.int32).to(torch.int64) + 0x7FFFFF) >> 23


def index_q_reference(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    fmt: str = "fp8_token",
    numerics=None,
    weights_out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
    """(q codes uint8 [T, H, D] or [T, H, D/2], mxfp4 scale bytes [T, H, D/32] or None, weights_out [T, H],
    tokens whose position is outside the table)."""
    if fmt not in FORMATS:
        raise NumericsError(f"no index-Q format {fmt!r}{did_you_mean(fmt, list(FORMATS))}")
    io = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "bf16")
    bits = numerics_bits(numerics, io)
    t, h, d = q.shape
    x = rotate(q, positions, cos_sin_cache, bits)
    bad_token = (positions.long() < 0) | (positions.long() >= cos_sin_cache.shape[0])
    bad = bad_token[:, None].expand(t, h)
    w = weights.to(torch.float32)
    s1, s2 = (_f32(v) for v in host_scales(softmax_scale, head_scale, bits))
    saturate = bool(bits & IndexQFlag.INF_SATURATES)
    if fmt == "fp8_token":
        e = _exponent_field(nx.nan_ignoring_amax(x), FP8_FLOOR, nx.E4M3_MAX)
        p = _pow2_from_field(e)
        inv = _pow2_from_field(254 - e)
        if saturate:
            inv = torch.where(e == 255, torch.zeros_like(inv), inv)
        codes = nx.e4m3_bytes(x * inv[..., None])
        w_out = (w * p * s1 * s2) if bits & IndexQFlag.SEPARATE_SCALES else (w * s1) * p
        scales = None
    else:
        blocks = x.reshape(t, h, d // MXFP4_BLOCK, MXFP4_BLOCK)
        e = _exponent_field(nx.nan_ignoring_amax(blocks), MXFP4_FLOOR, nx.E2M1_MAX)
        inv = _pow2_from_field(254 - e)  # 2^(127 - e); -Inf for an Inf block (e = 255)
        if saturate:  # ceil(log2) clamped to 127, and 1 / 2^127 the subnormal 2^-127
            e = e.clamp(max=254)
            inv = torch.where(e == 254, _f32(2.0**-127), _pow2_from_field(254 - e))
        c = nx.e2m1_codes(blocks * inv[..., None]).reshape(t, h, d)
        codes = c[..., 0::2] | (c[..., 1::2] << 4)
        scales = e.to(torch.uint8)
        w_out = (w * s1) * s2
        scales = torch.where(bad[..., None], torch.zeros_like(scales), scales)
    w_out = nx.round_through(w_out, weights_out_dtype).to(weights_out_dtype)
    codes = torch.where(bad[..., None], torch.zeros_like(codes), codes)
    w_out = torch.where(bad, torch.zeros_like(w_out), w_out)
    return codes, scales, w_out, int(bad_token.sum())
