"""Every format on the GPU with its parity choices: each (format, op) the variant space has, run with
the format defaults, every engine preset the format has (presets.PRESETS) and all fields at their
last value at once; every other value of each field alone on the KV-only op. Block sizes 32/64/48/256
with pages padded the way vLLM pads them, DP padding, negative slots, zero / tiny / huge rows, exact
E2M1 ties, signed zeros beside negative and positive partners, NaN and Inf in the NoPE and rope dims.
Bit for bit against the reference on fresh random inputs with poisoned outputs (the whole cache
storage, page padding included, and the whole q_out are compared)."""

from __future__ import annotations

import pytest
import torch
from attn_prologue.formats import FORMATS, Numerics, get_format
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import ArchFamily, generated, parse_name

from .cases import Case, compare, describe_mismatch, make_inputs, run_kernel, run_reference

pytestmark = pytest.mark.gpu

FORMAT_NAMES = sorted(FORMATS)


def numerics_cases(fmt_name: str, singles: bool) -> list[str]:
    """The string spellings the ops take: the format defaults (""), each preset the format has, every
    field at its last value at once and (`singles`) every other value of each field alone."""
    f = get_format(fmt_name)
    choices = f.numerics_choices()
    out = ["", *(f"preset={p}" for p in f.presets())]
    out.append(Numerics(**{k: v[-1] for k, v in choices.items()}).text())
    if singles:
        out += [Numerics(**{k: v}).text() for k, values in choices.items() for v in values[1:-1]]
        out += [Numerics(**{k: values[-1]}).text() for k, values in choices.items()]
    return list(dict.fromkeys(out))


def ops_for(fmt_name: str) -> list[tuple[str, bool]]:
    """(op, FP8 q) pairs generated for the format on sm90."""
    out = set()
    for name in generated():
        v = parse_name(name)
        if v.cache_format == fmt_name and v.arch is ArchFamily.SM90 and v.io_dtype.value == "bf16":
            out.add((v.op.value, v.q_out.value == "fp8"))
    return sorted(out)


MATRIX = [
    (fmt, op, q8, num)
    for fmt in FORMAT_NAMES
    for op, q8 in ops_for(fmt)
    for num in numerics_cases(fmt, singles=op == "kv" and not q8)
]
# per (format, op, FP8 q): its case with every field at its last value (numerics_cases' third spelling)
MATRIX_LAST = {(f, o, q): numerics_cases(f, singles=False)[-1] for f, o, q, _ in MATRIX}


