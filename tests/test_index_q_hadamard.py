"""Golden vectors of runtime/index_q_hadamard.py (SGLang 0.5.23 / TokenSpeed 0.1.4 indexer Q with a
Hadamard rotation), derived BY HAND in the comments from the cited kernel formulas (docs/index-q.md; the file and line of each fact are cited in attn_prologue.index_q_hadamard).

Shared facts: c = fl32(128 ** -0.5) = 0x3DB504F3 = 0.0883883461...; bf16(c) = 0x3DB5 = 0.08837890625
(the dropped half 0x04F3 < 0x8000). Position 0 of the test cache has cos = 1, sin = 0 (RoPE is the
identity there, up to signed zeros). H[i, o] = (-1)^popcount(i & o)."""

from __future__ import annotations

import math

import pytest
import torch
from attn_prologue import index_q_hadamard as hq
from attn_prologue import numerics as nx
from attn_prologue.index_q import FORMATS, IndexQFlag, index_q_reference, numerics_bits
from attn_prologue.index_q_hadamard import (
    HADAMARD_SCALE,
    e2m1_codes_toward_zero,
    fwht_f32,
    sglang_index_q,
    tokenspeed_index_q,
    triton_hadamard_sum,
)
from attn_prologue.parity import NumericsError
from attn_prologue.selftest import edge_rows

SS, HS = 128**-0.5, 64**-0.5
C = HADAMARD_SCALE.item()
BF16_C = 0.08837890625


def _cache(rows=4):
    cs = torch.zeros(rows, 64)
    cs[:, :32] = 1.0  # cos = 1, sin = 0 everywhere
    return cs


def _row(values: dict[int, float] | None = None, fill=0.0):
    q = torch.full((1, 1, 128), fill, dtype=torch.float32)
    for i, v in (values or {}).items():
        q[0, 0, i] = v
    return q.to(torch.bfloat16)


def _run(fn, q, fmt, w=1.0):
    weights = torch.full(q.shape[:2], w, dtype=torch.bfloat16)
    return fn(q, torch.zeros(q.shape[0], dtype=torch.int64), _cache(), weights, SS, HS, fmt)


def _signs_row(i):
    return [(-1) ** bin(i & o).count("1") for o in range(128)]


def test_hadamard_sign_convention_and_scale_constant():
    assert HADAMARD_SCALE.view(torch.int32).item() == 0x3DB504F3
    x = torch.zeros(128)
    x[5] = 1.0  # the transform of e_5 is row 5 of H: o=1 -> -, o=2 -> +, o=4 -> -, o=5 -> +
    assert fwht_f32(x).tolist() == _signs_row(5)
    for arch in ("sm100", "sm90"):
        assert triton_hadamard_sum(x, arch).tolist() == _signs_row(5)


def test_triton_sum_order_differs_from_butterfly_on_a_rounding_case():
    # x0 = 1, x4 = x12 = 2^-24, output o = 0 (all signs +).
    # FWHT: stride-4 stage gives 1 + 2^-24 -> 1 (tie, even), stride-8 adds x8 + x12 = 2^-24 -> 1 again.
    # TokenSpeed sm100: warp 0 holds rows 4k; x4 (k=1) and x12 (k=3) are both odd-k leaves, summed first
    # (2^-23), then E + O = 1 + 2^-23 exactly. sm90: leaves in k order, (x0 + x4) -> 1, then + x12 -> 1.
    x = torch.zeros(128)
    x[0], x[4], x[12] = 1.0, 2.0**-24, 2.0**-24
    assert fwht_f32(x)[0].item() == 1.0
    assert triton_hadamard_sum(x, "sm100")[0].item() == 1.0 + 2.0**-23
    assert triton_hadamard_sum(x, "sm90")[0].item() == 1.0


