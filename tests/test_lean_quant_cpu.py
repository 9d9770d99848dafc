"""The leaner exact quantization arithmetic of the `lean_quant` launch knob, proven on the CPU against
the reference rules it replaces (the kernels run the same operations: runtime/device/kernel_lib.py;
their twins are in runtime/numerics.py):

- E2M1 rounding by an exponent-dependent magic add = numerics.e2m1_codes over all 2^32 float32 bit
  patterns (marker `exhaustive`, minutes, not in the default run; the default test covers every
  significand of the binades where codes change);
- RN(1/s) by rcp.approx and one Newton step, for every positive e4m3 s and every start within 4 ulps
  (rcp.approx.f32 is within 1 ulp: PTX ISA, "rcp");
- RN(x/s) by a reciprocal multiply and one exact correction, for every float32 significand of x and
  every significand of s the formats divide by (the 8 e4m3 significands, which hold 6 and 448), with
  the exponent argument below; the E2M1 codes of x/s for every e4m3 s over every exponent of x.

The exponent argument: for s = m 2^a and x = X 2^b, every intermediate (x r, q s - x, the corrected q)
is the one for (X, m) scaled by 2^(b-a) as long as none is subnormal or infinite, so the significand
test covers every such (x, s); outside it (|x/s| < 2^-100 or an infinite x) the codes are tested.
"""

from __future__ import annotations

import pytest
import torch
from attn_prologue import numerics as nx
from attn_prologue.launch import LaunchConfig

CHUNK = 1 << 24


def patterns(start: int, count: int) -> torch.Tensor:
    """float32 values of the bit patterns [start, start + count)."""
    return torch.arange(start, start + count, dtype=torch.int64).to(torch.int32).view(torch.float32)


