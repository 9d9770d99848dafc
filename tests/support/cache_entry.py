"""One real kernel-cache entry (a cheap sm_90a kernel, compiled here without a GPU) for the cache's
trust tests, and copies of it that a test may then damage; plus a process running as another user."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.variants import ArchFamily

KEY = KernelKey("kv_d512r64_bf16_bf16_sm90", ArchFamily.SM90.default_config, "sm_90a")
IS_ROOT = os.geteuid() == 0
OTHER_UID = 65534  # nobody


def build_one(root: Path) -> KernelCache:
    """A cache holding KEY, built under umask 000 (so any file that follows the umask shows it)."""
    old = os.umask(0)
    try:
        cache = KernelCache(root)
        cache.ensure_built(KEY)
    finally:
        os.umask(old)
    return cache


def copy_of(built: KernelCache, root: Path, **kw) -> KernelCache:
    shutil.copytree(built.root, root, symlinks=True)
    return KernelCache(root, **kw)


def plant_foreign(cache: KernelCache, key: KernelKey = KEY) -> bytes:
    """Make key's entry in `cache` intact by every check but someone else's: other kernel.so bytes
    (a loadable object still: trailing bytes), the matching hash, and "foreign" in its meta. Returns
    those bytes."""
    entry = cache.entry_dir(key)
    so = (entry / "kernel.so").read_bytes() + b"\0not the kernel this cache built"
    (entry / "kernel.so").write_bytes(so)
    meta = json.loads((entry / "meta.json").read_text())
    meta.update(so_sha256=hashlib.sha256(so).hexdigest(), foreign=True)
    (entry / "meta.json").write_text(json.dumps(meta))
    return so


def as_other_user(*command: str, **kw) -> subprocess.CompletedProcess:
    """Run a command as OTHER_UID (no supplementary groups); the caller checks IS_ROOT first."""
    return subprocess.run(
        list(command), user=OTHER_UID, group=OTHER_UID, extra_groups=[], capture_output=True, text=True,
        timeout=120, **kw,
    )  # fmt: skip