def test_single_nonzero_nope_value():
    q = _row({5: 1.0})  # y_o = sign(5, o) * c for every engine
    signs = _signs_row(5)
    # SGLang fp8: amax = c, scale = c / 448, v = c * fl(1 / scale) rounds to 448 -> 0x7E / 0xFE.
    v, s, w = _run(sglang_index_q, q, "fp8")
    assert s is None and v[0, 0].tolist() == [0x7E if g > 0 else 0xFE for g in signs]
    ws = torch.tensor(SS * HS, dtype=torch.float32)  # 2^-6.5 rounded: c / 8 exactly
    assert ws.item() == C / 8
    scale = torch.tensor(C, dtype=torch.float32) / 448.0
    assert w[0, 0].item() == (ws * scale).item()
    # fp4 / mxfp4: y = +-bf16(c) = +-0.08837890625; amax / 6 = 0.01473 in [2^-7, 2^-6) -> e = -6, byte
    # 121; y * 64 = 5.65625 > 5 -> code 7 (6.0). Byte of pair (0, 1) = 0x7 | 0xF << 4 = 0xF7.
    nib = [0x7 if g > 0 else 0xF for g in signs]
    packed = [nib[2 * k] | nib[2 * k + 1] << 4 for k in range(64)]
    for fn, fmt in ((sglang_index_q, "fp4"), (tokenspeed_index_q, "mxfp4")):
        v, s, w = _run(fn, q, fmt)
        assert v[0, 0].tolist() == packed and packed[0] == 0xF7
        assert s[0, 0].tolist() == [121] * 4
    # SGLang fp4 weights: w * fl(ss * hs) only; TokenSpeed: (w * fl(ss)) * fl(hs).
    assert _run(sglang_index_q, q, "fp4")[2].item() == C / 8
    assert (
        _run(tokenspeed_index_q, q, "mxfp4")[2].item()
        == (torch.tensor(SS, dtype=torch.float32) * torch.tensor(HS, dtype=torch.float32)).item()
    )
    # TokenSpeed fp8: bf16(c) = 1.4140625 * 2^-4 cast unscaled: nearest e4m3 is 1.375 * 2^-4
    # (|diff| 0.039 vs 0.086) -> exponent field 3, mantissa 011 -> 0x1B, negative 0x9B.
    v, s, _ = _run(tokenspeed_index_q, q, "fp8")
    assert s is None and v[0, 0].tolist() == [0x1B if g > 0 else 0x9B for g in signs]


def test_constant_row():
    q = _row(fill=1.0)  # FWHT: y_0 = 128 * c = 11.3137085, every other output +0 (1 - 1 = +0)
    v, _, _ = _run(sglang_index_q, q, "fp8")
    assert v[0, 0].tolist() == [0x7E] + [0] * 127  # y_0 * fl(448 / y_0) rounds to 448
    # fp4: bf16(11.3137) = 11.3125; /6 = 1.885 -> e = 1 (byte 128), 11.3125 / 2 = 5.66 -> code 7.
    # Blocks 1..3: amax 0 -> floor 1e-4; 1e-4 / 6 = 1.67e-5 in (2^-16, 2^-15) -> e = -15, byte 112.
    for fn, fmt in ((sglang_index_q, "fp4"), (tokenspeed_index_q, "mxfp4")):
        v, s, _ = _run(fn, q, fmt)
        assert v[0, 0].tolist() == [0x07] + [0] * 63
        assert s[0, 0].tolist() == [128, 112, 112, 112]
    # TokenSpeed fp8: 11.3125 = 1.4140625 * 8 -> 1.375 * 8 = 11: field 10, mantissa 011 -> 0x53.
    v, _, _ = _run(tokenspeed_index_q, q, "fp8")
    assert v[0, 0].tolist() == [0x53] + [0] * 127


def test_powers_of_two_row_is_exact_everywhere():
    # x_i = 2^(i mod 4): every partial sum is an integer < 2^24, so all orders agree with float64.
    x = torch.tensor([2.0 ** (i % 4) for i in range(128)])
    h64 = torch.tensor([_signs_row(i) for i in range(128)], dtype=torch.float64) @ x.double()
    assert torch.equal(fwht_f32(x).double(), h64)
    for arch in ("sm100", "sm90"):
        assert torch.equal(triton_hadamard_sum(x, arch).double(), h64)
    # Sum of 1+2+4+8 per group of four, 32 groups: y_0 = 480 (the other outputs: o in {1,2,3} with
    # o < 4 give 32 * (1 - 2 + 4 - 8) etc.; o >= 4 cancel to 0).
    assert h64[0].item() == 480.0 and h64[1].item() == 32 * (1 - 2 + 4 - 8) and h64[4].item() == 0.0


