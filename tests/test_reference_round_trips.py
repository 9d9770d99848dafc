"""Round trips of every encoder (decode(encode(x)) within each format's error bound) and the NVFP4
groups exhaustively over the E4M3 scales and the E2M1 ties, against numpy's IEEE float32 (a declared
dependency)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attn_prologue import codecs
from attn_prologue.formats import get_format
from hypothesis import given, settings
from hypothesis import strategies as st

from .support.reference_oracles import (
    E2M1_POS,
    E4M3_POS,
    SETTINGS,
    nearest_code,
    token_values,
)

# =============================================================================================
# round trips: decode(encode(x)) error bounds
# =============================================================================================


def _check_e4m3_block_round_trip(name: str, x: torch.Tensor):
    fmt = get_format(name)
    d = x.shape[1]
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, d)
    nq = fmt.dims(d)[0]
    qb = fmt.quant_block
    floor = torch.tensor(fmt.amax_floor, dtype=torch.float32).item()
    for row in range(x.shape[0]):
        for blk in range(nq // qb):
            xs = x[row, blk * qb : (blk + 1) * qb].double()
            ds = dec[row, blk * qb : (blk + 1) * qb].double()
            s = scales[row, blk].item()
            # the scale is a power of two, and the smallest one with max(amax, floor) <= 448 s
            assert s > 0 and math.frexp(s)[0] == 0.5
            amax = max(xs.abs().max().item(), floor)
            assert amax <= 448 * s and amax > 224 * s, (amax, s)
            # Per element: e4m3 keeps 3 mantissa bits, so a normal result (|x / s| >= 2^-6) is off
            # by at most half an ulp = 2^-4 of its magnitude; a subnormal one (spacing 2^-9) by at
            # most 2^-10 in element units, i.e. 2^-10 * s. x / s is exact (power of two).
            err = (ds - xs).abs()
            bound = torch.maximum(xs.abs() * 2.0**-4, torch.full_like(xs, 2.0**-10 * s))
            assert (err <= bound).all(), (name, row, blk, (err - bound).max().item())
            # and it is the nearest e4m3 value (independent table, ties to even)
            el = data[row, blk * qb : (blk + 1) * qb].tolist()
            want = [nearest_code(v / s, E4M3_POS, 0x80) for v in xs.tolist()]
            assert el == want
    # the bf16 rope tail of fp8_ds_mla round-trips exactly
    if fmt.rope_tail_bf16:
        assert torch.equal(dec[:, nq:], x[:, nq:])


@settings(max_examples=80, **SETTINGS)
@given(token_values(512))
def test_round_trip_fp8_ds_mla(x):
    _check_e4m3_block_round_trip("fp8_ds_mla", x)


@settings(max_examples=80, **SETTINGS)
@given(token_values(512))
def test_round_trip_mxfp8(x):
    _check_e4m3_block_round_trip("mxfp8", x)


@settings(max_examples=120, **SETTINGS)
@given(token_values(128))
def test_round_trip_fp8_token(x):
    _check_e4m3_block_round_trip("fp8_token", x)


@settings(max_examples=120, **SETTINGS)
@given(token_values(128))
def test_round_trip_mxfp4(x):
    fmt = get_format("mxfp4")
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, 128)
    codes = codecs.unpack_e2m1(data)
    for row in range(x.shape[0]):
        for blk in range(4):
            xs = x[row, blk * 32 : (blk + 1) * 32].double()
            ds = dec[row, blk * 32 : (blk + 1) * 32].double()
            s = scales[row, blk].item()
            amax = max(xs.abs().max().item(), 6 * 2.0**-126)
            assert amax <= 6 * s and amax > 3 * s, (amax, s)
            # e2m1 spacing is 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]: the error of an element is
            # at most half the spacing where it lies, in units of s.
            y = xs.abs() / s
            half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
            assert ((ds - xs).abs() <= half_gap * s).all()
            want = [nearest_code(v / s, E2M1_POS, 0x8) for v in xs.tolist()]
            assert codes[row, blk * 32 : (blk + 1) * 32].tolist() == want


@settings(max_examples=60, **SETTINGS)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_round_trip_bf16_exact(seed, m):
    """Every bf16 value (any finite or infinite bit pattern) comes back bit for bit."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-32768, 32768, (m, 96), generator=g, dtype=torch.int32).to(torch.int16)
    bits[bits.view(torch.bfloat16).isnan()] = 0x3F80  # NaN payloads are not pinned (see golden)
    x = bits.view(torch.bfloat16).to(torch.float32)
    fmt = get_format("bf16")
    data, scale = codecs.encode_tokens(fmt, x)
    assert torch.equal(data.view(torch.int16), bits)  # little-endian bf16 bytes
    dec, _ = codecs.decode_tokens(fmt, data, scale, 96)
    assert torch.equal(dec.view(torch.int32), x.view(torch.int32))


