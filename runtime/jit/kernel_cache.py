"""The kernel cache: memory, then disk (objects written by `build` or an earlier run), then compile.

An entry is a directory keyed by DSL package fingerprint + target + variant + launch config +
source hash, holding `kernel.so`, `kernel.ptx` and `meta.json`. `meta.json` is written last and
records the sha256 of `kernel.so`, so a missing, truncated or corrupted entry is a miss (rebuilt
with a warning), never a crash. Builds take a per-entry file lock, re-check after acquiring it,
and publish with an atomic rename, so concurrent processes never see half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..launch import LaunchConfig
from . import compiler

ENV_CACHE_DIR = "ATTN_PROLOGUE_CACHE"


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attn_prologue" / "kernels"


class CorruptEntryWarning(UserWarning):
    pass


@dataclass(frozen=True)
class KernelKey:
    variant: str
    config: LaunchConfig
    target: str

    def relpath(self) -> Path:
        src = compiler.source_hash(self.variant)[:16]
        return Path(compiler.dsl_fingerprint()) / self.target / self.variant / f"{self.config.key}-{src}"


class KernelCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self._loaded: dict[KernelKey, Callable] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # compiles done by this process (a test asserts 0 after `build`)
        self.disk_loads = 0

    # ---- paths and validation ------------------------------------------------------------------
    def entry_dir(self, key: KernelKey) -> Path:
        return self.root / key.relpath()

    def meta_path(self, key: KernelKey) -> Path:
        return self.entry_dir(key) / "meta.json"

    def read_meta(self, key: KernelKey) -> dict | None:
        """The entry's metadata if the entry is complete and intact, else None."""
        d = self.entry_dir(key)
        try:
            meta = json.loads((d / "meta.json").read_text())
            so = (d / "kernel.so").read_bytes()
        except (OSError, ValueError):
            return None
        expected = {
            "variant": key.variant,
            "config": key.config.key,
            "target": key.target,
            "dsl_fingerprint": compiler.dsl_fingerprint(),
            "source_hash": compiler.source_hash(key.variant),
        }
        if any(meta.get(k) != v for k, v in expected.items()):
            return None
        if meta.get("so_sha256") != hashlib.sha256(so).hexdigest():
            return None
        return meta

    # ---- building --------------------------------------------------------------------------------
    def ensure_built(self, key: KernelKey) -> dict:
        """Build the entry unless an intact one exists; safe against concurrent builders."""
        meta = self.read_meta(key)
        if meta is not None:
            return meta
        d = self.entry_dir(key)
        d.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(d) + ".lock"):
            meta = self.read_meta(key)  # another process may have finished it meanwhile
            if meta is not None:
                return meta
            if d.exists() and any(d.iterdir()):  # (ninja creates empty output folders)
                warnings.warn(
                    f"kernel cache entry {d} is incomplete or corrupted; rebuilding it", CorruptEntryWarning
                )
            tmp = d.parent / f".tmp-{d.name}-{uuid.uuid4().hex[:8]}"
            try:
                meta = compiler.compile_entry(key.variant, key.config, key.target, tmp)
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
                if d.exists():
                    shutil.rmtree(d)
                os.replace(tmp, d)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            self.compiles += 1
            return meta

    # ---- loading ---------------------------------------------------------------------------------
    def load(self, key: KernelKey, *, compile_if_missing: bool = True) -> Callable:
        """The callable for key: memory, then disk, then compile (then disk)."""
        fn = self._loaded.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._loaded.get(key)
            if fn is not None:
                return fn
            meta = self.read_meta(key)
            if meta is None:
                if not compile_if_missing:
                    raise FileNotFoundError(
                        f"kernel {key.variant} [{key.config.key}] for {key.target} is not built"
                    )
                self.ensure_built(key)
            else:
                self.disk_loads += 1
            fn = _load_so(self.entry_dir(key) / "kernel.so")
            self._loaded[key] = fn
            return fn


def _load_so(path: Path) -> Callable:
    import tvm_ffi

    compiler.preload_runtime()
    return tvm_ffi.load_module(str(path))[compiler.SYMBOL]