def test_nan_rows():
    q = _row({0: float("nan")})  # one NaN poisons all 128 outputs through the butterflies / sums
    # SGLang fp8: amax is NaN-ignoring (all NaN -> NaN, fmaxf(1e-4f, NaN) = 1e-4f); q * inv = NaN,
    # fminf(NaN, 448) = 448 -> 0x7E; weights use scale = 1e-4f / 448.
    v, _, w = _run(sglang_index_q, q, "fp8")
    assert v[0, 0].tolist() == [0x7E] * 128
    ws = torch.tensor(SS * HS, dtype=torch.float32)
    assert w.item() == (ws * (torch.tensor(1e-4, dtype=torch.float32) / 448.0)).item()
    # fp4 / mxfp4: NaN -> code 0x7 (+6) both nibbles -> 0x77; scale from the 1e-4 floor: byte 112.
    for fn, fmt in ((sglang_index_q, "fp4"), (tokenspeed_index_q, "mxfp4")):
        v, s, _ = _run(fn, q, fmt)
        assert v[0, 0].tolist() == [0x77] * 64 and s[0, 0].tolist() == [112] * 4
    v, _, _ = _run(tokenspeed_index_q, q, "fp8")  # torch cast: NaN -> 0x7F
    assert v[0, 0].tolist() == [0x7F] * 128


def test_inf_rows():
    q = _row({0: float("inf")})  # H[0, o] = +1: every output +Inf where no NaN is made
    # SGLang fp8: scale = Inf, inv = 0, Inf * 0 = NaN -> clipped to 448 -> 0x7E; weights = +Inf.
    v, _, w = _run(sglang_index_q, q, "fp8")
    assert v[0, 0].tolist() == [0x7E] * 128 and w.item() == math.inf
    # SGLang fp4: UE8M0 of Inf = 255, inverse bits (254 - 255) << 23 = 0xFF800000 = -Inf;
    # Inf * -Inf = -Inf -> code 7 with the sign bit -> 0xF, byte 0xFF; scale bytes 255.
    v, s, _ = _run(sglang_index_q, q, "fp4")
    assert v[0, 0].tolist() == [0xFF] * 64 and s[0, 0].tolist() == [255] * 4
    # TokenSpeed mxfp4: the nope pair (0, 1) goes through the RoPE formula with cos 1, sin 0:
    # odd' = fma(0, 1, Inf * 0) = NaN, so every output is NaN: codes 0x7, floor scale byte 112.
    v, s, _ = _run(tokenspeed_index_q, q, "mxfp4")
    assert v[0, 0].tolist() == [0x77] * 64 and s[0, 0].tolist() == [112] * 4
    # TokenSpeed fp8: nope untouched, outputs +Inf -> bf16 Inf -> torch's cast saturates: 0x7E.
    v, _, _ = _run(tokenspeed_index_q, q, "fp8")
    assert v[0, 0].tolist() == [0x7E] * 128


def test_negative_zero_row():
    q = _row(fill=-0.0)
    # y_0 sums every input, and the butterflies' lo - hi gives +0 from (-0) - (-0): y_0 = +0, and no
    # output is nonzero. fp8: amax 0 -> scale 1e-4f / 448; only 0x00 / 0x80 can appear, y_0 -> 0x00.
    v, _, w = _run(sglang_index_q, q, "fp8")
    assert v[0, 0, 0].item() == 0 and set(v[0, 0].tolist()) <= {0x00, 0x80}
    # E2M1 never stores -0 (sign only with a nonzero code): all bytes 0, scale byte 112.
    for fn, fmt in ((sglang_index_q, "fp4"), (tokenspeed_index_q, "mxfp4")):
        v, s, _ = _run(fn, q, fmt)
        assert v[0, 0].tolist() == [0] * 64 and s[0, 0].tolist() == [112] * 4


def test_e2m1_ties_go_toward_zero_and_nan_is_plus_six():
    y = torch.tensor(
        [0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.25, -0.3, -0.0, float("nan")]
    )
    y = torch.cat((y, torch.tensor([-math.inf])))
    assert e2m1_codes_toward_zero(y).tolist() == [0, 1, 1, 2, 3, 4, 5, 6, 7, 7, 0, 0x9, 0, 0x7, 0xF]


