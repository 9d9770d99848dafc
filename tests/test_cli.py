"""The command line as a user meets it: every option explained, wrong targets and variants are errors
naming the valid ones, GPU commands on a machine without one say so in one line, and `cache` shows
and empties the kernel cache."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from attn_prologue import native
from attn_prologue.cli import build_parser
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.variants import ArchFamily


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attn_prologue", *args], capture_output=True, text=True, timeout=300
    )


def test_every_command_and_option_has_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions} >= {"list", "generate", "build", "bench", "tune", "cache"}
    for choice in sub._choices_actions:
        assert choice.help and choice.help != argparse.SUPPRESS, choice.dest
    missing = [
        f"{name} {a.dest}"
        for name, sp in sub.choices.items()
        for a in sp._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert not missing
    assert "SUPPRESS" not in run("--help").stdout


@pytest.mark.parametrize(
    "args,says",
    [
        (["build", "--targets", "sm_90"], "unknown target 'sm_90' (did you mean sm_90a?); targets: sm_90a"),
        (["build", "--targets", "bogus"], "unknown target 'bogus'"),
        (["build", "--variants", "nosuch"], "no generated variant matches nosuch"),
        (["build", "--config", "w3"], "not a launch-config key"),
    ],
)
def test_build_refuses_what_it_cannot_build(tmp_path, args, says):
    proc = run(*args, "--cache-dir", str(tmp_path))
    assert proc.returncode == 2 and says in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing was built


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", ["bench", "tune", "simulate"])
def test_gpu_commands_without_a_gpu_say_so_in_one_line(command):
    proc = run(command)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"attn_prologue {command}: needs a CUDA GPU, and none is available here"


def test_cache_shows_where_what_and_cleans(tmp_path):
    root = tmp_path / "cache"
    key = KernelKey("kv_d512r64_bf16_bf16_sm90", ArchFamily.SM90.default_config, "sm_90a")
    KernelCache(root).ensure_built(key)
    proc = run("cache", "--cache-dir", str(root))
    assert proc.returncode == 0, proc.stderr
    assert f"kernel cache: {root}" in proc.stdout and "sm_90a       1 kernels" in proc.stdout
    assert "1 kernels, 1 lock files" in proc.stdout
    assert "native fastpath: not built" in proc.stdout  # nothing in this fresh cache yet
    built = native.build("fastpath", root)
    assert f"native fastpath: {built}" in run("cache", "--cache-dir", str(root)).stdout
    proc = run("cache", "--cache-dir", str(root), "--clean")
    assert proc.returncode == 0 and f"cleaned {root}" in proc.stdout
    assert root.exists() and not any(root.iterdir())
