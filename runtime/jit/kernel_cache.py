"""The kernel cache: memory, then disk (objects written by `build` or an earlier run), then compile.

An entry is a directory keyed by DSL package fingerprint + host platform + target + variant +
launch config + source hash, holding `kernel.so`, `kernel.ptx` and `meta.json`. `meta.json` is
written last and records the sha256 of `kernel.so`, so a missing, truncated or corrupted entry is
a miss (rebuilt with a warning), never a crash. Builds take a per-entry file lock (with a timeout
that names the holder), re-check after acquiring it, and publish with an atomic rename, so
concurrent processes never see half an entry.

Trust. A cache entry is code this process will run, so:
- what this process creates is private whatever the umask: directories 0700, files 0600;
- an entry is used only if every directory from the cache root down to it and each of its files is
  owned by this user, is not group- or world-writable and is not a symbolic link; anything else is
  an `UntrustedCacheError` naming the path and the fix. `trust="shared"` (or
  `ATTN_PROLOGUE_CACHE_TRUST=shared`) accepts entries owned by another user (a team's prebuilt,
  read-only cache), still refusing writable or linked paths, and never writes there;
- the bytes that are hashed are the bytes that are loaded: `kernel.so` is read once through a file
  descriptor opened without following links, checked against `meta.json`, and those bytes are
  written to a private file that is loaded and then removed.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import stat
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import AttnPrologueError
from ..launch import LaunchConfig
from . import compiler

ENV_CACHE_DIR = "ATTN_PROLOGUE_CACHE"
ENV_TRUST = "ATTN_PROLOGUE_CACHE_TRUST"
ENV_LOCK_TIMEOUT = "ATTN_PROLOGUE_LOCK_TIMEOUT"
TRUST_MODES = ("own", "shared")


def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attn_prologue" / "kernels"


class CorruptEntryWarning(UserWarning):
    pass


class UntrustedCacheError(AttnPrologueError, PermissionError):
    """A cache path is owned by someone else, writable by others, or a symbolic link."""


class CacheLockTimeout(AttnPrologueError, TimeoutError):
    """Another process held an entry's build lock for longer than the timeout."""


