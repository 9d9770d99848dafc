"""The command line as a user meets it: every option explained with its default, every name a user
types checked while parsing with "did you mean" (variants also get the reason and the nearest
generated ones), numbers range-checked, `--help` without torch, one-line errors, GPU commands on a
machine without one saying so (and naming the CPU alternative), and `cache` showing and emptying the
kernel cache."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from attn_prologue import native
from attn_prologue.cli import build_parser
from attn_prologue.codegen.variants import dropped_combinations, variant_space
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.variants import ArchFamily

REPO = Path(__file__).resolve().parents[1]
COMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def run(*args: str, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *python, "-m", "attn_prologue", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_every_command_and_option_has_help_with_its_default():
    assert set(COMMANDS) >= {"list", "generate", "build", "bench", "tune", "simulate", "cache", "targets"}
    missing, no_default = [], []
    for name, sp in COMMANDS.items():
        text = " ".join(sp.format_help().split())
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if not a.help:
                missing.append(f"{name} {a.dest}")
            elif (
                a.option_strings and a.default not in (None, False) and f"(default: {a.default})" not in text
            ):
                no_default.append(f"{name} {a.dest}: {a.default}")
            elif a.option_strings and a.default is None and not a.required and "default" not in a.help:
                no_default.append(f"{name} {a.dest}: says nothing of what happens without it")
    assert not missing and not no_default, missing + no_default
    assert "SUPPRESS" not in run("--help").stdout


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_imports_no_torch(command):
    """Measured as a user runs it: a fresh interpreter's import log for `... <command> --help`."""
    proc = run(*([command] if command else []), "--help", python=("-X", "importtime"))
    assert proc.returncode == 0 and "usage: attn_prologue" in proc.stdout
    imported = {line.split("|")[-1].strip(): line for line in proc.stderr.splitlines() if "|" in line}
    heavy = sorted(
        m for m in imported if m.split(".")[0] in ("torch", "cutlass", "jinja2", "tvm_ffi", "numpy")
    )
    assert not heavy, heavy
    ours = int(imported["attn_prologue"].split("|")[1])  # cumulative microseconds
    assert ours < 500_000, f"importing attn_prologue for --help took {ours / 1e6:.2f} s"


def test_simulate_takes_gpu_for_cuda():
    assert build_parser().parse_args(["simulate", "--device", "GPU"]).device == "cuda"


def test_a_gpu_name_stands_for_its_target():
    args = build_parser().parse_args(["build", "--targets", "H100,rtx5090,gb10,b300,sm_100a"])
    assert args.targets == {"sm_90a", "sm_120f", "sm_103a", "sm_100a"}


def test_version_names_the_package_and_what_it_runs_with_and_imports_no_torch():
    import importlib.metadata

    proc = run("--version", python=("-X", "importtime"))
    assert proc.returncode == 0
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"attn-prologue {importlib.metadata.version('attn-prologue')} (")
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "torch"):
        assert f"{name} {importlib.metadata.version(name)}" in first
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "cutlass", "tvm_ffi")}