@settings(max_examples=120, **SETTINGS)
@given(token_values(64, allow_big=False), st.floats(2.0**-12, 2.0**12, width=32))
def test_round_trip_fp8_tensor(x, sigma):
    """y = fl(x / sigma) (rel. error 2^-24), e4m3 (2^-4 relative or 2^-10 absolute, as above),
    decoded as fl(e4m3 * sigma) (rel. error 2^-24): bound max(2^-4 |x|, 2^-10 sigma) plus 2^-21
    (|x| + sigma). |x / sigma| beyond 464 (448 + half the top spacing) saturates to +-448."""
    fmt = get_format("fp8_tensor")
    kv_scale = torch.tensor(sigma, dtype=torch.float32)
    data, scale = codecs.encode_tokens(fmt, x, kv_scale)
    dec, _ = codecs.decode_tokens(fmt, data, scale, 64, kv_scale)
    xs, ds = x.double(), dec.double()
    y = xs / sigma
    big = y.abs() > 464
    sat = torch.tensor(448 * sigma, dtype=torch.float32).double()
    assert torch.equal(ds[big], torch.copysign(sat.expand_as(ds[big]), xs[big]))
    assert torch.equal(data[big], torch.where(xs[big] > 0, 0x7E, 0xFE).to(torch.uint8))
    bound = torch.maximum(xs.abs() * 2.0**-4, torch.full_like(xs, 2.0**-10 * sigma))
    bound = bound + 2.0**-21 * (xs.abs() + sigma)
    err = (ds - xs).abs()
    assert (err[~big] <= bound[~big]).all()


# =============================================================================================
# NVFP4 groups: exhaustive over the E4M3 scales and the E2M1 ties, against numpy + value tables
# =============================================================================================

E4M3_SCALES = [(v, b) for v, b in E4M3_POS if b >= 0x01]  # every positive finite e4m3 value
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _nvfp4_scale_oracle(name: str, amax: float) -> int:
    """The scale byte by the rules of formats.py, with numpy's IEEE float32 arithmetic and the
    e4m3 table: nvfp4_v41 e4m3(clamp(amax * fl(1/6), 2^-9, 448)), nvfp4_dsv4 e4m3(amax / 6)."""
    a = np.float32(amax)
    if name == "nvfp4_v41":
        q = float(np.clip(a * (np.float32(1) / np.float32(6)), np.float32(2.0**-9), np.float32(448)))
    else:
        q = float(a / np.float32(6))
    return nearest_code(q, E4M3_POS, 0x80)


def _nvfp4_code_oracle(name: str, x: float, s: float) -> int:
    """e2m1 code of x in units of s: x / s (nvfp4_v41) or x * fl(1/s) (nvfp4_dsv4, 0 when s = 0),
    ties to even, saturating; the sign of a zero result by the format's default Fp4Zero."""
    x32, s32 = np.float32(x), np.float32(s)
    if name == "nvfp4_v41":
        y = float(x32 / s32)
    else:
        y = float(x32 * (np.float32(1) / s32 if s32 != 0 else np.float32(0)))
    code = nearest_code(y, E2M1_POS, 0x8)
    signed = get_format(name).numerics.fp4_zero.value == "signed"
    return code if signed or code != 0x8 else 0