def chunked(fn, x: torch.Tensor, size: int = 1 << 18) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed in pieces that stay in the CPU's caches: the numerics twins
    make tens of passes over their operands (this file's default run: 99 s whole, 33 s in pieces, on
    2 cores; `pytest --durations` before and after 1fcba63)."""
    return torch.cat([fn(part) for part in x.split(size)])


def assert_same_codes(y: torch.Tensor) -> None:
    want, got = chunked(nx.e2m1_codes, y), chunked(nx.e2m1_codes_by_magic, y)
    bad = (want != got).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} mismatches, e.g. {y[bad[0]].item()!r}: {want[bad[0]]} vs {got[bad[0]]}"
    )


def test_e2m1_magic_equals_the_reference_where_codes_change():
    """Every float32 with |y| in [2^-3, 8) (each binade holding a decision point or a saturation), both
    signs; the specials and zeros; and a sample of every other binade."""
    for sign in (0, 1 << 31):
        for exponent in range(124, 130):
            assert_same_codes(patterns(sign | exponent << 23, 1 << 23))
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45]
    )
    assert_same_codes(specials)
    g = torch.Generator().manual_seed(26)
    assert_same_codes(
        torch.randint(-(2**31), 2**31, (1 << 22,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


@pytest.mark.exhaustive
def test_e2m1_magic_equals_the_reference_on_every_float32():
    for start in range(0, 1 << 32, CHUNK):
        assert_same_codes(patterns(start - (1 << 31), CHUNK))


def e4m3_positive_values() -> torch.Tensor:
    """Every positive finite e4m3 value (bytes 0x01..0x7E) as float32."""
    return torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def test_newton_reciprocal_is_correctly_rounded_for_every_e4m3_scale():
    s = e4m3_positive_values()
    want = 1.0 / s
    for ulps in range(-4, 5):
        start = (want.view(torch.int32) + ulps).view(torch.float32)
        assert torch.equal(nx.reciprocal_newton(s, start), want), ulps


SIGNIFICANDS = torch.tensor(
    [1.0 + k / 8 for k in range(8)]
)  # of every e4m3 value; 6 = 1.5 * 4, 448 = 1.75 * 256


@pytest.mark.parametrize(
    "m", [pytest.param(m, marks=[] if m == 1.875 else [pytest.mark.slow]) for m in SIGNIFICANDS.tolist()]
)
def test_quotient_by_reciprocal_is_correctly_rounded_for_every_significand(m):
    """Every x in [1, 2) and in [-2, -1) against the IEEE quotient, for s = m and s = m * 2^-9."""
    x = patterns(127 << 23, 1 << 23)
    x = torch.cat((x, -x))
    for s in (torch.tensor(m), torch.tensor(m * 2.0**-9)):
        got = chunked(
            lambda part, s=s: nx.quotient_by_reciprocal(part, s.expand_as(part), (1.0 / s).expand_as(part)), x
        )
        assert torch.equal(got.view(torch.int32), (x / s).view(torch.int32)), float(s)


def test_quotient_codes_equal_the_reference_for_every_scale_and_exponent():
    """For every e4m3 s and x over all exponents (and zeros, infinities clamped as the kernel clamps
    them to +-6s first): E2M1 codes of the corrected product = codes of the IEEE quotient."""
    g = torch.Generator().manual_seed(1)
    mantissas = torch.randint(0, 1 << 23, (256,), generator=g)
    exps = torch.arange(0, 255)
    bits = (exps[:, None] << 23 | mantissas[None, :]).flatten()
    x = torch.cat((bits, bits | (1 << 31))).to(torch.int32).view(torch.float32)
    x = torch.cat((x, torch.tensor([0.0, -0.0, float("inf"), float("-inf")])))
    for s in e4m3_positive_values():
        xc = torch.minimum(torch.maximum(x, -6 * s), 6 * s)  # the kernel's clamp: |x / s| <= 6 codes 7
        want = nx.e2m1_codes(x / s)
        got = nx.e2m1_codes(nx.quotient_by_reciprocal(xc, s.expand_as(x), (1.0 / s).expand_as(x)))
        assert torch.equal(got, want), float(s)


@pytest.mark.parametrize("c", [6.0, 448.0])
def test_scale_quotient_is_the_ieee_quotient_from_tiny_to_infinite(c):
    """amax / c for every significand at the exponents the formats' floors leave (quotients >= 2^-126),
    the largest float32 and +Inf; below 2^-126 (amax under c * 2^-126) every format floors the quotient
    at 1e-4 or 2^-126, or rounds its e4m3 to zero, so any tiny result gives the same byte."""
    x = patterns(127 << 23, 1 << 23)
    amax = torch.cat([x * 2.0**k for k in (-117, -40, -13, 0, 9, 60, 126)])
    amax = torch.cat((amax, torch.tensor([0.0, 3.4028234663852886e38, float("inf")])))
    got = chunked(lambda part: nx.quotient_by_constant(part, c), amax)
    assert torch.equal(got.view(torch.int32), (amax / c).view(torch.int32))


def test_the_unsaturated_magic_rounding_is_used_only_where_the_kernel_clamped_first():
    """`e2m1_pack8(..., in_range=True)` skips the saturation (and the NaN rule) of the magic rounding,
    which is right only after quotients_by_e4m3 clamped x to +-6s: the E4M3-scaled formats that divide
    (nvfp4_v41). A UE8M0-scaled FP4 row (mxfp4) can hold NaN or Inf there, a multiplied NVFP4 group
    (nvfp4_dsv4) too, so they must saturate. Read from every generated module that packs E2M1."""
    from attn_prologue.formats import ScaleCode
    from attn_prologue.variants import generated, parse_name

    from .support.build import REPO

    seen = set()
    for name in generated():
        text = (REPO / "generated" / "kernels" / f"{name}.py").read_text()
        if "packed = e2m1_pack8(" not in text:
            continue
        f = parse_name(name).format
        clamped = f.scale is ScaleCode.E4M3 and f.divide_by_scale
        assert f"in_range={clamped}" in text and f"in_range={not clamped}" not in text, name
        seen.add((f.name, clamped))
    assert seen == {("mxfp4", False), ("nvfp4_dsv4", False), ("nvfp4_v41", True)}


# ---- E2M1 codes in float16 pairs (lean_quant with the rows in the I/O dtype: mxfp4, nvfp4_v41 on SM90) ----
def test_the_float16_rounding_twin_is_torchs_conversion():
    """numerics.round_f16 (the oracle of the float16 arithmetic below) against torch's float32 -> float16
    conversion on every float32 of [2^-26, 2^17) and its negatives: normals, subnormals, overflow."""
    x = patterns(101 << 23, 43 << 23)[::101]
    x = torch.cat((x, -x, torch.tensor([0.0, -0.0, float("inf"), float("-inf")])))
    assert torch.equal(nx.round_f16(x.double()).float(), x.to(torch.float16).float())


def test_float16_magic_codes_equal_the_reference_for_every_half_up_to_6():
    a = torch.arange(0, 0x4601, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    for sign in (1.0, -1.0):
        assert torch.equal(nx.e2m1_codes_in_f16(a, sign * a), nx.e2m1_codes((sign * a).float()))


def every_value(dtype) -> torch.Tensor:
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float16_quotient_codes_equal_the_ieee_quotient_codes(dtype):
    """Every value of the I/O dtype (NaN, Inf and zeros of both signs included) over every positive e4m3
    scale, with the float16 reciprocal RN(1/s) and either float16 neighbour (the kernel rounds
    rcp.approx.f32, within an ulp of 1/s, to float16): codes = e2m1 of the IEEE quotient (nvfp4_v41)."""
    x = every_value(dtype)
    for s in e4m3_positive_values():
        want = nx.e2m1_codes(x / s)
        for recip in float16_reciprocals(s):
            got = nx.e2m1_quotient_codes_in_f16(x, s.expand_as(x), recip)
            assert torch.equal(got, want), (float(s), float(recip))


def float16_reciprocals(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RN16(1/s) and both float16 neighbours: the kernel rounds rcp.approx.f32 (within an ulp of 1/s) to float16."""
    r = nx.round_f16(1.0 / s.double())
    return (
        r,
        torch.nextafter(r.half(), torch.tensor(0.0).half()).double(),
        torch.nextafter(r.half(), torch.tensor(1e4).half()).double(),
    )


