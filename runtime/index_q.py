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

from . import index_q_hadamard as hq
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
    # The Hadamard engines (SGLang, TokenSpeed; index_q_hadamard.py). After RoPE every row is rotated by the
    # natural-order 128-point Walsh-Hadamard transform (radix-2 butterflies, strides 1..64), times
    # fl(128^-0.5), rounded through bf16; the scale's amax floor is 1e-4 in both formats and its quotient a
    # division (amax / 448, amax / 6); E2M1 codes round ties toward zero and never store -0.
    HADAMARD = 8
    # the transform's sums in TokenSpeed's Triton order on sm_100 (TRITON_SM100_STAGES)
    TRITON_SM100_SUMS = 16
    TRITON_SM90_SUMS = 32  # ... on sm_90 (TRITON_SM90_STAGES); with TRITON_SM100_SUMS the latter wins
    ROPE_EVEN_FUSED = 64  # the odd term is fma(e, s, o*c) (SGLang), not fma(o, c, e*s)
    ROPE_UNFUSED = 128  # e*c - o*s and e*s + o*c, each product rounded (TokenSpeed's eager torch FP8 path)
    NOPE_ROTATED = 256  # the unrotated pairs go through the rotation with cos 1, sin 0 (TokenSpeed's Triton)
    UNROUNDED = 512  # no bf16 rounding after RoPE or after the transform: fp32 to the codes (SGLang FP8)
    # fp8: s = max(amax, 1e-4) / 448, not a power of two; codes RN(x * RN(1 / s)) clipped to +-448 (NaN to
    # +448); weights_out carries s (SGLang)
    FP8_LINEAR_SCALE = 1024
    # fp8: no scale, the codes are the values' e4m3 (weights_out carries none; TokenSpeed)
    FP8_UNSCALED = 2048
    # mxfp4 with INF_SATURATES: the saturated block's inverse is 0, not 2^-127 (TokenSpeed's ex2.approx.ftz)
    INF_INVERSE_ZERO = 4096


# Engine presets: (bits per format, I/O dtypes the engine's kernel takes, what it equals)
VLLM_SOURCE = "vllm 0.33.0 / 0.34.0, vllm/models/deepseek_v4"
_F = IndexQFlag
_TRITON = _F.SEPARATE_SCALES | _F.INF_SATURATES | _F.ROTATED_BF16
PRESETS: dict[str, tuple[dict[str, int], tuple[str, ...], str]] = {
    "vllm": (
        {"fp8_token": 0, "mxfp4": 0},
        ("bf16",),
        f"{VLLM_SOURCE}/nvidia/ops/fused_indexer_q_cutedsl.py (IndexerQFp8Kernel, IndexerQMxFp4Kernel): "
        "the CUDA default; bf16 rows only",
    ),
    "vllm-triton": (
        {"fp8_token": _TRITON, "mxfp4": _TRITON},
        ("bf16", "fp16"),
        f"{VLLM_SOURCE}/common/ops/fused_indexer_q.py (FusedIndexerQRope*TritonKernel): vLLM's fallback",
    ),
    "sglang": (
        {
            "fp8_token": _F.HADAMARD | _F.ROPE_EVEN_FUSED | _F.UNROUNDED | _F.FP8_LINEAR_SCALE,
            "mxfp4": _F.HADAMARD | _F.ROPE_EVEN_FUSED,
        },
        ("bf16",),
        "sglang 0.5.23, sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh (fused_q_indexer_rope_hadamard_quant "
        "and its FP4 twin)",
    ),
    "tokenspeed": (
        {
            "fp8_token": _F.HADAMARD | _F.ROPE_UNFUSED | _F.FP8_UNSCALED | _F.SEPARATE_SCALES,
            "mxfp4": _F.HADAMARD
            | _F.TRITON_SM100_SUMS
            | _F.NOPE_ROTATED
            | _F.INF_SATURATES
            | _F.INF_INVERSE_ZERO
            | _F.SEPARATE_SCALES,
        },
        ("bf16",),
        "tokenspeed-kernel 0.1.4: MXFP4 its Triton dsv4_fused_indexer_q_rope_hadamard_mxfp4 (the sums in its "
        "sm_100 order), FP8 the engine's torch path with fast_hadamard_transform",
    ),
}


def numerics_bits(numerics, io_dtype: str = "bf16", fmt: str = "fp8_token") -> int:
    """The kernels' `numerics` bits for None (the defaults: vLLM's CuTe-DSL kernel), a preset name
    ("vllm", "preset=sglang"; any case; its bits for format `fmt`), or bits given as an int."""
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
    if fmt not in bits:
        raise NumericsError(f"no index-Q format {fmt!r}{did_you_mean(fmt, list(FORMATS))}")
    if io_dtype not in dtypes:
        raise NumericsError(
            f"preset {name} is defined for {'/'.join(dtypes)} rows (its engine's kernel takes no {io_dtype})"
        )
    return int(bits[fmt])


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
    if bits & IndexQFlag.ROPE_UNFUSED:  # eager fp32: each product and the sum rounded
        re, ro = e * c - o * s, e * s + o * c
    else:
        re = nx.fma_f32(e, c, -(o * s))
        ro = nx.fma_f32(e, s, o * c) if bits & IndexQFlag.ROPE_EVEN_FUSED else nx.fma_f32(o, c, e * s)
    if not bits & IndexQFlag.UNROUNDED:
        rounding = torch.bfloat16 if bits & IndexQFlag.ROTATED_BF16 else q.dtype
        re, ro = nx.round_through(re, rounding), nx.round_through(ro, rounding)
    x[..., d - r :: 2], x[..., d - r + 1 :: 2] = re, ro
    if bits & IndexQFlag.NOPE_ROTATED:  # cos 1, sin 0: e - o*0 and o + e*0 (signed zeros, NaN, Inf change)
        e, o = x[..., : d - r : 2].clone(), x[..., 1 : d - r : 2].clone()
        x[..., : d - r : 2], x[..., 1 : d - r : 2] = e + -(o * 0.0), o + e * 0.0
    return x