def _reference_f64(q, fmt):
    """Independent float64 formulation for integer-valued rows at position 0 (RoPE = identity, every
    Hadamard sum exact): y = bf16(fp32(H x * c)); the scale from math.log2, codes by nearest grid point with
    ties toward zero."""
    x = q.double().reshape(-1, 128)
    h = torch.tensor([_signs_row(i) for i in range(128)], dtype=torch.float64)
    y = ((x @ h) * C).float().bfloat16().double()
    if fmt == "fp8_tokenspeed":
        return y.clamp(-448, 448).float().to(torch.float8_e4m3fn).view(torch.uint8), None
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    blocks = y.reshape(-1, 4, 32)
    amax = blocks.abs().amax(-1).clamp_min(float(torch.tensor(1e-4, dtype=torch.float32)))
    e = torch.tensor([[math.ceil(math.log2(a / 6.0)) for a in row] for row in amax.tolist()])
    a = (blocks / torch.ldexp(torch.ones_like(amax), e)[..., None]).abs().clamp_max(6.0)
    dist = (a[..., None] - grid).abs()
    code = (dist + torch.arange(8) * 1e-12).argmin(-1)  # ties -> the smaller code
    code = code | (((blocks < 0) & (code > 0)).long() << 3)
    code = code.reshape(-1, 128)
    return (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8), (e + 127).to(torch.uint8)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_integer_rows_match_float64(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-12, 13, (3, 4, 128), generator=g).to(torch.bfloat16)
    want_v, want_s = _reference_f64(q, "fp4")
    for fn, fmt in ((sglang_index_q, "fp4"), (tokenspeed_index_q, "mxfp4")):
        v, s, _ = _run(fn, q, fmt)
        assert torch.equal(v.reshape(-1, 64), want_v) and torch.equal(s.reshape(-1, 4), want_s)
    want_v, _ = _reference_f64(q, "fp8_tokenspeed")
    assert torch.equal(_run(tokenspeed_index_q, q, "fp8")[0].reshape(-1, 128), want_v)


def test_random_rows_with_rope_stay_close_to_float64():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 128, generator=g).to(torch.bfloat16)
    ang = torch.rand(5, 32, generator=g, dtype=torch.float64) * 6.0
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1).float()
    pos = torch.tensor([1, 4])
    w = torch.randn(2, 3, generator=g).to(torch.bfloat16)
    x = q.double().clone()
    cs = cache.double()[pos][:, None]
    e, o = x[..., 64::2].clone(), x[..., 65::2].clone()
    x[..., 64::2] = e * cs[..., :32] - o * cs[..., 32:]
    x[..., 65::2] = e * cs[..., 32:] + o * cs[..., :32]
    h = torch.tensor([_signs_row(i) for i in range(128)], dtype=torch.float64)
    y = (x @ h) * 128**-0.5
    v, _, wo = sglang_index_q(q, pos, cache, w, SS, HS, "fp8")
    scale = y.abs().amax(-1) / 448.0
    deq = v.view(torch.float8_e4m3fn).double() * scale[..., None]
    assert torch.allclose(deq, y, rtol=2**-4, atol=scale.max().item() * 2**-9)
    assert torch.allclose(wo.double(), w.double() * SS * HS * scale, rtol=1e-6)
    v8, _, _ = tokenspeed_index_q(q, pos, cache, w, SS, HS, "fp8")
    assert torch.allclose(v8.view(torch.float8_e4m3fn).double(), y, rtol=2**-3, atol=2**-9)


# ---- the op's HADAMARD bits against the engine references above ----------------------------------------
def test_a_triton_tree_is_the_transform_with_its_stages_reordered():
    """triton_hadamard_sum's trees (read from the compiled kernel) group +-x_i bit by bit of i, so the kernel
    computes them as butterflies in TRITON_*_STAGES order: the same float32 additions. Rows of random
    magnitudes (2^-20 .. 2^20: every sum rounds) and exact zeros; the natural order differs on most sums."""
    g = torch.Generator().manual_seed(50)
    x = torch.randn(2000, 128, generator=g) * torch.exp2(
        torch.randint(-20, 20, (2000, 128), generator=g).float()
    )
    x[::7, ::3] = 0.0
    for arch, stages in (("sm90", hq.TRITON_SM90_STAGES), ("sm100", hq.TRITON_SM100_STAGES)):
        tree = (
            triton_hadamard_sum(x, arch) + 0.0
        )  # (+ 0.0: an exact zero sum's sign may differ, no code shows it)
        assert torch.equal(fwht_f32(x, stages) + 0.0, tree)
        assert (fwht_f32(x) + 0.0 != tree).float().mean() > 0.5


def _engine_inputs(t, h, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (t, h, 1), generator=g).float())
    edges = edge_rows(128)
    q[: len(edges), 0] = edges[:t]
    q[1, 1, 70], q[2, 2, 3], q[3, 3], q[4, 4, ::2], q[5, 5, 10] = math.inf, -math.inf, -0.0, -0.0, math.nan
    theta = torch.rand(300, 32, generator=g) * 6.3
    cache = torch.cat((theta.cos(), theta.sin()), -1)
    return (
        q.bfloat16(),
        torch.randint(0, 300, (t,), generator=g),
        cache,
        torch.randn(t, h, generator=g).bfloat16(),
    )