def tie_groups(x: torch.Tensor, fmt_name: str) -> None:
    """Write exact E2M1 ties into the first NoPE groups of every fifth row: group values t * s for
    every tie t of the E2M1 grid and a 6 * s that makes s = amax / 6 exact, so the NVFP4 scale is s and
    x / s hits the tie exactly: s a power of two (the same groups give exact ties under a UE8M0 scale),
    or 1.875 times one (the e4m3 significand where nvfp4_dsv4's x * fl(1/s) rounds 1.25, 2.5 and 5 up)."""
    fmt = get_format(fmt_name)
    if fmt.element.value != "e2m1":
        return
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], device=x.device)
    group = torch.cat((ties, -ties)).repeat(fmt.quant_block // 16)  # one block: 8 ties and their negatives
    for i, s in enumerate((2.0**-3, 1.0, 2.0**4, 1.875, 1.875 * 2.0**-6)):
        rows = x[i::5]
        width = min(4 * fmt.quant_block, fmt.dims(x.shape[1])[0])
        rows[:, :width] = (group * s).repeat(width // fmt.quant_block).to(x.dtype)


def specials(x: torch.Tensor) -> None:
    """NaN and +-Inf in the NoPE and rope dims of a few rows, one all-NaN row, signed zeros beside
    negative and positive partners (the NoPE rotation keeps or clears them), a row below every floor
    and one at the dtype's largest values."""
    d = x.shape[1]
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = float("-inf")
    x[5, d - 3] = float("nan")  # a rotated dim: RoPE spreads it to its pair
    x[6, :] = float("nan")
    x[4, :8] = torch.tensor([-0.0, -2.0, 1.0, -0.0, -0.0, 2.0, -1.0, -0.0])
    x[4, d - 8 :] = torch.tensor([-0.0, -2.0, 1.0, -0.0, -0.0, 2.0, -1.0, -0.0])
    x[7] *= 1e-9  # below the 1e-8 floor too
    x[8] = torch.finfo(x.dtype).max * torch.sign(x[8])


def check(case: Case, mutate=None, config=None):
    x = make_inputs(case)
    if mutate is not None:
        mutate(x)
    got = run_kernel(x, config=config)
    want = run_reference(x)
    torch.cuda.synchronize()
    diff = compare(got, want)
    assert all(v == 0 for v in diff.values()), f"{case}: {diff} {describe_mismatch(got, want)}"


@pytest.mark.parametrize(
    "fmt,op,q8,num", MATRIX, ids=[f"{f}-{o}{'-q8' if q else ''}-[{n}]" for f, o, q, n in MATRIX]
)
def test_parity_choices_block_sizes_and_edges(fmt, op, q8, num):
    edge_checks(fmt, op, q8, num)


# the formats whose arithmetic LaunchConfig.lean_quant changes: an E2M1 element or a divided quotient
LEAN = [m for m in MATRIX if get_format(m[0]).element.value == "e2m1" or get_format(m[0]).divide_by_fp_max]
LEAN_CONFIG = LaunchConfig.from_key("w4_u1_pdl1_nc1_cs_lq")


@pytest.mark.parametrize(
    "fmt,op,q8,num", LEAN, ids=[f"{f}-{o}{'-q8' if q else ''}-[{n}]" for f, o, q, n in LEAN]
)
def test_lean_quant_parity_choices_and_edges(fmt, op, q8, num):
    """The same rows with the leaner exact arithmetic: every parity choice, ties, NaN/Inf, tiny and huge."""
    edge_checks(fmt, op, q8, num, config=LEAN_CONFIG)


# a defaults_only config: the defaults' rows run its module (numerics folded to the defaults' constant),
# every other choice runs the twin the dispatcher binds instead (the same config compiled with them)
DEFAULTS_ONLY = [m for m in MATRIX if m[3] in ("", MATRIX_LAST[m[:3]])]
DEFAULTS_ONLY_CONFIG = LaunchConfig.from_key("w4_u1_pdl1_nc1_cs_lq_d")


@pytest.mark.parametrize(
    "fmt,op,q8,num", DEFAULTS_ONLY, ids=[f"{f}-{o}{'-q8' if q else ''}-[{n}]" for f, o, q, n in DEFAULTS_ONLY]
)
def test_defaults_only_modules_and_their_twins(fmt, op, q8, num):
    edge_checks(fmt, op, q8, num, config=DEFAULTS_ONLY_CONFIG)


# a module folded to an engine preset's bits (LaunchConfig.folded_numerics, `build --numerics`)
FOLDED = [m for m in MATRIX if m[3].startswith("preset=")]


@pytest.mark.parametrize(
    "fmt,op,q8,num", FOLDED, ids=[f"{f}-{o}{'-q8' if q else ''}-[{n}]" for f, o, q, n in FOLDED]
)
def test_modules_folded_to_each_preset(fmt, op, q8, num):
    bits = get_format(fmt).numerics_flags(num)
    edge_checks(fmt, op, q8, num, config=LaunchConfig.from_key(f"w4_u1_pdl1_nc1_cs_lq_n{bits}"))


# a KV row over 2 warps: the plain KV writers of D = 512 (Variant.row_splits), every parity choice
ROW_SPLIT = [m for m in MATRIX if m[1] == "kv" and get_format(m[0]).head_dim == 512]
ROW_SPLIT_CONFIG = LaunchConfig.from_key("w8_u1_pdl1_nc1_cs_r2")


@pytest.mark.parametrize(
    "fmt,op,q8,num", ROW_SPLIT, ids=[f"{f}-{o}{'-q8' if q else ''}-[{n}]" for f, o, q, n in ROW_SPLIT]
)
def test_row_split_parity_choices_and_edges(fmt, op, q8, num):
    edge_checks(fmt, op, q8, num, config=ROW_SPLIT_CONFIG)


def edge_checks(fmt, op, q8, num, config=None):
    f = get_format(fmt)
    d, r = f.head_dim, f.rope_dim
    align = 512 if fmt in ("mxfp8", "nvfp4_v41") else 576 if fmt == "fp8_ds_mla" else 16
    if f.head_dim is None:  # the full-cache rows: any D
        d, r = 128, 64
    base = dict(head_dim=d, rope_dim=r, cache_format=fmt, op=op, q_fp8=q8, numerics=num, h=8, p=16)
    for i, bs in enumerate((32, 64, 48, 256)):
        # DP padding (M < N) for qkv, negative slots, zero rows, vLLM-aligned page padding
        m = 37 if op == "qkv" else None
        check(
            Case(
                n=61,
                m=m,
                block_size=bs,
                page_align=align,
                negative_every=5,
                zero_rows=2,
                seed=100 + i,
                **base,
            ),
            config=config,
        )
    for scale in (1e-6, 1e-3, 3e4):  # tiny (both floors differ), small, huge (scales saturate)
        check(
            Case(n=40, block_size=64, zero_rows=1, scale=scale, seed=int(scale * 1e6) % 997, **base),
            config=config,
        )
    check(Case(n=30, block_size=48, seed=7, **base), mutate=lambda x: tie_groups(x.kv, fmt), config=config)
    check(
        Case(n=16, block_size=32, seed=8, **{**base, "h": 8, "p": 8}),
        mutate=lambda x: specials(x.kv),
        config=config,
    )
    if op != "qkv":  # a NaN row and a huge row next to each other in one warp's pass
        check(Case(n=40, block_size=64, seed=9, **base), mutate=lambda x: specials(x.kv), config=config)


@pytest.mark.parametrize("fmt", ["nvfp4_v41", "nvfp4_dsv4"])
def test_nvfp4_fp16_io(fmt):
    """fp16 I/O: the rotated row is rounded through fp16 (or not), the bf16 tail from it."""
    f = get_format(fmt)
    for num in numerics_cases(fmt, singles=False):
        for scale in (1e-3, 1.0, 300.0):
            check(
                Case(n=65, head_dim=f.head_dim, rope_dim=f.rope_dim, cache_format=fmt, dtype="fp16", op="kv",
                     scale=scale, zero_rows=3, block_size=48, numerics=num, seed=int(scale * 10))
            )  # fmt: skip