@pytest.mark.parametrize(
    "args,says",
    [
        (["build", "--targets", "sm_90"], "unknown target 'sm_90' (did you mean sm_90a?); targets: sm_90a"),
        (["build", "--targets", "sm_100"], "unknown target 'sm_100' (did you mean sm_100a?)"),
        (["build", "--targets", "sm90a"], "unknown target 'sm90a' (did you mean sm_90a?)"),
        (["build", "--targets", "bogus"], "unknown target 'bogus'; targets:"),
        (
            ["build", "--variants", "nosuch"],
            "no generated variant matches it: 'nosuch' is not a variant name",
        ),
        (
            ["build", "--variants", "qkv_d512r64_fp8_ds_mal"],
            "is not a variant name or prefix; closest generated: qkv_d512r64_fp8_ds_mla",
        ),
        (  # a well-formed name that is not generated: the reason `list --why` gives and the nearest
            ["build", "--variants", "kv_q8_d512r64_fp8_ds_mla_bf16_sm90"],
            "no kernel variant kv_q8_d512r64_fp8_ds_mla_bf16_sm90: op kv writes no Q, so an FP8 Q output does "
            "not apply; nearest generated: kv_d512r64_fp8_ds_mla_bf16_sm90",
        ),
        (
            ["build", "--variants", "qkv_d512r64_fp8_ds_mla_bf16_sm90_portable"],
            "did you mean 'qkv_d512r64_fp8_ds_mla_bf16_sm90'?",
        ),
        (
            ["build", "--targets", "sm_89"],
            "'sm_89': compute capability 8.9 is not supported (no kernels run there); supported: 9.0 (sm_90a)",
        ),
        (["build", "--targets", "sm_121a"], "unknown target 'sm_121a' (did you mean sm_120f?)"),
        (["build", "--targets", "h10"], "unknown target 'h10' (did you mean h100?)"),
        (
            ["build", "--numerics", "preset=vlm"],
            "unknown numerics preset 'vlm' (did you mean vllm?); presets: vllm,",
        ),
        (
            ["build", "--numerics", "scale_floor=sacle"],
            "scale_floor='sacle' is not a parity choice (did you mean scale?)",
        ),
        (["build", "--numerics", "scale_flor=scale"], "is not a parity choice (did you mean scale_floor?)"),
        (["build", "--config", "w3"], "not a launch-config key: 'w3'; keys read w<warps per CTA>"),
        (["build", "--config", "w4_u1_pdl1_nc1_c"], "(did you mean w4_u1_pdl1_nc1_cs?)"),
        (["build", "--jobs", "0"], "argument --jobs/-j: must be >= 1, not 0"),
        (["bulid"], "invalid choice: 'bulid' (did you mean build?)"),
        (["bench", "--shapes", "target"], "invalid choice: 'target' (did you mean targets?)"),
        (["simulate", "--device", "cuda0"], "invalid choice: 'cuda0' (did you mean cuda?)"),
        (["list", "--head-dim", "-5"], "argument --head-dim: invalid choice: -5 (choose from 128, 512)"),
        (["simulate", "--kv-fraction", "0"], "argument --kv-fraction: must be in (0, 1], not 0"),
        (["simulate", "--layers", "0"], "argument --layers: must be >= 1, not 0"),
        (["simulate", "--tp", "-2"], "argument --tp: must be >= 1, not -2"),
        (["simulate", "--decode-steps", "x"], "argument --decode-steps: not a whole number: 'x'"),
        (["tune", "--buckets", "1,0"], "argument --buckets: must be >= 1, not 0"),
        (["package-kernels", "--targets", "sm_12a"], "unknown target 'sm_12a' (did you mean sm_120f?)"),
    ],
)
def test_a_mistyped_or_out_of_range_argument_is_refused_in_one_line(tmp_path, args, says):
    proc = run(*args, *(["--cache-dir", str(tmp_path)] if args[0] == "build" else []))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"attn_prologue{' ' + args[0] if args[0] in COMMANDS else ''}: error: ")
    assert says in last, last
    assert not any(tmp_path.iterdir())  # nothing was built


def test_why_lists_each_reason_once_with_its_count():
    space = {v.name for v in variant_space()}
    first_reason = {}
    for v, why in dropped_combinations():
        if v.name not in space:
            first_reason.setdefault(v.name, why)
    reasons = set(first_reason.values())
    out = run("list", "--variants", "--why").stdout.splitlines()
    head = out.index(
        f"not generated: {len(first_reason)} names, {len(reasons)} reasons (--verbose: every name)"
    )
    assert all(len(line) <= 100 for line in out[head + 1 :])  # a long reason is wrapped
    # one entry per reason: its first line starts with the count, continuation lines are indented deeper
    lines = []
    for line in out[head + 1 :]:
        if re.match(r"  [ \d]{3}\d x ", line):
            lines.append(line.strip())
        else:
            lines[-1] += " " + line.strip()
    assert len(lines) == len(reasons) < 40  # was 1,912 lines, one per combination, 308 of them repeated
    for why in reasons:
        line = next(line for line in lines if f" x {' '.join(why.split())} (e.g. " in line)
        assert int(line.split(" x ")[0]) == sum(r == why for r in first_reason.values())
    verbose = run("list", "--variants", "--why", "--verbose").stdout.splitlines()
    listed = [
        line.strip()
        for line in verbose[verbose.index(out[head].split(" (")[0]) + 1 :]
        if line.startswith(" " * 9)  # (a wrapped reason continues at 7)
    ]
    assert sorted(listed) == sorted(first_reason)  # every name once


def test_list_shows_the_generated_head_dims_of_formats_that_take_any():
    out = run("list").stdout
    for fmt in ("bf16", "fp8_tensor"):
        row = next(line for line in out.splitlines() if line.startswith(f"{fmt} "))
        assert "128/64, 512/64 (shown D=512)" in row and "any" not in row
    assert "128/64, 512/64 (shown D=128)" in run("list", "--head-dim", "128").stdout


@pytest.mark.parametrize(
    "path,says",
    [
        ("nope.json", "cannot read nope.json: No such file or directory"),
        ("README.md", "README.md is not JSON"),
        (
            "results/gpu-suite-h200.json",
            "results/gpu-suite-h200.json is JSON but not a bench result (no `results` list)",
        ),
    ],
)
def test_targets_on_a_file_it_cannot_check_is_one_line_and_exit_2(path, says):
    proc = run("targets", path)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"attn_prologue targets: {says}")
    assert "exit status: 0 when every target is met, 1 when one is missed, 2 when" in " ".join(
        run("targets", "--help").stdout.split()
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize(
    "command,alternative",
    [
        ("bench", ""),
        ("tune", ""),
        ("simulate", "; `--device cpu` runs the same schedule through the PyTorch reference"),
    ],
)
def test_gpu_commands_without_a_gpu_say_so_in_one_line(command, alternative):
    proc = run(command)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == f"attn_prologue {command}: needs a CUDA GPU, and none is available here{alternative}"
    )


