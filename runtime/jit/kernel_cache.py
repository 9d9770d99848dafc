"""The kernel cache: memory, then disk (objects written by `build` or an earlier run), then compile.

An entry is a directory keyed by DSL package fingerprint + host platform + target + variant +
launch config + source hash, holding `kernel.so`, `kernel.ptx` and `meta.json`. `meta.json` is
written last and records the sha256 of `kernel.so`, so a missing, truncated or corrupted entry is
a miss (rebuilt with a warning), never a crash. Builds take a per-entry file lock (with a timeout
that names the holder), re-check after acquiring it, and publish with an atomic rename, so
concurrent processes never see half an entry.

Trust. A cache entry is code this process will run, so:
- what this process creates is private whatever the umask: directories 0700, files 0600;
- an entry is read through checked descriptors (trusted_fs.py): the root's ancestors as OpenSSH's
  StrictModes checks a home directory, the root and everything below it owned by this user, not
  group- or world-writable and not a symbolic link; anything else is an `UntrustedCacheError` naming
  the path and the fix. `trust="shared"` (or `ATTN_PROLOGUE_CACHE_TRUST=shared`) accepts a tree
  owned by another user (a team's read-only cache: that owner is trusted with code), still refusing
  writable or linked paths and a root whose parent others can write, and never writes there;
- the bytes that are hashed are the bytes that are loaded (loading.py: a sealed memfd, never TMPDIR).
Installed kernel wheels (`package-kernels`) are read as shared caches; one that is not trusted is
skipped with one warning, and the kernel is compiled into this cache instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from .. import env
from ..errors import AttnPrologueError
from ..launch import LaunchConfig
from . import cleaning, compiler, loading
from .cleaning import NotACacheError  # noqa: F401 (raised by clean)
from .trusted_fs import (
    ENV_CACHE_DIR,
    ENV_TRUST,
    TRUST_MODES,
    Tree,
    UntrustedCacheError,
    write_private,
)

ENV_LOCK_TIMEOUT = "ATTN_PROLOGUE_LOCK_TIMEOUT"


def default_cache_dir() -> Path:
    """$ATTN_PROLOGUE_CACHE, else $XDG_CACHE_HOME/attn_prologue/kernels (if absolute, as XDG says),
    else ~/.cache/attn_prologue/kernels; always absolute."""
    named = env.get(ENV_CACHE_DIR)
    if named is not None:
        return named
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return Path(os.path.abspath(base / "attn_prologue" / "kernels"))


class CorruptEntryWarning(UserWarning):
    pass


class CacheLockTimeout(AttnPrologueError, TimeoutError):
    """Another process held an entry's build lock for longer than the timeout."""


class KernelLoadError(AttnPrologueError, RuntimeError):
    """An intact, trusted entry could not be loaded (e.g. a .so built for another machine)."""


class KernelNotBuiltError(AttnPrologueError, FileNotFoundError):
    """A kernel is in no cache and may not be compiled here (a shared cache, compile_if_missing=False)."""


class CacheWriteError(AttnPrologueError, OSError):
    """A miss could not be built into the cache: it is read-only, full, or not writable by this user."""


@dataclass(frozen=True)
class KernelKey:
    variant: str
    config: LaunchConfig
    target: str

    def relpath(self) -> Path:
        src = compiler.source_hash(self.variant)[:16]
        # a .so is specific to the DSL build and to the host it was linked on (x86-64 vs aarch64)
        host = f"{compiler.dsl_fingerprint()}-{compiler.host_tag()}"
        return Path(host) / self.target / self.variant / f"{self.config.key}-{src}"


ENTRY_POINT_GROUP = "attn_prologue.kernels"  # installed wheels of prebuilt kernels (`package-kernels`)


def installed_prebuilt() -> list[KernelCache]:
    """Read-only caches shipped as installed wheels: each entry point of ENTRY_POINT_GROUP names a
    package whose `ROOT` is a kernel-cache tree. Trusted as a shared cache (owner anyone, writable by
    no one else, no links), never written; a wheel that cannot be used is skipped with a warning."""
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            shipped = KernelCache(Path(ep.load().ROOT), trust="shared", prebuilt=[])
            with shipped.tree.opened():  # its root and ancestors checked now
                pass
            out.append(shipped)
        except Exception as exc:  # a broken or untrusted kernels wheel never breaks serving: compile instead
            warnings.warn(f"prebuilt kernels {ep.name} ({ep.value}) not used: {exc}", CorruptEntryWarning)
    return out


def _timeout(seconds) -> float:
    if seconds is None:
        return env.get(ENV_LOCK_TIMEOUT)
    value = float(seconds)
    if not (0 < value < float("inf")):
        raise ValueError(f"lock_timeout must be a finite number of seconds > 0, got {seconds!r}")
    return value