def _encode_groups(name: str, groups: list[list[float]]):
    """Pack 16-wide groups into 512-wide rows of the format's quantized dims (the rest zero);
    return (codes [G, 16], scale bytes [G]) of those groups."""
    fmt = get_format(name)
    per_row = fmt.num_scales(512)
    rows = -(-len(groups) // per_row)
    flat = torch.zeros(rows * per_row * 16, dtype=torch.float32)
    flat[: len(groups) * 16] = torch.tensor(groups, dtype=torch.float32).reshape(-1)
    tail = torch.zeros(rows, 512 - per_row * 16, dtype=torch.float32)
    x = torch.cat((flat.reshape(rows, per_row * 16), tail), dim=1)
    data, scale = codecs.encode_tokens(fmt, x)
    codes = codecs.unpack_e2m1(data[:, : per_row * 8].contiguous()).reshape(-1, 16)[: len(groups)]
    return codes, scale[:, :per_row].reshape(-1)[: len(groups)]


@pytest.mark.parametrize("name", ["nvfp4_v41", "nvfp4_dsv4"])
def test_nvfp4_scale_exhaustive_over_e4m3(name):
    """For every positive finite e4m3 scale value s and every midpoint m between neighbouring
    scales (and the 0 / 2^-9 midpoint): amax = 6 s, 6 m and their float32 neighbours give the
    oracle's scale byte. 6 s and 6 m are exact float32, so the midpoints test the scale's own
    ties (to the even mantissa) and the neighbours the quotient's rounding."""
    values = [0.0] + [v for v, _ in E4M3_SCALES]
    amaxes = []
    for lo, hi in zip(values, values[1:]):
        for q in (hi, (lo + hi) / 2):
            c = np.float32(6 * q)
            amaxes += [
                float(np.nextafter(c, np.float32(0))),
                float(c),
                float(np.nextafter(c, np.float32(1e9))),
            ]
    amaxes += [6 * 448.0 * 2, 1e30]
    groups = [[a] + [0.0] * 15 for a in amaxes]
    _, scales = _encode_groups(name, groups)
    want = [_nvfp4_scale_oracle(name, a) for a in amaxes]
    assert scales.tolist() == want
    assert set(want) >= {b for _, b in E4M3_SCALES}  # every scale byte is reached
    assert (0x00 in want) == (name == "nvfp4_dsv4")  # only FlashInfer's rule has no lower clamp


@pytest.mark.parametrize("name", ["nvfp4_v41", "nvfp4_dsv4"])
def test_nvfp4_codes_exhaustive_over_scales_and_ties(name):
    """Every positive finite e4m3 scale s (amax = 6 s sets it) with every E2M1 tie t * s and grid
    value of either sign: the codes are the oracle's (the division keeps exact ties, the
    reciprocal multiply of nvfp4_dsv4 moves some of them, see test_golden_nvfp4)."""
    groups, scales = [], []
    for s, _ in E4M3_SCALES:
        group = [6 * s] + [t * s for t in E2M1_TIES] + [-t * s for t in E2M1_TIES] + [-6 * s]
        groups.append(group)
        scales.append(s)
    for s, _ in E4M3_SCALES:  # the grid values and zeros at the same scales
        groups.append([6 * s] + [g * s for g, _ in E2M1_POS[:7]] + [-g * s for g, _ in E2M1_POS[:7]] + [-0.0])
        scales.append(s)
    codes, sbytes = _encode_groups(name, groups)
    assert sbytes.tolist() == [b for _, b in E4M3_SCALES] * 2
    want = [[_nvfp4_code_oracle(name, x, s) for x in g] for g, s in zip(groups, scales)]
    assert codes.tolist() == want
    if name == "nvfp4_dsv4":  # the reciprocal really moves ties somewhere (the test is not vacuous)
        div = [[_nvfp4_code_oracle("nvfp4_v41", x, s) for x in g] for g, s in zip(groups, scales)]
        assert sum(a != b for ra, rb in zip(want, div) for a, b in zip(ra, rb) if (a | b) & 7) > 10


@settings(max_examples=80, **SETTINGS)
@given(token_values(512), st.sampled_from(["nvfp4_v41", "nvfp4_dsv4"]))
def test_round_trip_nvfp4(x, name):
    """decode(encode(x)) within the NVFP4 bound per element: half the e2m1 spacing where x / s
    lies, in units of s (or the saturation |x| - 6 s beyond 6 s); a scale that rounded to 0
    (nvfp4_dsv4 only: amax / 6 <= 2^-10) loses the group. The bf16 tail comes back exactly."""
    fmt = get_format(name)
    data, scale = codecs.encode_tokens(fmt, x)
    dec, scales = codecs.decode_tokens(fmt, data, scale, 512)
    nq = fmt.dims(512)[0]
    xs = x[:, :nq].double().reshape(x.shape[0], -1, 16)
    ds = dec[:, :nq].double().reshape(x.shape[0], -1, 16)
    s = scales.double().unsqueeze(-1)
    amax = xs.abs().amax(-1, keepdim=True)
    if name == "nvfp4_v41":
        assert (s >= 2.0**-9).all() and (s <= 448).all()
    # the scale is within e4m3 rounding (2^-4 relative) of amax / 6, or a clamp / zero bound
    near = (s - amax / 6).abs() <= (amax / 6) * 2.0**-4 + 2.0**-10
    assert (near | (s == 448) | (s == 2.0**-9)).all()
    zero = s == 0
    assert (amax[zero] <= 6 * 2.0**-10).all() and (ds * zero == 0).all()
    y = xs.abs() / torch.where(zero, torch.ones_like(s), s)
    half_gap = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    bound = torch.maximum(half_gap * s, xs.abs() - 6 * s) + 2.0**-20 * xs.abs()
    err = (ds - xs).abs()
    assert ((err <= bound) | zero).all(), (err - bound).max().item()
    if fmt.rope_tail_bf16:
        assert torch.equal(dec[:, nq:], x[:, nq:])
