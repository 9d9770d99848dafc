"""Prebuilt kernels for deployment: `package-kernels` turns built entries into a wheel; installed,
its kernels load in a fresh process with an empty cache of its own and zero compiles (without a GPU
the check is that each kernel is found, verified and loaded). Installed under umask 002 (its files
group-writable, so not trusted), the wheel is skipped with one warning and a miss is an ordinary
miss, never an UntrustedCacheError."""

from __future__ import annotations

import json
import os
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
import warnings
cache = KernelCache(sys.argv[1])
keys = [KernelKey(v, LaunchConfig.from_key(c), t) for v, c, t in json.loads(sys.argv[2])]
loaded, misses = 0, []
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for k in keys:
        try:
            loaded += callable(cache.load(k, compile_if_missing=False))
        except FileNotFoundError as exc:
            misses.append(str(exc))
print(json.dumps({"compiles": cache.compiles, "prebuilt_loads": cache.prebuilt_loads, "loaded": loaded,
                  "misses": len(misses), "shipped": [str(p.root) for p in cache.prebuilt],
                  "warnings": [str(w.message) for w in seen]}))
"""


def _install(wheel, site, umask: int) -> None:
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
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300, umask=umask)
    assert done.returncode == 0, done.stderr[-2000:]


def _serve(tmp_path, site, spec) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "empty-cache"), spec],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_kernels_wheel_installs_and_serves_with_zero_compiles(tmp_path):
    cli = [sys.executable, "-m", "attn_prologue"]
    proc = subprocess.run(  # a relative --cache-dir: the ninja workers run elsewhere, it must not matter
        [*cli, "package-kernels", "--targets", "sm_90a", "--variants", PREFIX, "--out", "dist",
         "--cache-dir", "build-cache"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("attn_prologue_kernels_sm90a-*.whl")
    keys = [
        k for _, k in build.build_keys([v for v in variant_space() if v.name.startswith(PREFIX)], {"sm_90a"})
    ]
    names = zipfile.ZipFile(wheel).namelist()
    assert sum(n.endswith("/kernel.so") for n in names) == len(keys) >= 1
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
    spec = json.dumps([[k.variant, k.config.key, k.target] for k in keys])
    site = tmp_path / "site"
    _install(wheel, site, umask=0o022)
    out = _serve(tmp_path, site, spec)
    assert {k: out[k] for k in ("compiles", "prebuilt_loads", "loaded", "misses", "warnings")} == {
        "compiles": 0, "prebuilt_loads": len(keys), "loaded": len(keys), "misses": 0, "warnings": []
    }  # fmt: skip
    assert len(out["shipped"]) == 1 and out["shipped"][0].startswith(str(site))
    assert not (tmp_path / "empty-cache").exists() or not list((tmp_path / "empty-cache").rglob("kernel.so"))

    shared_group = tmp_path / "site-umask-002"
    _install(wheel, shared_group, umask=0o002)
    out = _serve(tmp_path, shared_group, spec)
    assert out["loaded"] == out["prebuilt_loads"] == 0 and out["misses"] == len(keys) and out["shipped"] == []
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "not used" in out["warnings"][0] and "writable by other users" in out["warnings"][0]
