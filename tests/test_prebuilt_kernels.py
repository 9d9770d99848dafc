"""Prebuilt kernels for deployment: `package-kernels` turns built entries into a wheel; installed,
its kernels load in a fresh process with an empty cache of its own and zero compiles (without a GPU
the check is that each kernel is found, verified and loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space

PREFIX = "kv_d512r64_bf16_bf16_sm90"  # one variant: a quick build

LOADER = r"""
import json, sys
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
cache = KernelCache(sys.argv[1])
keys = [KernelKey(v, LaunchConfig.from_key(c), t) for v, c, t in json.loads(sys.argv[2])]
fns = [cache.load(k, compile_if_missing=False) for k in keys]
print(json.dumps({"compiles": cache.compiles, "prebuilt_loads": cache.prebuilt_loads, "loaded": len(fns),
                  "shipped": [str(p.root) for p in cache.prebuilt]}))
"""


def test_a_kernels_wheel_installs_and_serves_with_zero_compiles(tmp_path):
    cli = [sys.executable, "-m", "attn_prologue"]
    proc = subprocess.run(
        [*cli, "package-kernels", "--targets", "sm_90a", "--variants", PREFIX, "--out", str(tmp_path / "dist"),
         "--cache-dir", str(tmp_path / "build-cache")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("attn_prologue_kernels_sm90a-*.whl")
    keys = [
        k for _, k in build.build_keys([v for v in variant_space() if v.name.startswith(PREFIX)], {"sm_90a"})
    ]
    names = zipfile.ZipFile(wheel).namelist()
    assert sum(n.endswith("/kernel.so") for n in names) == len(keys) >= 1
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
    site = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--target",
        str(site),
        str(wheel),
    ]
    assert subprocess.run(pip, capture_output=True, text=True, timeout=300).returncode == 0
    spec = json.dumps([[k.variant, k.config.key, k.target] for k in keys])
    run = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "empty-cache"), spec],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"compiles": 0, "prebuilt_loads": len(keys), "loaded": len(keys), "shipped": out["shipped"]}
    assert len(out["shipped"]) == 1 and out["shipped"][0].startswith(str(site))
    assert not (tmp_path / "empty-cache").exists() or not list((tmp_path / "empty-cache").rglob("kernel.so"))