@pytest.mark.parametrize("preset, fmt", [(p, f) for p in ("sglang", "tokenspeed") for f in FORMATS])
def test_each_hadamard_preset_is_its_engine_reference(preset, fmt):
    """index_q_reference with the preset's bits (the composition of steps the kernel runs) gives the engine
    reference's bytes: random rows of mixed magnitudes, the conversions' edge rows (ties, floors, subnormals),
    Inf, -Inf, NaN and signed zeros in the nope and rope dims."""
    q, positions, cache, w = _engine_inputs(64, 16, seed=len(preset) + len(fmt))
    ours = index_q_reference(q, positions, cache, w, SS, HS, fmt, preset)
    if preset == "sglang":
        theirs = sglang_index_q(q, positions, cache, w, SS, HS, "fp8" if fmt == "fp8_token" else "fp4")
    else:
        theirs = tokenspeed_index_q(q, positions, cache, w, SS, HS, "fp8" if fmt == "fp8_token" else "mxfp4")
    assert torch.equal(ours[0], theirs[0])
    assert (ours[1] is None) == (theirs[1] is None) and (ours[1] is None or torch.equal(ours[1], theirs[1]))
    assert torch.equal(ours[2].view(torch.int32), theirs[2].reshape(ours[2].shape).view(torch.int32))


def test_the_kernels_e2m1_ties_down_rule_is_the_engines():
    """numerics.e2m1_codes_ties_down_by_magic (the kernel's fma.rp arithmetic, hadamard_lib) against the
    threshold rule: every float32 with |y| in [2^-3, 8) (the binades holding a decision point or the
    saturation), both signs, the specials, and a random sample of all bit patterns."""

    def same(y):
        assert torch.equal(nx.e2m1_codes_ties_down_by_magic(y), e2m1_codes_toward_zero(y))

    for sign in (0, 1 << 31):
        for exponent in range(124, 130):
            same(
                torch.arange(0, 1 << 23, dtype=torch.int64)
                .add(sign | exponent << 23)
                .to(torch.int32)
                .view(torch.float32)
            )
    same(torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-45, 0.25, -0.25]))
    g = torch.Generator().manual_seed(51)
    same(
        torch.randint(-(2**31), 2**31, (1 << 22,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


def _inverse_scales():
    """Every inverse scale an MXFP4 block takes: 2^-e for e in [-127, 127] (2^-127 also the saturated one),
    0 (INF_INVERSE_ZERO) and -Inf (an Inf block)."""
    return [2.0**-e for e in range(-127, 128)] + [0.0, -math.inf]


def test_round_half_down_is_nearest_even_of_the_shrunk_value_for_every_bf16_value_and_scale():
    """The kernels' short path to the ties-down codes (numerics.E2M1_TIES_DOWN_SHRINK): for every bf16 value x
    (NaN, Inf, subnormals, zeros of both signs) times every inverse scale, x * (inv * (1 - 2^-9)) in float32
    coded to nearest even -- directly (the SM100/SM120 conversion's rule, numerics.e2m1_codes) and through
    float16 pairs (the SM90 path, e2m1_pack_codes_in_f16) -- with zero codes unsigned, equals the engines'
    threshold rule on x * inv; so does the bfloat16 pair path with ties_down (fma of a * (1 - 2^-8)). The
    same codes without the shrink differ on the ties (the check can fail)."""
    x = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()

    def unsigned_zeros(codes):
        return torch.where((codes & 7) == 0, codes & 7, codes)

    for inv in _inverse_scales():
        want = e2m1_codes_toward_zero(x * torch.tensor(inv, dtype=torch.float32))
        shrunk = x * (torch.tensor(inv, dtype=torch.float32) * nx.E2M1_TIES_DOWN_SHRINK)
        assert torch.equal(unsigned_zeros(nx.e2m1_codes(shrunk)), want), inv
        assert torch.equal(unsigned_zeros(nx.e2m1_pack_codes_in_f16(shrunk)), want), inv
        assert torch.equal(nx.e2m1_pack_codes_in_bf16(x, torch.full_like(x, inv), ties_down=True), want), inv
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert not torch.equal(nx.e2m1_codes(ties), e2m1_codes_toward_zero(ties))
    assert not torch.equal(
        nx.e2m1_pack_codes_in_bf16(ties, torch.ones_like(ties)), e2m1_codes_toward_zero(ties)
    )


def test_the_hadamard_bits_are_defined_for_bf16_rows_only():
    assert numerics_bits("sglang", "bf16", "mxfp4") == IndexQFlag.HADAMARD | IndexQFlag.ROPE_EVEN_FUSED
    with pytest.raises(NumericsError, match="defined for bf16"):
        numerics_bits("tokenspeed", "fp16", "fp8_token")
