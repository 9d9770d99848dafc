"""What runs on the H200 (SM90) is what runs on SM100 and SM120, except in declared places.

For every (op, q_out, D, format, dtype), the generated SM120, SM100 and *_portable modules may
differ from the SM90 module only inside the arch-specific regions: the conversions block (only in
modules of formats that use a UE8M0 or E2M1 conversion) and the docstring lines naming the variant
and the arch. Everything else must be byte-identical, so correctness and performance results
measured on SM90 carry over. Launch defaults are not in the modules: they are run-time choices
(attn_prologue.variants.ArchFamily.default_config, explained in codegen/archs.py).
"""

from __future__ import annotations

import ast
import difflib
import re
import sys

import pytest
from attn_prologue.codegen import generate
from attn_prologue.codegen.variants import variant_space
from attn_prologue.variants import ArchFamily, parse_name

KERNELS = generate.default_out_dir() / "kernels"

BLOCKS = {  # label -> (first line, last line); present only where the variant's format needs it
    "conversions": (re.compile(r"^# ---- conversions: "), re.compile(r"^# ---- end conversions ")),
}
IDENTITY_LINES = {  # name -> pattern of the whole line; each must occur exactly once
    "docstring arch line": re.compile(
        r"^Arch family sm\d+ \(targets [sm_0-9af, ]+\), (native|portable) conversions\.$"
    ),
}


def _shape(v):
    return (v.op.value, v.q_out.value, v.head_dim, v.rope_dim, v.cache_format, v.io_dtype.value)


def _modules() -> dict[tuple, dict[tuple[str, str], str]]:
    out: dict[tuple, dict] = {}
    for v in variant_space():
        out.setdefault(_shape(v), {})[(v.arch.value, v.conversions.value)] = v.name
    return out


MODULES = _modules()
SHAPES = sorted(MODULES)


def _text(name: str) -> str:
    return (KERNELS / f"{name}.py").read_text()


def split_regions(name: str) -> tuple[str, dict[str, str]]:
    """(the module text with every arch-specific region replaced by a placeholder, the regions)."""
    lines = _text(name).splitlines()
    regions: dict[str, str] = {}
    # the docstring's first line names the variant: only the name may differ
    first = f'"""{name}: '
    starts = [i for i, line in enumerate(lines) if line.startswith(first)]
    assert len(starts) == 1, f"{name}: no docstring line starting with {first!r}"
    lines[starts[0]] = '"""{VARIANT}: ' + lines[starts[0]][len(first) :]
    for label, pattern in IDENTITY_LINES.items():
        hits = [i for i, line in enumerate(lines) if pattern.match(line)]
        assert len(hits) == 1, f"{name}: expected one {label} line, found {len(hits)}"
        regions[label] = lines[hits[0]]
        lines[hits[0]] = f"<{label}>"
    uses_conversions = parse_name(name).uses_arch_conversions
    for label, (begin, end) in BLOCKS.items():
        b = [i for i, line in enumerate(lines) if begin.match(line)]
        e = [i for i, line in enumerate(lines) if end.match(line)]
        if not uses_conversions:  # nothing would call them: the module has none
            assert b == e == [], f"{name}: a {label} block its format does not use"
            continue
        assert len(b) == 1 and len(e) == 1 and b[0] < e[0], f"{name}: the {label} block is not delimited once"
        regions[label] = "\n".join(lines[b[0] : e[0] + 1])
        lines[b[0] : e[0] + 1] = [f"<{label}>"]
    return "\n".join(lines) + "\n", regions


def _assert_same_outside_regions(a: str, b: str):
    shared_a, _ = split_regions(a)
    shared_b, _ = split_regions(b)
    if shared_a != shared_b:
        diff = "\n".join(
            difflib.unified_diff(shared_a.splitlines(), shared_b.splitlines(), a, b, lineterm="", n=1)
        )
        pytest.fail(f"{a} and {b} differ outside the arch-specific regions:\n{diff[:4000]}")


def test_every_shape_has_an_sm90_sm100_and_sm120_module():
    # + nvfp4_dsv4 (qkv, qkv_q8, kv) and nvfp4_v41 (kv), each bf16 and fp16; + index_q (fp8_token, mxfp4 x 2)
    assert len(SHAPES) == 64 + 8 + 4
    for shape in SHAPES:
        mods = MODULES[shape]
        assert ("sm90", "portable") in mods and ("sm100", "native") in mods and ("sm120", "native") in mods, (
            shape
        )
        assert ("sm90", "native") not in mods


OTHERS = [("sm120", "native"), ("sm100", "native"), ("sm120", "portable"), ("sm100", "portable")]
PAIRS = [(shape, other) for shape in SHAPES for other in OTHERS if other in MODULES[shape]]


def test_portable_modules_exist_exactly_for_formats_with_arch_conversions():
    for shape in SHAPES:
        has = {other for other in OTHERS if other in MODULES[shape]}
        expected = (
            set(OTHERS)
            if parse_name(MODULES[shape][("sm90", "portable")]).uses_arch_conversions
            else set(OTHERS[:2])
        )
        assert has == expected, shape
    assert len(PAIRS) == 76 * 2 + 42 * 2


ARCH_CONVERSION_FORMATS = {"fp8_ds_mla", "mxfp8", "fp8_token", "mxfp4", "nvfp4_v41", "nvfp4_dsv4"}
E2M1_FORMATS = {"mxfp4", "nvfp4_v41", "nvfp4_dsv4"}
UE8M0_FORMATS = {
    "fp8_ds_mla",
    "mxfp8",
    "fp8_token",
    "mxfp4",
}  # (fp8_token: its float32 2^e is a UE8M0 exponent)