def hadamard(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Step 1b (HADAMARD): the transform in the bits' stage order, times fl(128^-0.5), through bf16 unless
    UNROUNDED; x itself without HADAMARD."""
    if not bits & IndexQFlag.HADAMARD:
        return x
    stages = hq.NATURAL_STAGES
    if bits & IndexQFlag.TRITON_SM90_SUMS:
        stages = hq.TRITON_SM90_STAGES
    if bits & IndexQFlag.TRITON_SM100_SUMS:
        stages = hq.TRITON_SM100_STAGES
    y = hq.fwht_f32(x, stages) * hq.HADAMARD_SCALE
    return y if bits & IndexQFlag.UNROUNDED else nx.round_through(y, torch.bfloat16)


def _exponent_field(amax: torch.Tensor, floor: float, fp_max: float, divide: bool = False) -> torch.Tensor:
    """ceil(log2(fl(max(amax, floor) * fl(1/fp_max)))) + 127 from the float32 bits (with `divide`, of
    fl(max(amax, floor) / fp_max)): 255 for an Inf amax."""
    m = torch.maximum(amax, _f32(floor))
    r = m / _f32(fp_max) if divide else m * _f32(1.0 / fp_max)
    return (r.view(torch.int32).to(torch.int64) + 0x7FFFFF) >> 23


def _fp8(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, the row's scale p that weights_out carries) of rows x [T, H, D]."""
    if bits & IndexQFlag.FP8_UNSCALED:
        return nx.e4m3_bytes(x), torch.ones(x.shape[:-1])
    amax = nx.nan_ignoring_amax(x)
    if bits & IndexQFlag.FP8_LINEAR_SCALE:
        s = torch.maximum(amax, _f32(FP8_FLOOR)) / _f32(nx.E4M3_MAX)
        v = x * (1.0 / s)[..., None]
        v = torch.where(torch.isnan(v), torch.full_like(v, nx.E4M3_MAX), v.clamp(-nx.E4M3_MAX, nx.E4M3_MAX))
        return nx.e4m3_bytes(v), s
    e = _exponent_field(amax, FP8_FLOOR, nx.E4M3_MAX, bool(bits & IndexQFlag.HADAMARD))
    inv = _pow2_from_field(254 - e)
    if bits & IndexQFlag.INF_SATURATES:
        inv = torch.where(e == 255, torch.zeros_like(inv), inv)
    return nx.e4m3_bytes(x * inv[..., None]), _pow2_from_field(e)


def _mxfp4(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed E2M1 codes [T, H, D/2], UE8M0 bytes [T, H, D/32]) of rows x [T, H, D]."""
    t, h, d = x.shape
    blocks = x.reshape(t, h, d // MXFP4_BLOCK, MXFP4_BLOCK)
    hadamard_rule = bool(bits & IndexQFlag.HADAMARD)
    floor = FP8_FLOOR if hadamard_rule else MXFP4_FLOOR
    e = _exponent_field(nx.nan_ignoring_amax(blocks), floor, nx.E2M1_MAX, hadamard_rule)
    inv = _pow2_from_field(254 - e)  # 2^(127 - e); -Inf for an Inf block (e = 255)
    # saturated: ceil(log2) clamped to 127, and 1 / 2^127 the subnormal 2^-127 (or 0)
    if bits & IndexQFlag.INF_SATURATES:
        e = e.clamp(max=254)
        top = 0.0 if bits & IndexQFlag.INF_INVERSE_ZERO else 2.0**-127
        inv = torch.where(e == 254, _f32(top), _pow2_from_field(254 - e))
    y = blocks * inv[..., None]
    c = (hq.e2m1_codes_toward_zero(y) if hadamard_rule else nx.e2m1_codes(y)).reshape(t, h, d)
    return c[..., 0::2] | (c[..., 1::2] << 4), e.to(torch.uint8)


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
    bits = numerics_bits(numerics, io, fmt)
    t, h, d = q.shape
    x = hadamard(rotate(q, positions, cos_sin_cache, bits), bits)
    bad_token = (positions.long() < 0) | (positions.long() >= cos_sin_cache.shape[0])
    bad = bad_token[:, None].expand(t, h)
    w = weights.to(torch.float32)
    s1, s2 = (_f32(v) for v in host_scales(softmax_scale, head_scale, bits))
    if fmt == "fp8_token":
        codes, p = _fp8(x, bits)
        scales = None
    else:
        codes, scales = _mxfp4(x, bits)
        p = torch.ones(t, h)
        scales = torch.where(bad[..., None], torch.zeros_like(scales), scales)
    w_out = (w * p * s1 * s2) if bits & IndexQFlag.SEPARATE_SCALES else (w * s1) * p
    w_out = nx.round_through(w_out, weights_out_dtype).to(weights_out_dtype)
    codes = torch.where(bad[..., None], torch.zeros_like(codes), codes)
    w_out = torch.where(bad, torch.zeros_like(w_out), w_out)
    return codes, scales, w_out, int(bad_token.sum())
