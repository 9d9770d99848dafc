"""The kernel cache as a code-loading path: what it creates is private, what it loads is trusted
and is exactly what was verified, broken metadata is a miss, locks time out naming the holder.

One real entry is compiled per module (a cheap sm_90a kernel); each test copies it into a cache of
its own and then plants the condition it checks."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import (
    CacheLockTimeout,
    KernelCache,
    KernelKey,
    UntrustedCacheError,
)
from attn_prologue.variants import ArchFamily

KEY = KernelKey("kv_d512r64_bf16_bf16_sm90", ArchFamily.SM90.default_config, "sm_90a")
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding KEY, built under umask 000 (so any file that follows the umask shows it)."""
    root = tmp_path_factory.mktemp("trust") / "cache"
    old = os.umask(0)
    try:
        cache = KernelCache(root)
        cache.ensure_built(KEY)
    finally:
        os.umask(old)
    return cache


def copy_of(built: KernelCache, tmp_path, **kw) -> KernelCache:
    root = tmp_path / "cache"
    shutil.copytree(built.root, root, symlinks=True)
    return KernelCache(root, **kw)


def test_everything_created_is_private_whatever_the_umask(built):
    entry = built.entry_dir(KEY)
    assert built.read_meta(KEY) is not None
    dirs = [built.root / p for p in entry.relative_to(built.root).parents] + [entry]
    assert len(dirs) >= 5 and built.root in dirs
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    files = sorted(entry.iterdir())
    assert {f.name for f in files} == {"kernel.so", "kernel.ptx", "meta.json"}
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


@pytest.mark.skipif(not IS_ROOT, reason="planting another user's entry needs chown (root)")
def test_an_entry_owned_by_another_user_is_refused_unless_shared(built, tmp_path):
    cache = copy_of(built, tmp_path)
    for p in [cache.root, *cache.root.rglob("*")]:
        os.chown(p, 54321, 54321, follow_symlinks=False)
    with pytest.raises(UntrustedCacheError, match="owned by uid 54321") as info:
        cache.load(KEY, compile_if_missing=False)
    assert str(cache.root) in str(info.value) and "ATTN_PROLOGUE_CACHE" in str(info.value)
    shared = KernelCache(cache.root, trust="shared")
    assert shared.read_meta(KEY) is not None  # a trusted team cache: loads (the .so is verified)
    with pytest.raises(FileNotFoundError, match="read-only"):  # and is never written
        shared.ensure_built(KernelKey(KEY.variant, KEY.config, "sm_100a"))


@pytest.mark.parametrize("where", ["root", "entry dir", "kernel.so", "meta.json"])
def test_a_path_writable_by_others_is_refused(built, tmp_path, where):
    cache = copy_of(built, tmp_path)
    entry = cache.entry_dir(KEY)
    target = {
        "root": cache.root,
        "entry dir": entry,
        "kernel.so": entry / "kernel.so",
        "meta.json": entry / "meta.json",
    }
    p = target[where]
    os.chmod(p, os.stat(p).st_mode | stat.S_IWOTH)
    with pytest.raises(UntrustedCacheError, match="writable by other users"):
        cache.load(KEY, compile_if_missing=False)
    with pytest.raises(UntrustedCacheError):  # also refused as the shared, read-only kind
        KernelCache(cache.root, trust="shared").read_meta(KEY)


@pytest.mark.parametrize("what", ["kernel.so", "entry dir"])
def test_a_symbolic_link_in_the_cache_is_refused(built, tmp_path, what):
    cache = copy_of(built, tmp_path)
    entry = cache.entry_dir(KEY)
    elsewhere = tmp_path / "elsewhere"
    if what == "kernel.so":
        elsewhere.write_bytes((entry / "kernel.so").read_bytes())
        (entry / "kernel.so").unlink()
        (entry / "kernel.so").symlink_to(elsewhere)
    else:
        shutil.move(entry, elsewhere)
        entry.symlink_to(elsewhere)
    with pytest.raises(UntrustedCacheError, match="symbolic link"):
        cache.load(KEY, compile_if_missing=False)


@pytest.mark.parametrize("text", ["[]", "null", "7", '"a string"', "{}"])
def test_meta_json_that_is_not_an_entry_is_a_miss(built, tmp_path, text):
    cache = copy_of(built, tmp_path)
    (cache.entry_dir(KEY) / "meta.json").write_text(text)
    assert cache.read_meta(KEY) is None
    with pytest.raises(FileNotFoundError, match="not built"):
        cache.load(KEY, compile_if_missing=False)


def test_the_host_platform_is_part_of_the_key(built, monkeypatch):
    here = built.entry_dir(KEY)
    assert compiler.host_tag() in str(here)
    assert built.read_meta(KEY)["host"] == compiler.host_tag()
    compiler.host_tag.cache_clear()
    monkeypatch.setattr(compiler.platform, "machine", lambda: "aarch64")
    try:
        assert built.entry_dir(KEY) != here and "aarch64" in str(built.entry_dir(KEY))
        assert built.read_meta(KEY) is None  # an x86-64 object is not offered to an aarch64 host
    finally:
        compiler.host_tag.cache_clear()


def test_a_held_build_lock_times_out_naming_the_holder(built, tmp_path):
    cache = copy_of(built, tmp_path, lock_timeout=0.5)
    other = KernelKey(KEY.variant, KEY.config, "sm_100a")
    d = cache.entry_dir(other)
    d.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(d) + ".lock", str(d) + ".lock-owner"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockTimeout, match=f"held by pid {holder.pid}"):
            cache.ensure_built(other)
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = r"""
import os, sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire()
open(sys.argv[2], "w").write(f"pid {os.getpid()} on test\n")
print("held", flush=True); time.sleep(60)
"""
