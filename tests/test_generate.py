"""CPU tests of the generator: `generate --check`, drift reports, determinism, strict templates and
what a generated module holds (test_generate_variants.py: the variant space and its names). Nothing
here compiles a kernel, and the real generated/ is never written."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from attn_prologue.codegen import generate, render
from attn_prologue.codegen.variants import variant_space
from attn_prologue.generated import registry
from attn_prologue.jit import compiler
from attn_prologue.variants import Op, parse_name

from .support.sample_variants import BASES

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


@functools.cache  # parsed once a session (read only by the tests that walk them)
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    return tuple((n, ast.parse((GENERATED / "kernels" / f"{n}.py").read_text())) for n in registry.VARIANTS)


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
        passes = {"rows", "finish_row"} if v.op is Op.INDEX_Q else {"one_pass", "kv_pass"}
        assert {f.name for f in device} >= {"__call__", "kernel", *passes}, name
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