def test_float16_reciprocal_codes_equal_the_reference_for_bf16_rows():
    """nvfp4_dsv4 (codes of x * fl(1/s), fl(1/s) the float32 reciprocal): every bf16 value (NaN, Inf and
    zeros of both signs included) over every positive e4m3 scale and the three float16 reciprocals; and
    the scale 0, whose codes are those of x * 0, over every value its group can hold (amax / 6 rounds to 0:
    |x| <= 6 * 2^-10, or NaN, which amax ignores)."""
    x = every_value(torch.bfloat16)
    off_quotient = 0  # pairs whose reference code is not the IEEE quotient's (the ties the move is for)
    for s in e4m3_positive_values():
        want = nx.e2m1_codes(x * (1.0 / s))
        off_quotient += int((nx.e2m1_codes(x / s) != want).sum())
        for recip in float16_reciprocals(s):
            got = nx.e2m1_reciprocal_codes_in_f16(x, s.expand_as(x), recip)
            assert torch.equal(got, want), (float(s), float(recip))
    assert off_quotient == 84  # (the figure docs/e2m1-float16.md quotes)
    small = x[(x.abs() <= 6 * 2.0**-10) | x.isnan()]
    zero = torch.zeros_like(small)
    assert torch.equal(
        nx.e2m1_reciprocal_codes_in_f16(small, zero, zero.double()), nx.e2m1_codes(small * 0.0)
    )


def test_float16_reciprocal_codes_are_not_exact_for_fp16_rows():
    """Why the fp16 modules of nvfp4_dsv4 keep the float32 path: an fp16 row's quotient can sit one float16
    ulp below a decision point that rounds up (0.75, 1.75, 3.5), where the tie move crosses it. Counted
    over every fp16 value and every scale of significand 1.875, with RN16(1/s): 84 pairs (the figure
    docs/e2m1-float16.md quotes)."""
    x = every_value(torch.float16)
    wrong = 0
    for s in e4m3_positive_values():
        if (nx._f16_bits(s.double()) & 0x0380) == 0x0380:
            recip = float16_reciprocals(s)[0]
            got = nx.e2m1_reciprocal_codes_in_f16(x, s.expand_as(x), recip)
            wrong += int((got != nx.e2m1_codes(x * (1.0 / s))).sum())
    assert wrong == 84


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float16_pack_codes_equal_the_reference_for_every_scaled_value(dtype):
    """y = x * 2^-e for every value x of the I/O dtype and every UE8M0 exponent e the mxfp4 rows can take
    (a row's e is ceil(log2(amax / 6)) in [-127, 127]): codes of the float16 path = e2m1 of y."""
    x = every_value(dtype)
    for e in range(-127, 128, 1):
        y = x * 2.0**-e
        assert torch.equal(nx.e2m1_pack_codes_in_f16(y), nx.e2m1_codes(y)), e


