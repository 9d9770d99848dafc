"""Bit-exact CPU references of the DeepSeek-V4 indexer-Q prologue with a 128-point Hadamard rotation,
as SGLang 0.5.23 and TokenSpeed (tokenspeed-kernel 0.1.4) compute it (docs/index-q.md), each rule cited to its
source. The op serves both as the presets "sglang" and "tokenspeed" (index_q.PRESETS: their IndexQFlag bits);
these references are what those bits are checked against.

Inputs for both engines: q [T, H, 128] (bf16), positions [T] (int), cos_sin_cache [max_pos, 64] fp32 with
cos in columns 0..31 and sin in 32..63 (TokenSpeed's layout; SGLang reads the same numbers interleaved,
view_as_real(freqs_cis) = [cos0, sin0, cos1, sin1, ...], main_norm_rope.cuh:715-717), weights [T, H].
RoPE is GPT-J style on dims 64..127: pair j is (64 + 2j, 65 + 2j) with cos[j], sin[j].

Paths cited as sg:... are inside the sglang-0.5.23 wheel, ts:... inside tokenspeed_kernel-0.1.4; "ts-engine"
is TokenSpeed's model-side helper (runtime/layers/attention, deepseek_v4 kernel boundary module), read from
the public lightseekorg/tokenspeed sources, version not pinned by the kernel wheel.
"""

from __future__ import annotations

import torch

from .numerics import ceil_log2_exponent, e4m3_bytes, fma_f32, nan_ignoring_amax, round_through

HEAD_DIM = 128
ROPE_DIM = 64
# fl32(128 ** -0.5) = 0x3DB504F3. TokenSpeed: a Python float made fp32 (Triton constexpr, ts triton.py:1220;
# fast_hadamard_transform's float scale). SGLang: rsqrtf(128.f) (sg main_norm_rope.cuh:830/1047); ASSUMED to
# give the correctly rounded value (rsqrt.approx is only documented to 2 ulp; unverified on hardware).
HADAMARD_SCALE = torch.tensor(HEAD_DIM**-0.5, dtype=torch.float32)
SCALE_FLOOR = torch.tensor(1e-4, dtype=torch.float32)  # 1e-4f = 0x38D1B717 (both engines)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return round_through(x, torch.bfloat16)


