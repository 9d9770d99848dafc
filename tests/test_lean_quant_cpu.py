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

CHUNK = 1 << 24


def patterns(start: int, count: int) -> torch.Tensor:
    """float32 values of the bit patterns [start, start + count)."""
    return torch.arange(start, start + count, dtype=torch.int64).to(torch.int32).view(torch.float32)


def assert_same_codes(y: torch.Tensor) -> None:
    want, got = nx.e2m1_codes(y), nx.e2m1_codes_by_magic(y)
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
        got = nx.quotient_by_reciprocal(x, s.expand_as(x), (1.0 / s).expand_as(x))
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
    assert torch.equal(nx.quotient_by_constant(amax, c).view(torch.int32), (amax / c).view(torch.int32))


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