def test_bfloat16_pair_codes_equal_the_float32_codes_for_every_bf16_value_and_inverse():
    """The index_q bf16 path (e2m1_pack8_bf16_pairs): every bf16 value x (NaN, Inf, subnormals and zeros
    of both signs included) times every inverse scale a block can take, 2^-e for e in [-127, 127] (2^-127
    is also the saturated inverse), 0 (INF_INVERSE_ZERO) and -Inf (an Inf block), multiplied and clamped
    in bfloat16 pairs: the codes equal e2m1 of the same product in float32 (the float32 path's codes)."""
    x = every_value(torch.bfloat16)
    inverses = [2.0**-e for e in range(-127, 128)] + [0.0, float("-inf")]
    for inv in inverses:
        want = nx.e2m1_codes(x * torch.tensor(inv, dtype=torch.float32))
        got = nx.e2m1_pack_codes_in_bf16(x, torch.full_like(x, inv))
        assert torch.equal(got, want), inv


def test_bfloat16_rounding_twin_is_torchs_conversion():
    """round_bf16 (the twin's rounding) = torch's float32 -> bfloat16 conversion on values around every
    binade, ties, the subnormal range and the overflow edge."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2**31, (200000,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, torch.arange(0x7F7F0000, 0x7F800001, 97), torch.arange(0, 0x00810000, 4099)])
    v = (bits.to(torch.int32)).view(torch.float32)
    v = torch.cat([v, -v])
    v = v[~v.isnan()]  # (NaN != NaN; round_bf16 keeps NaN as it is)
    assert torch.equal(nx.round_bf16(v).float(), v.to(torch.bfloat16).float())


def test_float16_codes_run_only_where_the_rows_are_in_the_io_dtype():
    """The float16 path (proven above for I/O-dtype values only) is traced where lean_quant is on and the
    parity choices are folded to rows rounded through the I/O dtype: the format defaults (defaults_only)
    or a folded preset without RotatedRow.FP32. Run-time choices, or FP32 rows, keep the float32 path."""
    import dataclasses
    import inspect

    from attn_prologue.jit import compiler
    from attn_prologue.parity import NumericsFlag

    lean = dataclasses.replace(LaunchConfig(), lean_quant=True)
    expected = {
        LaunchConfig(): False,
        lean: False,
        dataclasses.replace(lean, defaults_only=True): True,
        dataclasses.replace(lean, folded_numerics=0): True,
        dataclasses.replace(lean, folded_numerics=int(NumericsFlag.FP32_ROTATED_ROW)): False,
    }
    for variant in (
        "kv_d512r64_nvfp4_v41_bf16_sm90",
        "kv_d128r64_mxfp4_fp16_sm90",
        "qkv_d128r64_mxfp4_bf16_sm90",
        "kv_d512r64_nvfp4_dsv4_bf16_sm90",
        "qkv_d512r64_nvfp4_dsv4_bf16_sm90",
    ):
        kernel = compiler.load_module(variant).Kernel
        assert {config: kernel(config).lean_io_rows for config in expected} == expected, variant
    # x * fl(1 / s) in float16 is exact for bf16 rows only (nvfp4_dsv4, above); on SM120 the same flag
    # picks the *_io function of the native conversions, the hardware cvt of lean_quant's quotients
    assert not hasattr(compiler.load_module("kv_d512r64_nvfp4_dsv4_fp16_sm90").Kernel(lean), "lean_io_rows")
    native = inspect.getsource(compiler.load_module("kv_d512r64_nvfp4_v41_bf16_sm120").e2m1_quotient_codes_io)
    assert "e2m1_pack8(kl.quotients_by_e4m3(x, s)" in native and "f16x2" not in native