class KernelLoadError(AttnPrologueError, RuntimeError):
    """An intact, trusted entry could not be loaded (e.g. a .so built for another machine)."""


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
    no one else, no links), never written."""
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            out.append(KernelCache(Path(ep.load().ROOT), trust="shared", prebuilt=[]))
        except Exception as exc:  # a broken kernels wheel never breaks serving: compile instead
            warnings.warn(f"prebuilt kernels {ep.name} ({ep.value}) not used: {exc}", CorruptEntryWarning)
    return out


class KernelCache:
    def __init__(
        self,
        root: Path | None = None,
        *,
        trust: str | None = None,
        lock_timeout: float | None = None,
        prebuilt: list[KernelCache] | None = None,
    ):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.trust = trust or os.environ.get(ENV_TRUST, "own")
        if self.trust not in TRUST_MODES:
            raise ValueError(f"cache trust must be one of {TRUST_MODES}, got {self.trust!r}")
        self.lock_timeout = float(lock_timeout or os.environ.get(ENV_LOCK_TIMEOUT, 900))
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

    # ---- paths and trust -------------------------------------------------------------------------
    def entry_dir(self, key: KernelKey) -> Path:
        return self.root / key.relpath()

    def meta_path(self, key: KernelKey) -> Path:
        return self.entry_dir(key) / "meta.json"

    def check_trusted(self, path: Path) -> None:
        """UntrustedCacheError unless `path` and every directory from the root down to it may be
        trusted (see the module docstring). Missing paths are fine (nothing to trust yet)."""
        path = Path(path)
        parts = path.relative_to(self.root).parts
        for depth in range(len(parts) + 1):
            p = self.root.joinpath(*parts[:depth])
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                return
            problem = None
            if stat.S_ISLNK(st.st_mode):
                problem = "is a symbolic link"
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                problem = f"is writable by other users (mode {stat.filemode(st.st_mode)})"
            elif self.trust == "own" and st.st_uid != os.geteuid():
                problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
            if problem:
                fix = (
                    f"remove it, or use a cache directory of your own ({ENV_CACHE_DIR}=...)"
                    if self.trust == "own"
                    else "a shared cache must be read-only for everyone but its owner"
                )
                raise UntrustedCacheError(
                    f"kernel cache path {p} {problem}: refusing to load code from it; {fix}"
                    + ("" if self.trust == "shared" else f" (a trusted team cache: {ENV_TRUST}=shared)")
                )

    def _make_private_dirs(self, d: Path) -> None:
        """Create d and its missing parents from the root down as 0700, whatever the umask (the
        root's own parents, outside the cache, are made as usual)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            if p == self.root:
                break
            p = p.parent
        for p in reversed(missing):
            try:
                os.mkdir(p, 0o700)
            except FileExistsError:
                pass
            os.chmod(p, 0o700)

    # ---- validation ------------------------------------------------------------------------------
    def read_meta(self, key: KernelKey) -> dict | None:
        """The entry's metadata if the entry is complete, intact and trusted, else None (a miss)."""
        meta, _ = self._read_entry(key)
        return meta

    def _read_entry(self, key: KernelKey) -> tuple[dict | None, bytes | None]:
        d = self.entry_dir(key)
        self.check_trusted(d / "kernel.so")
        self.check_trusted(d / "meta.json")
        try:
            meta = json.loads(_read_no_follow(d / "meta.json"))
            so = _read_no_follow(d / "kernel.so")
        except (OSError, ValueError):
            return None, None
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
            raise FileNotFoundError(
                f"kernel {key.variant} [{key.config.key}] for {key.target} is not in the shared cache "
                f"{self.root} (a shared cache is read-only: build into a cache of your own)"
            )
        d = self.entry_dir(key)
        self._make_private_dirs(d.parent)
        self.check_trusted(d.parent)
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
                _write_private(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
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
            _write_private(owner, f"pid {os.getpid()} on {os.uname().nodename}\n")
        except OSError:
            pass
        return _Held(lock, owner)

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
            for shipped in self.prebuilt if meta is None else ():
                meta, so = shipped._read_entry(key)
                if meta is not None:
                    self.prebuilt_loads += 1
                    break
            if meta is None:
                if not compile_if_missing:
                    raise FileNotFoundError(
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

    def _load_verified(self, key: KernelKey, so: bytes) -> Callable:
        """Load exactly the bytes that were hashed (from a private copy, removed once loaded)."""
        import tvm_ffi  # here: loading needs TVM-FFI, the cache's other uses (build, inspect) do not

        compiler.preload_runtime()
        fd, private = tempfile.mkstemp(prefix="attn-prologue-", suffix=".so")  # 0600, unique name
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(so)
            try:
                return tvm_ffi.load_module(private)[compiler.SYMBOL]
            except Exception as exc:
                raise KernelLoadError(
                    f"kernel cache entry {self.entry_dir(key)} passed its checks but did not load on this "
                    f"machine ({compiler.host_tag()}): {exc}"
                ) from exc
        finally:
            Path(private).unlink(missing_ok=True)


class _Held:
    """A held build lock: releasing it also removes the owner note."""

    def __init__(self, lock: FileLock, owner: Path):
        self.lock, self.owner = lock, owner

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.owner.unlink(missing_ok=True)
        self.lock.release()


def _read_no_follow(path: Path) -> bytes:
    """The file's bytes, read through a descriptor that refuses symbolic links and non-files."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedCacheError(f"kernel cache path {path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def _write_private(path: Path, text: str) -> None:
    """Write a 0600 file (whatever the umask) through a fresh temporary name and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
