"""The session's full build, shared by the build and emitted-code tests: every generated variant for
every target it claims, plus the configs the shipped tuning database names, compiled once per
session through the CLI into a temporary kernel cache. No GPU is needed."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey

REPO = Path(__file__).resolve().parents[2]

# CI compiles every generated variant for every target it claims (the project's main job, ~2-3
# minutes on a 2-core machine) and inspects what each one emits.
VARIANTS = variant_space()
ENTRIES = build.build_keys(VARIANTS)  # (variant, key) for every default/tuned config and target
ENTRY_IDS = [f"{k.variant}-{k.target}-{k.config.key}" for _, k in ENTRIES]
CHEAP = next(k for v, k in ENTRIES if v.name == "kv_d512r64_bf16_bf16_sm90")  # a kernel quick to build


@dataclass
class Built:
    root: Path
    cache: KernelCache
    output: str
    seconds: float


def build_cli(root: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(root)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    return proc, time.perf_counter() - t0


def build_once(tmp_path_factory) -> Built:
    root = tmp_path_factory.mktemp("kernel-cache")
    proc, seconds = build_cli(root)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    print(f"\n[build] built {len(ENTRIES)} kernels ({len(VARIANTS)} variants) in {seconds:.1f}s")
    return Built(root, KernelCache(root), output, seconds)


def meta_of(built: Built, key: KernelKey) -> dict:
    meta = built.cache.read_meta(key)
    assert meta is not None, f"{key.variant} [{key.target}] has no intact cache entry"
    return meta


def ptx_of(built: Built, key: KernelKey) -> str:
    return (built.cache.entry_dir(key) / "kernel.ptx").read_text()