def _rope_inputs(q, positions, cos_sin_cache):
    x = q.to(torch.float32)
    cs = cos_sin_cache.to(torch.float32)[positions.long()]  # [T, 64]
    cos = cs[:, None, : ROPE_DIM // 2]
    sin = cs[:, None, ROPE_DIM // 2 :]
    return x, cos, sin


def _signs() -> torch.Tensor:
    """H[i, o] = (-1)^popcount(i & o): Sylvester (natural) order, symmetric."""
    i = torch.arange(HEAD_DIM)
    b = i[:, None] & i[None, :]
    par = torch.zeros_like(b)
    for k in range(7):
        par ^= (b >> k) & 1
    return 1.0 - 2.0 * par.to(torch.float32)


# The transform's butterfly stages, each named by the index bit its pairs differ in (stride 2^bit).
NATURAL_STAGES = (0, 1, 2, 3, 4, 5, 6)
# The orders of triton_hadamard_sum's trees as butterfly stages (i = w + 4k): sm90 pairs k's bits 0..4 (i's
# bits 2..6) and then the warps (i's bits 1, 0); sm100 first k's bits 1..4 (the even and odd trees), then
# k's bit 0, then the warps. A tree of +-x_i grouped bit by bit is the transform with its stages in that
# order: the same fp32 additions, but for the sign of an exact zero sum (no E2M1 code shows it).
TRITON_SM90_STAGES = (2, 3, 4, 5, 6, 1, 0)
TRITON_SM100_STAGES = (3, 4, 5, 6, 2, 1, 0)


def fwht_f32(x: torch.Tensor, stages: tuple[int, ...] = NATURAL_STAGES) -> torch.Tensor:
    """Radix-2 fast Walsh-Hadamard transform in fp32, one stage per bit of `stages` (natural: strides 1, 2,
    4, ..., 64); each butterfly writes (lo + hi, lo - hi). SGLang: 2 in-lane stages then shfl_xor masks 1..16
    (element strides 4..64), lane with the mask bit takes other - own (sg main_norm_rope.cuh:808-829,
    1025-1046). fast_hadamard_transform (Dao-AILab design, ts-engine's choice on NVIDIA, ts
    ops/transform/faster_hadamard_transform) runs the same stages; fp32 add/sub is commutative, so every such
    schedule gives these bits. Unscaled."""
    n = x.shape[-1]
    for bit in stages:
        h = 1 << bit
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        lo, hi = y[..., 0, :], y[..., 1, :]
        x = torch.stack((lo + hi, lo - hi), dim=-2).reshape(*x.shape[:-1], n)
    return x


def _pairwise_tree(v: torch.Tensor, dim: int) -> torch.Tensor:
    """Balanced tree over `dim` (a power of two): adjacent pairs first, ((v0+v1)+(v2+v3))+..."""
    v = v.movedim(dim, -1)
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def triton_hadamard_sum(x: torch.Tensor, arch: str = "sm100") -> torch.Tensor:
    """tl.sum(rotated[:, None] * signs, axis=0) of ts triton.py:925 (unscaled), in the order the compiled
    kernel adds (tokenspeed_triton 3.8.10, num_warps=4; layout #blocked1 = threadsPerWarp [1, 32],
    warpsPerCTA [4, 1] on [128 in, 32 out]). Warp w holds rows i = w + 4k, k = 0..31, one output per lane.
    sm100 (LLVM IR uses <2 x float> adds): P_w = T(k even) + T(k odd), T a balanced tree over 16 leaves;
    sm90: P_w = balanced tree over k = 0..31. Then over warps: (P0 + P2) + (P1 + P3) (smem + shfl.bfly 2, 1)."""
    terms = x[..., :, None] * _signs()  # exact: +-x_i, [..., 128 in, 128 out]
    t = terms.reshape(*x.shape[:-1], 32, 4, HEAD_DIM)  # [..., k, w, o]: i = 4k + w
    if arch == "sm100":
        t = t.reshape(*x.shape[:-1], 16, 2, 4, HEAD_DIM)  # k = 2j + h
        p = _pairwise_tree(t[..., 0, :, :], -3) + _pairwise_tree(t[..., 1, :, :], -3)
    elif arch == "sm90":
        p = _pairwise_tree(t, -3)
    else:
        raise ValueError(f"arch must be 'sm100' or 'sm90', got {arch!r}")
    return (p[..., 0, :] + p[..., 2, :]) + (p[..., 1, :] + p[..., 3, :])


def e2m1_codes_toward_zero(y: torch.Tensor) -> torch.Tensor:
    """Both engines' software E2M1: clamp |y| to 6 (fminf/minnum: NaN -> 6), thresholds with ties going to
    the smaller magnitude (0.25->0, 0.75->0.5, 1.75->1.5, 3.5->3, 5->4: NOT round-to-even), sign bit only
    for y < 0 with a nonzero code (no -0; NaN -> +6 = 0x7). sg main_norm_rope.cuh:26-38,
    ts triton.py:832-857."""
    a = torch.where(torch.isnan(y), torch.full_like(y, 6.0), y.abs().clamp_max(6.0))
    code = torch.zeros_like(y, dtype=torch.uint8)
    for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code += (a > t).to(torch.uint8)
    neg = (y < 0) & (code != 0)
    return code | (neg.to(torch.uint8) << 3)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Even element in the low nibble: [..., 128] codes -> [..., 64] bytes."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _block_amax(y: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring max |y| per 32-element block (fmaxf / maxnum / redux.sync max); floored at 1e-4f."""
    amax = nan_ignoring_amax(y.reshape(*y.shape[:-1], 4, 32))
    return torch.maximum(amax, SCALE_FLOOR)


def sglang_index_q(q, positions, cos_sin_cache, weights, softmax_scale, head_scale, fmt="fp8"):
    """SGLang 0.5.23 fused_q_indexer_rope_hadamard_quant (fmt='fp8') / _fp4_quant (fmt='fp4'),
    sg kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh:701-1076, called from
    sg srt/layers/attention/dsv4/indexer.py:1238-1245 with weight_scale = softmax_scale * n_heads**-0.5
    (indexer.py:1216, a Python double handed to the kernel as float).

    Returns (q_values uint8, q_scales uint8 or None, weights_out fp32 [T, H]):
    fp8: q_values [T, H, 128] e4m3 bytes, no scale tensor (the scale is folded into weights_out).
    fp4: q_values [T, H, 64] packed E2M1, q_scales [T, H, 4] UE8M0 bytes (the kernel's int32 q_sf [T, H]
         seen as little-endian bytes, byte k = block k, main_norm_rope.cuh:1071-1073)."""
    x, cos, sin = _rope_inputs(q, positions, cos_sin_cache)
    re, im = x[..., ROPE_DIM::2], x[..., ROPE_DIM + 1 :: 2]
    # part 2 (cuh:794-797, 1013-1016): x_real*fxr - x_imag*fxi and x_real*fxi + x_imag*fxr in fp32.
    # ASSUMED nvcc contraction (default -fmad=true, no fast-math; utils/arch.py:146-156): the first product
    # is fused, fma(a, b, -(c*d)) and fma(a, b, c*d), as LLVM's DAG combiner picks (same as Triton below).
    new_re = fma_f32(re, cos, -(im * sin))
    new_im = fma_f32(re, sin, im * cos)
    rope = torch.stack((new_re, new_im), dim=-1).flatten(-2)
    if fmt == "fp4":
        rope = _bf16(rope)  # cuh:1017-1019: only the rope lanes round to bf16
    x = torch.cat((x[..., :ROPE_DIM], rope), dim=-1)
    y = fwht_f32(x) * HADAMARD_SCALE  # cuh:830-833: scale after the butterflies, fp32
    w = weights.to(torch.float32).reshape(x.shape[:2])
    ws = torch.tensor(softmax_scale * head_scale, dtype=torch.float32)  # static_cast<float>(double)
    if fmt == "fp8":
        # cuh:836-852: one scale per (token, head), NOT a power of two: max(1e-4f, amax) / 448 and its
        # IEEE reciprocal; q * inv rounded in fp32, clipped by fminf/fmaxf (NaN -> +448), then
        # cvt.rn.satfinite e4m3 (fp8x2 constructor, fp8_utils.cuh:43-53).
        amax = torch.maximum(nan_ignoring_amax(y), SCALE_FLOOR)
        scale = amax / 448.0
        inv = 1.0 / scale
        v = y * inv[..., None]
        v = torch.where(torch.isnan(v), torch.full_like(v, 448.0), v.clamp(-448.0, 448.0))
        return e4m3_bytes(v), None, (w * ws) * scale  # cuh:852: weight * weight_scale * scale
    if fmt != "fp4":
        raise ValueError(f"fmt must be 'fp8' or 'fp4', got {fmt!r}")
    y = _bf16(y)  # cuh:1051-1053
    # cuh:1056-1065: per 32 values, scale_raw = max(1e-4f, amax) / 6 (IEEE), UE8M0 = biased exponent
    # + (mantissa != 0) (fp8_utils.cuh:31-36), inverse 2^(127 - e) built from bits (fp8_utils.cuh:39-41;
    # amax = Inf gives e = 255 and inverse bits 0xFF800000 = -Inf).
    raw = _block_amax(y) / 6.0
    bits = raw.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    inv = ((254 - e) << 23).view(torch.float32)
    yb = y.reshape(*y.shape[:-1], 4, 32) * inv[..., None]
    codes = e2m1_codes_toward_zero(yb.reshape(y.shape))
    return _pack_nibbles(codes), e.to(torch.uint8), w * ws  # cuh:1074: no q scale in the weights


def tokenspeed_index_q(
    q, positions, cos_sin_cache, weights, softmax_scale, head_scale, fmt="mxfp4", arch="sm100"
):
    """TokenSpeed: fmt='mxfp4' is ts ops/attention/dsv4/triton.py:861-963 (dsv4_fused_indexer_q_rope_
    hadamard_mxfp4, :1172-1250; its serial four-block twin :967-1068 is taken only for T == 8192 on SM100 and
    has the same layouts, assumed to add alike); fmt='fp8' is ts-engine deepseek_v4_prepare_indexer_q_fp8 (torch eager +
    hadamard_transform, the SM90 path for DeepGEMM fp8 logits). DSv4 passes softmax_scale = 128**-0.5 and
    head_scale = n_heads**-0.5 (ts-engine docstring).

    Returns (q_values uint8, q_scales uint8 or None, weights_out fp32 [T, H]):
    mxfp4: [T, H, 64] packed E2M1 (even element low nibble), scales [T, H, 4] E8M0 bytes (the engine
           returns them as an int32 [T, H] view, triton.py:1247-1250).
    fp8:   [T, H, 128] e4m3 bytes of the rotated bf16 query cast directly (no per-row scale at all)."""
    x, cos, sin = _rope_inputs(q, positions, cos_sin_cache)
    w = weights.to(torch.float32).reshape(x.shape[:2])
    ss = torch.tensor(softmax_scale, dtype=torch.float32)
    hs = torch.tensor(head_scale, dtype=torch.float32)
    w_out = (w * ss) * hs  # two fp32 roundings: triton.py:958 (fp32 scalar args); ts-engine torch eager
    even, odd = x[..., 0::2], x[..., 1::2]
    if fmt == "fp8":
        # ts-engine _apply_gptj_rope_tail_rows: eager fp32 ops, each product rounded (no fma), nope untouched.
        c, s = cos, sin
        ne = even[..., 32:] * c - odd[..., 32:] * s
        no = even[..., 32:] * s + odd[..., 32:] * c
        rope = torch.stack((ne, no), dim=-1).flatten(-2)
        x = _bf16(torch.cat((x[..., :ROPE_DIM], rope), dim=-1))  # _deepseek_v4_hadamard_rotate: .to(bf16)
        # fast_hadamard_transform on bf16: fp32 butterflies, * fp32 scale, stored as bf16.
        y = _bf16(fwht_f32(x) * HADAMARD_SCALE)
        # .to(float8_e4m3fn): torch's cast (torch/headeronly/util/Float8_e4m3fn.h:171-240, torch 2.13):
        # RNE, finite overflow and Inf saturate to +-448, NaN -> 0x7F (GPU NaNs here are canonical, +).
        return e4m3_bytes(y), None, w_out
    if fmt != "mxfp4":
        raise ValueError(f"fmt must be 'mxfp4' or 'fp8', got {fmt!r}")
    # triton.py:901-915: every pair goes through the formula; nope pairs load cos = 1, sin = 0 (masked-load
    # defaults), so a nope -0 paired with a negative odd value becomes +0 and an odd Inf/NaN poisons its even
    # partner. PTX (sm_90 and sm_100): mul.f32 + neg + fma.rn.f32, i.e. fma(e, c, -(o*s)), fma(o, c, e*s).
    c = torch.cat((torch.ones_like(cos), cos), dim=-1)  # [T, 1, 64] per pair
    s = torch.cat((torch.zeros_like(sin), sin), dim=-1)
    ne = fma_f32(even, c, -(odd * s))
    no = fma_f32(odd, c, even * s)
    x = _bf16(torch.stack((ne, no), dim=-1).flatten(-2))  # triton.py:915
    y = _bf16(triton_hadamard_sum(x, arch) * HADAMARD_SCALE)  # triton.py:925-926
    # triton.py:930-938: e = ceil(log2(max(amax, 1e-4) / 6)) clamped to [-127, 127], byte e + 127,
    # inverse exp2(-e). Compiled as div.full.f32, libdevice log2f, ex2.approx.ftz. ASSUMED exact: amax is a
    # bf16 value or 1e-4f, so amax / 6 is never within an ulp of a power of two unless it is one exactly.
    # amax = Inf gives e = 127 and ex2.approx.ftz(-127) = 0 (flushed): every code is then 0 or 0x7 (NaN).
    e = ceil_log2_exponent(_block_amax(y) / 6.0)
    inv = torch.where(e >= 127, torch.zeros_like(e), (127 - e) << 23).view(torch.float32)
    yb = y.reshape(*y.shape[:-1], 4, 32) * inv[..., None]
    codes = e2m1_codes_toward_zero(yb.reshape(y.shape))
    return _pack_nibbles(codes), (e + 127).to(torch.uint8), w_out