class KernelCache:
    def __init__(
        self,
        root: Path | None = None,
        *,
        trust: str | None = None,
        lock_timeout: float | None = None,
        prebuilt: list[KernelCache] | None = None,
    ):
        self.root = Path(os.path.abspath(root)) if root is not None else default_cache_dir()
        self.trust = trust if trust is not None else env.get(ENV_TRUST)
        if self.trust not in TRUST_MODES:
            raise ValueError(f"cache trust must be one of {TRUST_MODES}, got {self.trust!r}")
        self.lock_timeout = _timeout(lock_timeout)
        self.tree = Tree(self.root, self.trust)
        self._prebuilt = prebuilt  # None: the installed kernel wheels, looked up on first need
        self._loaded: dict[KernelKey, Callable] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # compiles done by this process (a test asserts 0 after `build`)
        self.disk_loads = 0
        self.prebuilt_loads = 0

    @property
    def prebuilt(self) -> list[KernelCache]:
        if self._prebuilt is None:
            self._prebuilt = installed_prebuilt()
        return self._prebuilt

    # ---- paths -----------------------------------------------------------------------------------
    def entry_dir(self, key: KernelKey) -> Path:
        return self.root / key.relpath()

    def meta_path(self, key: KernelKey) -> Path:
        return self.entry_dir(key) / "meta.json"

    def make_private_dirs(self, *parts: str) -> Path:
        """root/parts, made (with missing ancestors of the root) 0700 whatever the umask, and checked."""
        with self.tree.opened(*parts, create=True):
            return self.root.joinpath(*parts)

    def read_files(self, parts: tuple[str, ...], names: tuple[str, ...]) -> dict[str, bytes | None] | None:
        """The bytes of root/parts/<name> for each name (None: missing or not a regular file), read
        through checked descriptors; None when the directory does not exist."""
        with self.tree.opened(*parts) as fd:
            if fd is None:
                return None
            where = self.root.joinpath(*parts)
            return {name: self.tree.read(fd, name, where / name) for name in names}

    # ---- validation ------------------------------------------------------------------------------
    def read_meta(self, key: KernelKey) -> dict | None:
        """The entry's metadata if the entry is complete, intact and trusted, else None (a miss)."""
        meta, _ = self._read_entry(key)
        return meta

    def _read_entry(self, key: KernelKey) -> tuple[dict | None, bytes | None]:
        files = self.read_files(key.relpath().parts, ("meta.json", "kernel.so"))
        if files is None or files["meta.json"] is None or files["kernel.so"] is None:
            return None, None
        try:
            meta = json.loads(files["meta.json"])
        except (ValueError, RecursionError):
            return None, None
        so = files["kernel.so"]
        if not isinstance(meta, dict):
            return None, None
        expected = {
            "variant": key.variant,
            "config": key.config.key,
            "target": key.target,
            "dsl_fingerprint": compiler.dsl_fingerprint(),
            "host": compiler.host_tag(),
            "source_hash": compiler.source_hash(key.variant),
        }
        if any(meta.get(k) != v for k, v in expected.items()):
            return None, None
        if meta.get("so_sha256") != hashlib.sha256(so).hexdigest():
            return None, None
        return meta, so

    # ---- building --------------------------------------------------------------------------------
    def ensure_built(self, key: KernelKey, *, rebuild: bool = False) -> dict:
        """Build the entry unless an intact one exists (rebuild=True: even then); safe against
        concurrent builders."""
        meta = None if rebuild else self.read_meta(key)
        if meta is not None:
            return meta
        if self.trust == "shared":
            raise KernelNotBuiltError(
                f"kernel {key.variant} [{key.config.key}] for {key.target} is not in the shared cache "
                f"{self.root} (a shared cache is read-only: build into a cache of your own)"
            )
        try:
            return self._build(key, rebuild)
        except AttnPrologueError:
            raise
        except OSError as exc:  # a read-only or full cache, or one this user cannot write
            raise CacheWriteError(
                f"could not build kernel {key.variant} [{key.config.key}] for {key.target} into the cache "
                f"{self.root}: {exc}; free space there, or name a writable cache ({ENV_CACHE_DIR}=...)"
            ) from exc

    def _build(self, key: KernelKey, rebuild: bool) -> dict:
        d = self.entry_dir(key)
        self.make_private_dirs(*key.relpath().parts[:-1])
        with self._build_lock(d):
            meta = None if rebuild else self.read_meta(key)  # another process may have finished it meanwhile
            if meta is not None:
                return meta
            if d.exists() and any(d.iterdir()):  # (an interrupted build leaves a partial folder)
                warnings.warn(
                    f"kernel cache entry {d} is incomplete or corrupted; rebuilding it", CorruptEntryWarning
                )
            tmp = d.parent / f".tmp-{d.name}-{uuid.uuid4().hex[:8]}"
            os.mkdir(tmp, 0o700)
            try:
                meta = compiler.compile_entry(key.variant, key.config, key.target, tmp)
                for f in tmp.iterdir():
                    os.chmod(f, 0o600)
                write_private(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
                if d.exists():
                    shutil.rmtree(d)
                os.replace(tmp, d)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            self.compiles += 1
            return meta

    def _build_lock(self, d: Path):
        lock_path = Path(str(d) + ".lock")
        lock = FileLock(str(lock_path), timeout=self.lock_timeout, mode=0o600)
        owner = Path(str(d) + ".lock-owner")
        try:
            lock.acquire()
        except Timeout:
            try:
                holder = owner.read_text().strip()
            except OSError:
                holder = "unknown"
            raise CacheLockTimeout(
                f"waited {self.lock_timeout:.0f} s for the build lock {lock_path} (held by {holder}); if that "
                f"process is gone, delete the lock file, or raise {ENV_LOCK_TIMEOUT}"
            ) from None
        try:
            write_private(owner, f"pid {os.getpid()} on {os.uname().nodename}\n")
        except OSError:
            pass
        return _Held(lock, owner)

    def clean(self) -> list[str]:
        """Remove what this cache made (cleaning.py: a root with the cache's marker, only layouts the
        cache writes, checked before anything is removed); the names removed. UntrustedCacheError for a
        root that is a link, not this user's or writable by others; NotACacheError for anything else."""
        return cleaning.clean(self.tree)

    # ---- loading ---------------------------------------------------------------------------------
    def load(self, key: KernelKey, *, compile_if_missing: bool = True) -> Callable:
        """The callable for key: memory, then this cache on disk, then the installed prebuilt kernels,
        then compile (into this cache)."""
        fn = self._loaded.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._loaded.get(key)
            if fn is not None:
                return fn
            meta, so = self._read_entry(key)
            if meta is not None:
                self.disk_loads += 1
            else:
                meta, so = self._read_prebuilt(key)
            if meta is None:
                if not compile_if_missing:
                    raise KernelNotBuiltError(
                        f"kernel {key.variant} [{key.config.key}] for {key.target} is not built"
                    )
                self.ensure_built(key)
                meta, so = self._read_entry(key)
                if meta is None:
                    raise KernelLoadError(
                        f"kernel cache entry {self.entry_dir(key)} vanished after its build"
                    )
            try:
                fn = self._load_verified(key, so)
            except KernelLoadError as exc:
                if not (compile_if_missing and self.trust != "shared" and compiler.toolchain_available()):
                    raise
                # an intact entry that does not load here (e.g. linked against another runtime): build
                # it again on this machine, once; a second failure is the error
                warnings.warn(f"{exc}; rebuilding it once", CorruptEntryWarning)
                self.ensure_built(key, rebuild=True)
                meta, so = self._read_entry(key)
                if meta is None:
                    raise
                fn = self._load_verified(key, so)
            self._loaded[key] = fn
            return fn

    def has(self, key: KernelKey) -> bool:
        """Is key's kernel loaded, built in this cache or in an installed prebuilt one? (Builds nothing.)"""
        if key in self._loaded or self.read_meta(key) is not None:
            return True
        for shipped in list(self.prebuilt):
            try:
                if shipped.read_meta(key) is not None:
                    return True
            except UntrustedCacheError:
                continue  # load() skips it with its warning
        return False

    def _read_prebuilt(self, key: KernelKey) -> tuple[dict | None, bytes | None]:
        for shipped in list(self.prebuilt):
            try:
                meta, so = shipped._read_entry(key)
            except UntrustedCacheError as exc:  # skipped from now on, like a broken wheel: one warning
                self.prebuilt.remove(shipped)
                warnings.warn(f"prebuilt kernels in {shipped.root} not used: {exc}", CorruptEntryWarning)
                continue
            if meta is not None:
                self.prebuilt_loads += 1
                return meta, so
        return None, None

    def _load_verified(self, key: KernelKey, so: bytes) -> Callable:
        """Load exactly the bytes that were hashed. A LoadEnvironmentError (this machine would not map
        them) passes through: the entry is not at fault, so it is not rebuilt."""
        compiler.preload_runtime()
        private = (lambda: self.tree.opened(".load", create=True)) if self.trust == "own" else None
        try:
            module = loading.load(so, _load_tvm_module, private)
        except loading.LoadEnvironmentError:
            raise
        except Exception as exc:
            raise KernelLoadError(
                f"kernel cache entry {self.entry_dir(key)} passed its checks but did not load on this "
                f"machine ({compiler.host_tag()}): {exc}"
            ) from exc
        try:
            return module[compiler.SYMBOL]
        except Exception as exc:  # a trusted library without the kernel's symbol: not a kernel entry
            raise KernelLoadError(
                f"kernel cache entry {self.entry_dir(key)} has no {compiler.SYMBOL} to call ({exc})"
            ) from exc


def _load_tvm_module(path: str):
    """tvm_ffi.load_module without its file-name check (a memfd's path has no `.so` suffix): the loader
    load_module picks for a `.so`, and the module is kept alive for the process, as load_module does."""
    import tvm_ffi  # here: loading needs TVM-FFI, the cache's other uses (build, inspect) do not

    module = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(path, "so")
    tvm_ffi.get_global_func("ffi.ModuleGlobalsAdd")(module)
    return module


class _Held:
    """A held build lock: releasing it also removes the owner note."""

    def __init__(self, lock: FileLock, owner: Path):
        self.lock, self.owner = lock, owner

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.owner.unlink(missing_ok=True)
        self.lock.release()