def wants_ue8m0(shape) -> bool:
    """The writers of these formats convert with UE8M0; index_q takes its scales from the float32 bits."""
    return shape[4] in UE8M0_FORMATS and shape[0] != "index_q"


@pytest.mark.parametrize("shape, other", PAIRS, ids=["_".join(map(str, s + o)) for s, o in PAIRS])
def test_module_equals_sm90_outside_arch_regions(shape, other):
    mods = MODULES[shape]
    sm90 = mods[("sm90", "portable")]
    name = mods[other]
    _assert_same_outside_regions(sm90, name)
    _, r90 = split_regions(sm90)
    _, r = split_regions(name)
    v = parse_name(name)
    targets = ", ".join(ArchFamily(other[0]).targets)
    assert r["docstring arch line"] == f"Arch family {other[0]} (targets {targets}), {other[1]} conversions."
    if not v.uses_arch_conversions:
        # bf16 / fp8_tensor: no UE8M0/E2M1 conversion, so no conversions block and no portable module
        assert "conversions" not in r and "conversions" not in r90
        assert other[1] == "native"
    elif other[1] == "portable":
        assert r["conversions"] == r90["conversions"]  # a portable module runs exactly the SM90 conversions
    else:
        assert "conversions: native" in r["conversions"]


def code_strings(block: str) -> str:
    """The string literals of a conversions block that are code (inline PTX), not docstrings."""
    tree = ast.parse(block)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.Module))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return "\n".join(
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    )


CONVERSION_SHAPES = [s for s in SHAPES if parse_name(MODULES[s][("sm90", "portable")]).uses_arch_conversions]


def test_conversion_blocks_are_where_the_format_needs_them():
    assert {s[4] for s in CONVERSION_SHAPES} == ARCH_CONVERSION_FORMATS
    assert len(CONVERSION_SHAPES) == 42
    for shape in SHAPES:
        for name in MODULES[shape].values():
            text = _text(name)
            assert ("# ---- conversions: " in text) == (shape in CONVERSION_SHAPES), name
            assert ("def ue8m0_byte(" in text) == wants_ue8m0(shape), name
            # (index_q's portable modules code in float16 pairs or by the ties-down rule: no float32 codes)
            float32_codes = not (shape[0] == "index_q" and ("_sm90" in name or name.endswith("_portable")))
            assert ("def e2m1_pack8(" in text) == (shape[4] in E2M1_FORMATS and float32_codes), name


@pytest.mark.parametrize("family", ["sm120", "sm100"])
@pytest.mark.parametrize("shape", CONVERSION_SHAPES, ids=lambda s: "_".join(map(str, s)))
def test_native_conversions_are_the_hardware_ones(shape, family):
    mods = MODULES[shape]
    _, native = split_regions(mods[(family, "native")])
    _, sm90 = split_regions(mods[("sm90", "portable")])
    code = code_strings(native["conversions"])  # the inline PTX, not the prose around it
    assert ("cvt.rp.satfinite.ue8m0x2.f32" in code) == wants_ue8m0(shape)
    assert ("cvt.rn.satfinite.e2m1x2.f32" in code) == (shape[4] in E2M1_FORMATS)
    portable = code_strings(sm90["conversions"])
    for ptx in ("cvt.rp.satfinite.ue8m0x2.f32", "cvt.rn.satfinite.e2m1x2.f32"):
        assert ptx not in portable
    # the portable conversions' own PTX (the E2M1 codes of I/O-dtype rows in float16 pairs: mxfp4 and
    # nvfp4_v41, and nvfp4_dsv4 with bf16 rows; index_q's bf16 rows in bfloat16 pairs) is what every target
    # has: float16x2 / bfloat16x2 arithmetic and the float32 -> float16x2 / bfloat16x2 cvt
    assert set(re.findall(r"cvt\.[\w.]+", portable)) <= {"cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32"}
    assert set(re.findall(r"\b(\w+)\.[\w.]*f16x2", portable)) <= {"cvt", "min", "max", "mul", "fma"}
    float16_codes = shape[4] in ("mxfp4", "nvfp4_v41") or shape[4:] == ("nvfp4_dsv4", "bf16")
    assert ("inline_ptx" in sm90["conversions"]) == float16_codes
    assert "conversions: portable" in sm90["conversions"]
    assert ("e2m1" in sm90["conversions"]) == (shape[4] in E2M1_FORMATS)


def test_region_splitter_catches_a_difference_outside_the_regions(tmp_path, monkeypatch):
    """The comparison above can fail: an edit outside the regions is reported, one inside is not."""
    shape = ("qkv", "io", 128, 64, "mxfp4", "bf16")
    a, b = MODULES[shape][("sm90", "portable")], MODULES[shape][("sm120", "native")]
    for n in (a, b):
        (tmp_path / f"{n}.py").write_text(_text(n))
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", tmp_path)
    _assert_same_outside_regions(a, b)
    inside = _text(b).replace("# ---- end conversions", "X = 1\n# ---- end conversions")
    (tmp_path / f"{b}.py").write_text(inside)
    _assert_same_outside_regions(a, b)
    outside = _text(b).replace("HEAD_DIM = 128", "HEAD_DIM = 128  # tuned for sm120")
    assert outside != _text(b)
    (tmp_path / f"{b}.py").write_text(outside)
    with pytest.raises(pytest.fail.Exception, match="differ outside the arch-specific regions"):
        _assert_same_outside_regions(a, b)
