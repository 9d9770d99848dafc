"""CPU tests of the generator: `generate --check`, drift reports, determinism, naming and the
variant space. Nothing here compiles a kernel, and the real generated/ is never written."""

from __future__ import annotations

import ast
import collections
import dataclasses
import enum
import inspect
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import jinja2
import pytest
from attn_prologue import launch, variants
from attn_prologue.codegen import generate, render
from attn_prologue.codegen.variants import dropped_combinations, variant_space
from attn_prologue.formats import FORMATS
from attn_prologue.generated import registry
from attn_prologue.jit import compiler, kernel_cache
from attn_prologue.variants import (
    ArchFamily,
    Conversions,
    IoDtype,
    Op,
    QLayout,
    QOut,
    Variant,
    generated,
    parse_name,
    unsupported_reason,
)

REPO = Path(__file__).resolve().parents[1]
GENERATED = generate.default_out_dir()
SAMPLE = "kernels/qkv_d512r64_fp8_ds_mla_bf16_sm120.py"  # a module every test below may edit in a copy


# ---- generate --check on the checked-in tree ---------------------------------------------------
def test_check_passes_on_checked_in_tree():
    ok, report = generate.check()
    assert ok, report
    assert f"({len(variant_space())} variants)" in report


def test_cli_check_exits_zero_on_checked_in_tree():
    proc = subprocess.run(
        [sys.executable, "-m", "attn_prologue", "generate", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


# ---- drift is reported, briefly, with the command to run ----------------------------------------
@pytest.fixture
def generated_copy(tmp_path) -> Path:
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    ok, report = generate.check(out)
    assert ok, report  # the copy starts up to date
    return out


def _assert_short_failure(report: str):
    lines = report.splitlines()
    assert lines[-1] == f"generated/ is out of date: run `{generate.REGENERATE}`"
    # at most 20 problem lines (+1 "... and N more"), 40 diff lines and the command
    assert len(lines) <= 20 + 1 + 40 + 1, report


def test_check_reports_an_edited_file(generated_copy):
    path = generated_copy / SAMPLE
    text = path.read_text()
    assert "HEAD_DIM = 512\n" in text
    path.write_text(text.replace("HEAD_DIM = 512\n", "HEAD_DIM = 511\n"))
    ok, report = generate.check(generated_copy)
    assert not ok
    assert f"stale:   generated/{SAMPLE}" in report.splitlines()
    # a unified diff of the edit: what is on disk (-) against what generate renders (+)
    assert f"--- generated/{SAMPLE}" in report
    assert f"+++ rendered/{SAMPLE}" in report
    assert "-HEAD_DIM = 511" in report.splitlines()
    assert "+HEAD_DIM = 512" in report.splitlines()
    _assert_short_failure(report)


def test_check_reports_a_missing_file(generated_copy):
    (generated_copy / SAMPLE).unlink()
    (generated_copy / "MANIFEST").unlink()
    ok, report = generate.check(generated_copy)
    assert not ok
    assert f"missing: generated/{SAMPLE}" in report.splitlines()
    assert "missing: generated/MANIFEST" in report.splitlines()
    _assert_short_failure(report)


def test_check_reports_an_extra_file(generated_copy):
    (generated_copy / "kernels" / "qkv_d64r64_bogus_bf16_sm90.py").write_text(
        "# left over from an old variant\n"
    )
    ok, report = generate.check(generated_copy)
    assert not ok
    assert "extra:   generated/kernels/qkv_d64r64_bogus_bf16_sm90.py" in report.splitlines()
    _assert_short_failure(report)


def test_check_report_stays_short_when_everything_drifted(generated_copy):
    for path in sorted((generated_copy / "kernels").glob("*_sm90.py"))[:60]:
        path.write_text(path.read_text().replace("HEAD_DIM = ", "HEAD_DIM = 1 + "))
    ok, report = generate.check(generated_copy)
    assert not ok
    assert "... and 40 more" in report
    _assert_short_failure(report)


def test_cli_check_fails_on_drift_and_write_repairs_it(generated_copy):
    (generated_copy / SAMPLE).write_text("# edited by hand\n")
    (generated_copy / "kernels" / "stale_variant.py").write_text("\n")
    cmd = [sys.executable, "-m", "attn_prologue", "generate", "--out", str(generated_copy)]
    proc = subprocess.run(cmd + ["--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"stale:   generated/{SAMPLE}" in proc.stdout
    assert generate.REGENERATE in proc.stdout
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 files written, 1 removed" in proc.stdout
    assert not (generated_copy / "kernels" / "stale_variant.py").exists()
    assert generate.check(generated_copy)[0]


# ---- determinism; generate writes only what changed ---------------------------------------------
def test_render_all_is_deterministic():
    first = generate.render_all()
    render.environment.cache_clear()  # a fresh Jinja environment renders the same bytes
    second = generate.render_all()
    assert list(first) == list(second)
    assert first == second
    assert len(first) == len(variant_space()) + 3


def _mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_write_is_idempotent_and_touches_nothing_unchanged(tmp_path):
    out = tmp_path / "gen"
    first = generate.write(out)
    files = generate.render_all()
    assert first["written"] == len(files) and first["removed"] == 0
    assert first["variants"] == len(variant_space())
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == set(files)
    old = 1_000_000_000  # backdate every file: a rewrite, even within the same second, shows up
    for p in out.rglob("*"):
        if p.is_file():
            os.utime(p, ns=(old, old))
    before = _mtimes(out)
    second = generate.write(out)
    assert second["written"] == 0 and second["removed"] == 0
    assert _mtimes(out) == before
    assert not list(out.rglob("*.tmp"))

    # one edited file is the only one rewritten; a stale module is the only one removed
    (out / SAMPLE).write_text("edited\n")
    (out / "kernels" / "gone_variant.py").write_text("\n")
    os.utime(out / SAMPLE, ns=(old, old))
    third = generate.write(out)
    assert third["written"] == 1 and third["removed"] == 1
    after = _mtimes(out)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {SAMPLE}
    assert (out / SAMPLE).read_text() == files[SAMPLE]
    assert generate.check(out)[0]


# ---- naming: every codegen parameter is part of the name ----------------------------------------
def _field_values(name: str, tp) -> list:
    """Every value a Variant field can take (Enums: all members; formats: all; dims: a few)."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return list(tp)
    if name == "cache_format":
        return sorted(FORMATS)
    if name == "head_dim":
        return sorted({d for d, _ in variants.HEAD_DIMS} | {256, 1024})
    if name == "rope_dim":
        return sorted({r for _, r in variants.HEAD_DIMS} | {32, 128})
    raise AssertionError(f"Variant field {name!r} ({tp}) has no perturbation rule: add one to this test")


def _perturbations(base: Variant) -> dict[tuple[str, object], Variant]:
    hints = typing.get_type_hints(Variant)
    out = {}
    for f in dataclasses.fields(Variant):
        values = [x for x in _field_values(f.name, hints[f.name]) if x != getattr(base, f.name)]
        assert values, f.name
        for x in values:
            out[(f.name, x)] = dataclasses.replace(base, **{f.name: x})
    return out


BASES = [
    Variant(Op.QKV, QOut.IO, 512, 64, "fp8_ds_mla", IoDtype.BF16, ArchFamily.SM120, Conversions.NATIVE),
    Variant(Op.KV, QOut.IO, 128, 64, "mxfp4", IoDtype.FP16, ArchFamily.SM100, Conversions.PORTABLE),
    Variant(Op.KV_NORM, QOut.IO, 128, 64, "bf16", IoDtype.FP16, ArchFamily.SM90, Conversions.PORTABLE),
]


@pytest.mark.parametrize("base", BASES, ids=lambda v: v.name)
def test_name_changes_with_every_codegen_parameter(base):
    assert unsupported_reason(base) is None
    perturbed = _perturbations(base)
    assert {k for k, _ in perturbed} == {f.name for f in dataclasses.fields(Variant)}
    if base.arch.has_native_block_conversions:
        # every perturbation, supported or not, has its own name
        names = [base.name] + [v.name for v in perturbed.values()]
        assert len(set(names)) == len(names), collections.Counter(names).most_common(3)
    supported = [base] + [v for v in perturbed.values() if unsupported_reason(v) is None]
    names = [v.name for v in supported]
    assert len(set(names)) == len(names)
    # every name parses back; only generated variants (not the unsupported ones, nor a head dim the
    # template takes but HEAD_DIMS does not generate) are in the registry
    space = set(variant_space())
    assert sum(v in space for v in supported) >= 8  # the test is not vacuous
    for v in perturbed.values():
        assert (v.name in generated()) == (v in space or v.name in {g.name for g in space})
        if not v.arch.has_native_block_conversions and v.conversions is Conversions.NATIVE:
            # the one alias: an SM90 "native" module does not exist, its name is the portable one's
            assert parse_name(v.name) == dataclasses.replace(v, conversions=Conversions.PORTABLE)
        else:
            assert parse_name(v.name) == v
    assert parse_name(base.name) == base


def test_names_are_unique_over_the_supported_space():
    space = variant_space()
    assert len({v.name for v in space}) == len(space)
    by_name = collections.defaultdict(list)
    for v in variants.all_combinations():
        by_name[v.name].append(v)
    for name, vs in by_name.items():
        supported = [v for v in vs if unsupported_reason(v) is None]
        assert len(supported) <= 1, name
        if len(vs) > 1:  # the one alias: an SM90 module is the portable one, "native" does not exist there
            assert {v.conversions for v in vs} == set(Conversions) and not vs[
                0
            ].arch.has_native_block_conversions
    for v in space[::7]:
        assert parse_name(v.name) == v


@pytest.fixture
def fresh_fingerprints():
    """source_hash and dsl_fingerprint are memoized: clear them around a test that fakes their inputs."""
    compiler.source_hash.cache_clear()
    compiler.dsl_fingerprint.cache_clear()
    yield
    compiler.source_hash.cache_clear()
    compiler.dsl_fingerprint.cache_clear()


def _relpath(variant: str, config: launch.LaunchConfig, target: str) -> Path:
    return kernel_cache.KernelKey(variant, config, target).relpath()


def test_cache_key_changes_with_variant_config_and_target():
    base = BASES[0]
    cfg = launch.LaunchConfig()
    key = _relpath(base.name, cfg, "sm_120a")
    assert key == _relpath(base.name, cfg, "sm_120a")  # stable
    # the variant
    others = [v for v in _perturbations(base).values() if unsupported_reason(v) is None]
    paths = {_relpath(v.name, cfg, v.arch.targets[0]) for v in others} | {key}
    assert len(paths) == len(others) + 1
    # every LaunchConfig field
    configs = launch.all_configs()
    configs.append(launch.LaunchConfig(slots32=True))  # the caller's slot width (not swept by the tuner)
    assert len(set(configs)) == len(configs)
    assert all(launch.LaunchConfig.from_key(c.key) == c for c in configs)
    assert len({c.key for c in configs}) == len(configs)
    for f in dataclasses.fields(launch.LaunchConfig):
        changed = [
            c
            for c in configs
            if [x.name for x in dataclasses.fields(c) if getattr(c, x.name) != getattr(cfg, x.name)]
            == [f.name]
        ]
        assert changed, f"no supported config differs from the default in {f.name} only"
        for c in changed:
            assert _relpath(base.name, c, "sm_120a") != key, f.name
    assert len({_relpath(base.name, c, "sm_120a") for c in configs}) == len(configs)
    # the target
    assert _relpath(base.name, cfg, "sm_121a") != key


def test_cache_key_changes_with_the_source(tmp_path, monkeypatch, fresh_fingerprints):
    name = BASES[0].name
    cfg = launch.LaunchConfig()
    module = tmp_path / f"{name}.py"
    lib = tmp_path / "kernel_lib.py"
    module.write_bytes(compiler.module_path(name).read_bytes())
    lib.write_bytes(compiler.kernel_lib_path().read_bytes())
    real = _relpath(name, cfg, "sm_120a")
    monkeypatch.setattr(compiler, "module_path", lambda v: module)
    monkeypatch.setattr(compiler, "kernel_lib_path", lambda: lib)
    compiler.source_hash.cache_clear()
    assert _relpath(name, cfg, "sm_120a") == real  # same bytes, same key

    module.write_text(module.read_text() + "# an edit of the generated module\n")
    compiler.source_hash.cache_clear()
    edited_module = _relpath(name, cfg, "sm_120a")
    assert edited_module != real

    lib.write_text(lib.read_text() + "# an edit of the shared helpers\n")
    compiler.source_hash.cache_clear()
    edited_lib = _relpath(name, cfg, "sm_120a")
    assert edited_lib not in (real, edited_module)


def test_cache_key_changes_with_the_dsl_version(monkeypatch, fresh_fingerprints):
    name = BASES[0].name
    cfg = launch.LaunchConfig()
    real = _relpath(name, cfg, "sm_120a")
    versions = {p: compiler.dsl_versions()[p] for p in compiler.DSL_PACKAGES}
    assert all(versions.values()), versions
    real_version = compiler.importlib.metadata.version
    for pkg in compiler.DSL_PACKAGES:
        monkeypatch.setattr(
            compiler.importlib.metadata,
            "version",
            lambda p, pkg=pkg: "0.0.0.dev0" if p == pkg else real_version(p),
        )
        compiler.dsl_fingerprint.cache_clear()
        assert _relpath(name, cfg, "sm_120a") != real, pkg
    monkeypatch.setattr(compiler.importlib.metadata, "version", real_version)
    compiler.dsl_fingerprint.cache_clear()
    assert _relpath(name, cfg, "sm_120a") == real


# ---- the variant space -------------------------------------------------------------------------
def test_every_dropped_combination_is_explained():
    combos = list(variants.all_combinations())
    dropped = dropped_combinations()
    space = variant_space()
    assert len(dropped) + len(space) == len(combos)
    assert {v for v, _ in dropped}.isdisjoint(space)
    for v, why in dropped:
        assert isinstance(why, str) and why.strip(), v
        assert why == unsupported_reason(v)


@pytest.mark.parametrize(
    "variant, words",
    [
        (
            Variant(Op.KV, QOut.IO, 320, 64, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["head_dim=320"],
        ),
        (
            Variant(Op.KV, QOut.IO, 512, 60, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["rope_dim=60"],
        ),
        (
            Variant(
                Op.KV, QOut.IO, 128, 64, "fp8_ds_mla", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE
            ),
            ["fp8_ds_mla", "D=128"],
        ),
        (
            Variant(Op.KV, QOut.FP8, 128, 64, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["kv", "FP8"],
        ),
        (
            Variant(Op.KV, QOut.IO, 128, 64, "mxfp4", IoDtype.BF16, ArchFamily.SM90, Conversions.NATIVE),
            ["sm90", "native"],
        ),
        (
            Variant(Op.KV, QOut.IO, 128, 64, "bf16", IoDtype.BF16, ArchFamily.SM120, Conversions.PORTABLE),
            ["bf16", "portable"],
        ),
    ],
)
def test_unsupported_reason_names_the_cause(variant, words):
    why = unsupported_reason(variant)
    assert why, variant
    for w in words:
        assert w in why, (w, why)


ARCH_CONVERSION_FORMATS = {
    "fp8_ds_mla",
    "mxfp8",
    "fp8_token",
    "mxfp4",
    "nvfp4_v41",
    "nvfp4_dsv4",
}  # UE8M0, 2^e or E2M1


def test_supported_space_has_exactly_the_expected_axes():
    space = variant_space()
    per_family = collections.Counter((v.arch.value, v.conversions.value) for v in space)
    assert per_family == {
        ("sm90", "portable"): 76,
        ("sm100", "native"): 76,
        ("sm100", "portable"): 44,
        ("sm120", "native"): 76,
        ("sm120", "portable"): 44,
    }
    assert len(space) == 316

    def shape(v):
        return (v.op, v.q_out, v.head_dim, v.rope_dim, v.cache_format, v.io_dtype, v.q_layout)

    primary = {
        (a, c): {shape(v) for v in space if (v.arch, v.conversions) == (a, c)}
        for a, c in [
            (ArchFamily.SM90, Conversions.PORTABLE),
            (ArchFamily.SM100, Conversions.NATIVE),
            (ArchFamily.SM120, Conversions.NATIVE),
        ]
    }
    first = next(iter(primary.values()))
    assert all(s == first for s in primary.values())  # every arch family offers the same 76 ops
    assert {(o, q) for o, q, *_ in first} == {
        (Op.QKV, QOut.IO),
        (Op.QKV, QOut.FP8),
        (Op.KV, QOut.IO),
        (Op.KV_NORM, QOut.IO),
    }
    # per (format, D): the ops; NVFP4 records take no kv_norm, and the V4.1 compressed record no qkv
    full = {(Op.QKV, QOut.IO), (Op.QKV, QOut.FP8), (Op.KV, QOut.IO), (Op.KV_NORM, QOut.IO)}
    ops_of = collections.defaultdict(set)
    for o, q, d, r, f, _, layout in first:
        if layout is QLayout.HEAD_MAJOR:
            ops_of[(f, d, r)].add((o, q))
    assert ops_of == {
        ("fp8_ds_mla", 512, 64): full,
        ("mxfp8", 512, 64): full,
        ("fp8_token", 128, 64): full,
        ("mxfp4", 128, 64): full,
        ("bf16", 512, 64): full,
        ("bf16", 128, 64): full,
        ("fp8_tensor", 512, 64): full,
        ("fp8_tensor", 128, 64): full,
        ("nvfp4_dsv4", 512, 64): full - {(Op.KV_NORM, QOut.IO)},
        ("nvfp4_v41", 512, 64): {(Op.KV, QOut.IO)},
    }
    # the interleaved Q layout: qkv (both Q dtypes) for the caches FlashMLA reads on SM100, bf16 I/O
    assert {(o, q, f, io) for o, q, _, _, f, io, layout in first if layout is QLayout.INTERLEAVED} == {
        (Op.QKV, q, f, IoDtype.BF16) for q in QOut for f in ("fp8_ds_mla", "mxfp8")
    }
    assert {s[5] for s in first} == set(IoDtype)
    assert len(first) == (4 * 8 + 3 + 1) * 2 + 4
    for arch in (ArchFamily.SM100, ArchFamily.SM120):
        portable = {shape(v) for v in space if v.arch is arch and v.conversions is Conversions.PORTABLE}
        assert portable == {s for s in first if s[4] in ARCH_CONVERSION_FORMATS}
    assert {v.cache_format for v in space if v.uses_arch_conversions} == ARCH_CONVERSION_FORMATS
    assert {v.cache_format for v in space} == set(FORMATS)


@pytest.mark.parametrize(
    "name, why",
    [
        ("kv_norm_d512r64_nvfp4_dsv4_bf16_sm120", "kv_norm is the indexer path"),
        ("qkv_d512r64_nvfp4_v41_bf16_sm90", "written by the kv-only writer"),
        ("qkv_q8_d512r64_nvfp4_v41_bf16_sm100", "written by the kv-only writer"),
    ],
)
def test_nvfp4_ops_that_are_not_generated_say_why(name, why):
    v = parse_name(name)
    assert why in unsupported_reason(v)
    assert name not in generated()


def test_manifest_registry_and_modules_agree():
    text = (GENERATED / "MANIFEST").read_text()
    assert text.endswith("\n") and not text.endswith("\n\n")
    names = text.splitlines()
    assert all(n and n == n.strip() and " " not in n for n in names)
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert names == [v.name for v in variant_space()]
    assert list(registry.VARIANTS) == names
    modules = sorted(p.stem for p in (GENERATED / "kernels").glob("*.py") if p.name != "__init__.py")
    assert modules == names
    for name in registry.VARIANTS:
        v = parse_name(name)
        assert v.name == name and unsupported_reason(v) is None
    assert generated() == frozenset(names)


# ---- templates are strict ----------------------------------------------------------------------
def test_environment_uses_strict_undefined():
    env = render.environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("DEFAULT = {{ not_passed_in }}\n").render()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{% if flag %}x{% endif %}").render()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ v.no_such_attribute }}").render(v=BASES[0])
    assert env.from_string("{{ v.name }}").render(v=BASES[0]) == BASES[0].name


def test_real_templates_fail_on_a_missing_variable():
    env = render.environment()
    v = BASES[0]
    from attn_prologue.codegen.plan import describe, make_plan

    kernel = env.get_template("kernel.py.jinja")
    full = dict(v=v, plan=make_plan(v), description=describe(v))
    assert kernel.render(**full)  # the complete set renders
    for missing in full:
        with pytest.raises(jinja2.UndefinedError):
            kernel.render(**{k: x for k, x in full.items() if k != missing})
    plan = make_plan(v)
    plan.pop("needs_e2m1")
    with pytest.raises(jinja2.UndefinedError):
        kernel.render(**{**full, "plan": plan})


# ---- what a generated module holds -------------------------------------------------------------
COMPILER_READS = {"Kernel", "fake_arguments"}  # all that jit.compiler takes from a module
MAX_DEVICE_PARAMETERS = 8  # per device function, self excluded; per-launch values travel in bundles


def _modules() -> list[tuple[str, ast.Module]]:
    return [(n, ast.parse((GENERATED / "kernels" / f"{n}.py").read_text())) for n in registry.VARIANTS]


def test_compiler_reads_only_kernel_and_fake_arguments():
    assert set(re.findall(r"\bmod\.(\w+)", inspect.getsource(compiler))) == COMPILER_READS


def _module_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_generated_modules_define_only_what_is_read():
    """Every module-level name (constant, function, class, import) is read by the module's code or
    by the compiler: no identity constants, no copies of the launch defaults, no dead helpers."""
    for name, tree in _modules():
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        unread = _module_level_names(tree) - read - COMPILER_READS
        assert not unread, f"{name}: {sorted(unread)} defined but never read"


def _is_device_function(f: ast.FunctionDef) -> bool:
    return any(ast.unparse(d) in ("cute.jit", "cute.kernel") for d in f.decorator_list)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(tree: ast.Module, name: str) -> list[str]:
    return [n.target.id for n in _class(tree, name).body if isinstance(n, ast.AnnAssign)]


def test_device_functions_take_bundles_not_long_parameter_lists():
    """Only `Kernel.__call__` (the exported function: `Variant.arguments`, then the stream) takes the
    arguments one by one; it hands them to the device code as an Arguments and a Schedule bundle,
    built from its own names in field order."""
    for name, tree in _modules():
        v = parse_name(name)
        methods = [f for f in _class(tree, "Kernel").body if isinstance(f, ast.FunctionDef)]
        device = [f for f in methods if _is_device_function(f)]
        assert {f.name for f in device} >= {"__call__", "kernel", "one_pass", "kv_pass"}, name
        for f in device:
            params = [a.arg for a in f.args.args[1:]]  # self excluded
            if f.name == "__call__":
                assert params == [*v.arguments, "stream"], name
            else:
                assert len(params) <= MAX_DEVICE_PARAMETERS, (name, f.name, params)
        assert _fields(tree, "Arguments") == list(v.arguments), name
        call = next(f for f in device if f.name == "__call__")
        for bundle in ("Arguments", "Schedule"):
            built = [
                n
                for n in ast.walk(call)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == bundle
            ]
            assert len(built) == 1 and not built[0].keywords, (name, bundle)
            assert [ast.unparse(a) for a in built[0].args] == _fields(tree, bundle), (name, bundle)
        kernel = next(f for f in device if f.name == "kernel")
        assert [ast.unparse(a.annotation) for a in kernel.args.args[1:]] == ["Arguments", "Schedule"], name
