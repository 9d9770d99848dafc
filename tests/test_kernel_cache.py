"""The kernel cache: corrupted entries are detected and rebuilt, intact ones are not, concurrent
builders agree on one entry, and loading built entries compiles nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from attn_prologue.jit.kernel_cache import CorruptEntryWarning, KernelCache, KernelKey
from attn_prologue.launch import all_configs

from .support import build_workers
from .support.build import CHEAP, ENTRIES, REPO, Built

# ---- the kernel cache: corrupted entries, concurrent builders ---------------------------------------


def _copy_entry(built: Built, key: KernelKey, root: Path) -> KernelCache:
    cache = KernelCache(root)
    shutil.copytree(built.cache.entry_dir(key), cache.entry_dir(key))
    assert cache.read_meta(key) is not None
    return cache


def _flip_middle_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated_so": lambda d: (d / "kernel.so").write_bytes((d / "kernel.so").read_bytes()[:4096]),
    "flipped_byte_in_so": lambda d: _flip_middle_byte(d / "kernel.so"),
    "missing_so": lambda d: (d / "kernel.so").unlink(),
    "truncated_meta": lambda d: (d / "meta.json").write_text((d / "meta.json").read_text()[:100]),
    "empty_meta": lambda d: (d / "meta.json").write_text(""),
    "missing_meta": lambda d: (d / "meta.json").unlink(),
    "meta_of_other_source": lambda d: (d / "meta.json").write_text(
        json.dumps({**json.loads((d / "meta.json").read_text()), "source_hash": "0" * 64})
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupted_entry_is_detected_and_rebuilt(built, tmp_path, how):
    cache = _copy_entry(built, CHEAP, tmp_path / "cache")
    d = cache.entry_dir(CHEAP)
    CORRUPTIONS[how](d)
    assert cache.read_meta(CHEAP) is None
    with pytest.raises(FileNotFoundError):
        cache.load(CHEAP, compile_if_missing=False)  # never hands out a broken object
    with pytest.warns(CorruptEntryWarning, match="incomplete or corrupted"):
        meta = cache.ensure_built(CHEAP)
    assert cache.compiles == 1
    assert cache.read_meta(CHEAP) == meta
    assert hashlib.sha256((d / "kernel.so").read_bytes()).hexdigest() == meta["so_sha256"]
    assert sorted(p.name for p in d.iterdir()) == ["kernel.ptx", "kernel.so", "meta.json"]
    assert [p.name for p in d.parent.iterdir() if p.name.startswith(".tmp-")] == []
    fresh = KernelCache(cache.root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.ensure_built(CHEAP) == meta
    assert fresh.compiles == 0


def _unloadable(cache: KernelCache, key: KernelKey) -> None:
    """Make the entry intact by every check (its recorded hash is its bytes') but not a loadable
    shared object: what a .so linked against another machine's runtime looks like to the cache."""
    d = cache.entry_dir(key)
    junk = b"\x7fELF not a shared object of this machine"
    (d / "kernel.so").write_bytes(junk)
    meta = json.loads((d / "meta.json").read_text())
    meta["so_sha256"] = hashlib.sha256(junk).hexdigest()
    (d / "meta.json").write_text(json.dumps(meta))
    assert cache.read_meta(key) is not None


def test_an_intact_entry_that_does_not_load_is_rebuilt_once(tmp_path):
    from attn_prologue.jit.kernel_cache import KernelLoadError

    cache = KernelCache(tmp_path / "cache")
    cache.ensure_built(CHEAP)  # one cheap kernel, compiled here (no GPU needed)
    _unloadable(cache, CHEAP)
    with pytest.raises(KernelLoadError, match=str(cache.entry_dir(CHEAP))):
        KernelCache(cache.root).load(CHEAP, compile_if_missing=False)  # no rebuild asked: the typed error
    fresh = KernelCache(cache.root)
    with pytest.warns(CorruptEntryWarning, match="did not load on this machine.*rebuilding it once"):
        fn = fresh.load(CHEAP)
    assert callable(fn) and fresh.compiles == 1
    so = (fresh.entry_dir(CHEAP) / "kernel.so").read_bytes()
    assert hashlib.sha256(so).hexdigest() == fresh.read_meta(CHEAP)["so_sha256"]
    assert len(so) > 1000  # the rebuilt object, not the junk
    _unloadable(fresh, CHEAP)
    fresh._loaded.clear()
    with pytest.raises(KernelLoadError):  # a shared (read-only) cache never rebuilds
        KernelCache(cache.root, trust="shared").load(CHEAP)


@pytest.mark.slow
def test_intact_entry_is_not_rebuilt(built, tmp_path):
    cache = _copy_entry(built, CHEAP, tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meta = cache.ensure_built(CHEAP)
    assert cache.compiles == 0
    assert meta == built.cache.read_meta(CHEAP)


@pytest.mark.slow
def test_two_processes_building_one_entry(tmp_path):
    root = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    args = (str(root), CHEAP.variant, CHEAP.config.key, CHEAP.target, barrier, queue)
    procs = [ctx.Process(target=build_workers.build_entry, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r["compiles"] for r in results) == [0, 1]  # one built it, the other found it
    builder = next(r["pid"] for r in results if r["compiles"] == 1)
    assert {r["built_by_pid"] for r in results} == {builder}
    assert len({r["so_sha256"] for r in results}) == 1
    assert all(r["warnings"] == [] for r in results)
    cache = KernelCache(root)
    assert cache.read_meta(CHEAP)["built_by_pid"] == builder
    siblings = [p.name for p in cache.entry_dir(CHEAP).parent.iterdir() if not p.name.endswith(".lock")]
    assert siblings == [cache.entry_dir(CHEAP).name]  # one entry, no leftover .tmp-* directory


# ---- after `build`, loading compiles nothing -----------------------------------------------------------
LOADER = r"""
import json, sys, time
t0 = time.perf_counter()
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
t1 = time.perf_counter()
spec = json.loads(sys.stdin.read())
cache = KernelCache(spec["root"])
keys = [KernelKey(v, LaunchConfig.from_key(c), t) for v, c, t in spec["keys"]]
t2 = time.perf_counter()
fns = [cache.load(k, compile_if_missing=False) for k in keys]
t3 = time.perf_counter()
again = all(cache.load(k, compile_if_missing=False) is f for k, f in zip(keys, fns))
t4 = time.perf_counter()
v, c, t = spec["missing"]
try:
    cache.load(KernelKey(v, LaunchConfig.from_key(c), t), compile_if_missing=False)
    missing = "loaded"
except FileNotFoundError:
    missing = "FileNotFoundError"
print(json.dumps({
    "compiles": cache.compiles, "disk_loads": cache.disk_loads, "callable": all(map(callable, fns)),
    "same_objects": again, "missing": missing,
    "cutlass": sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")),
    "codegen_or_jinja": sorted(m for m in sys.modules if m.startswith(("attn_prologue.codegen", "jinja2"))),
    "import_s": t1 - t0, "first_load_s": t3 - t2, "memory_hits_s": t4 - t3,
}))
"""


@pytest.mark.slow
def test_loading_built_entries_compiles_nothing(built):
    keys = [(k.variant, k.config.key, k.target) for _, k in ENTRIES]
    other = next(c for c in all_configs() if c != CHEAP.config)
    spec = {"root": str(built.root), "keys": keys, "missing": (CHEAP.variant, other.key, CHEAP.target)}
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", LOADER],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\n[test_build] loaded {len(keys)} built kernels in a fresh process: {r['first_load_s']:.3f}s "
        f"(first load includes importing tvm_ffi), imports {r['import_s']:.3f}s, process {wall:.2f}s, "
        f"memory hits {r['memory_hits_s'] * 1e6 / len(keys):.1f} us each"
    )
    assert r["compiles"] == 0
    assert r["disk_loads"] == len(keys)
    assert r["callable"] and r["same_objects"]
    assert r["missing"] == "FileNotFoundError"
    assert r["cutlass"] == [], "the tvm_ffi loading path imported the DSL compiler"
    assert r["codegen_or_jinja"] == []


@pytest.mark.slow
def test_has_says_whether_an_entry_is_built_without_building_it(built, tmp_path):
    cache = _copy_entry(built, CHEAP, tmp_path / "cache")
    other = KernelKey(CHEAP.variant, dataclasses.replace(CHEAP.config, folded_numerics=0), CHEAP.target)
    assert cache.has(CHEAP) and not cache.has(other)
    assert KernelCache(tmp_path / "empty", prebuilt=[cache]).has(CHEAP)  # an installed prebuilt cache counts
    CORRUPTIONS[next(iter(CORRUPTIONS))](cache.entry_dir(CHEAP))
    assert not cache.has(CHEAP) and cache.compiles == 0