def test_simulate_on_the_cpu_reports_no_device_memory_it_does_not_have():
    proc = run("simulate", "--device", "cpu", "--layers", "1", "--seqs", "1", "--prompt-len", "20",
               "--max-num-batched-tokens", "32", "--decode-steps", "1", "--heads", "8", "--padded-heads", "8",
               "--needles", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "GiB free" not in proc.stdout and "0.00 GiB" not in proc.stdout
    assert "twice the schedule's blocks (no device memory on the CPU)" in proc.stdout


def test_the_package_registers_its_ops_on_import_outside_the_command_line():
    """Only `python -m attn_prologue` / `attn-prologue` defer the serving API; a program's import does not."""
    code = "import attn_prologue, sys, torch; torch.ops.attn_prologue.qnorm_rope_kv_insert; print(attn_prologue.bind)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "<function bind" in proc.stdout, proc.stderr[-2000:]


def test_cache_shows_where_what_and_cleans(tmp_path):
    root = tmp_path / "cache"
    key = KernelKey("kv_d512r64_bf16_bf16_sm90", ArchFamily.SM90.default_config, "sm_90a")
    KernelCache(root).ensure_built(key)
    proc = run("cache", "--cache-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    assert f"kernel cache: {root}" in proc.stdout and "sm_90a       1 kernels" in proc.stdout
    assert re.search(r"^  1 kernels, [\d.]+ MiB$", proc.stdout, re.M) and "lock" not in proc.stdout
    assert "native fastpath: not built" in proc.stdout  # nothing in this fresh cache yet
    built = native.build("fastpath", root)
    assert f"native fastpath: {built}" in run("cache", "--cache-dir", str(root)).stdout
    proc = run("cache", "--cache-dir", str(root), "--clean")
    assert proc.returncode == 0 and f"cleaned {root}" in proc.stdout
    assert root.exists() and [p.name for p in root.iterdir()] == [".attn-prologue-cache"]  # (its marker)


def test_every_shape_set_names_shapes():
    from attn_prologue.lab import bench_index_q, shape_sets

    for name in COMMANDS["bench"]._option_string_actions["--shapes"].choices:
        # (index_q: the indexer's Q prologue has its own bench, its own sizes)
        assert bench_index_q.TOKENS if name == "index_q" else shape_sets.default_shapes(name), name
    assert set(shape_sets.SASS_SHAPE_SETS) <= set(
        COMMANDS["bench"]._option_string_actions["--shapes"].choices
    )


def test_bench_also_applies_each_change_where_the_format_has_it(capsys):
    from attn_prologue.cli.options import bench_change
    from attn_prologue.lab import commands, shape_sets

    assert bench_change("lean_quant") == ("lean_quant", True)
    assert bench_change("numerics=preset=vllm") == ("numerics", "preset=vllm")
    with pytest.raises(argparse.ArgumentTypeError, match="not a bench change"):
        bench_change("numerics=")
    shapes = [s for s in shape_sets.default_shapes("writers") if s.n == 64]
    changes = [("lean_quant", True), ("numerics", "preset=flashmla")]
    out, skipped = commands._with_changes(shapes, changes)
    assert out[:2] == [shapes[0], replace(shapes[0], lean_quant=True)]  # each change right after its shape
    assert len(out) + len(skipped) == len(shapes) * 3
    # flashmla's preset covers fp8_ds_mla only: the other writers' copies are skipped, with the reason
    assert [s.cache_format for s in out if s.numerics] == ["fp8_ds_mla"]
    assert len(skipped) == len(shapes) - 1 and all("flashmla" in line for line in skipped)
    assert " lean_quant" in out[1].label and "numerics=preset=flashmla" in out[2].label


def test_a_variant_typed_without_an_arch_is_answered_without_one():
    """A name or prefix with no arch part gets the reason and nearest names with none either; one that
    names an arch keeps it."""
    from attn_prologue.cli.options import explain_name

    whole = explain_name("qkv_d256r64_fp8_ds_mla_bf16")
    assert whole.startswith("no kernel variant qkv_d256r64_fp8_ds_mla_bf16: fp8_ds_mla stores D=512/R=64")
    assert "nearest generated: qkv_d512r64_fp8_ds_mla_bf16, " in whole and "_sm" not in whole
    for prefix in ("kv_d512r64_mxfp4", "qkv_d256", "kv_d512r64_mxfp4_bf16_s"):
        assert "closest generated: " in explain_name(prefix) and "_sm" not in explain_name(prefix)
    assert "nearest generated: qkv_d512r64_fp8_ds_mla_bf16_sm120" in explain_name(
        "qkv_d256r64_fp8_ds_mla_bf16_sm120"
    )
