"""Handing verified bytes to the dynamic loader, so that the bytes hashed are the bytes mapped.

The bytes go into a sealed memfd (Linux: memory, not a file system, so a `noexec` or full TMPDIR
does not matter) and are loaded from `/proc/self/fd/N`. The loader knows a library by the path it was
opened under, and asked for a path it has already loaded it hands back that library without
opening anything: so a memfd stays open for the process (its number is never reused) and is made
once per distinct content (by sha256). Where memfd is unavailable (not Linux, a policy that forbids
executable memfds), the bytes go into a 0600 file, with a name of their own, in a 0700 directory
inside a cache root this user owns, removed once loaded.

A failure to stage, or a loader that refuses to map the pages (noexec, a security policy, no
memory), is a `LoadEnvironmentError`: not the entry's fault, so the cache never rebuilds it for that.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import AttnPrologueError

MFD_EXEC = 0x0010  # linux/memfd.h (Linux >= 6.3): executable even under vm.memfd_noexec=1
_SEALS = getattr(fcntl, "F_SEAL_SEAL", 1) | getattr(fcntl, "F_SEAL_SHRINK", 2)
_SEALS |= getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_WRITE", 8)
# what dlerror() says when the bytes were fine but the machine would not map them executable
ENVIRONMENT_FAULTS = ("failed to map segment", "Operation not permitted", "Cannot allocate memory")

_staged: dict[str, str] = {}  # sha256 -> the /proc/self/fd path of its memfd
_lock = threading.Lock()


class LoadEnvironmentError(AttnPrologueError, OSError):
    """A verified library could not be handed to the loader on this machine (no memory or disk for
    the private copy, a noexec mount, a security policy): not the entry's fault, so never rebuilt."""


def _memfd(data: bytes) -> str:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        fd = os.memfd_create("attn-prologue", flags | MFD_EXEC)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a kernel before 6.3 does not know MFD_EXEC
            raise
        fd = os.memfd_create("attn-prologue", flags)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # nothing in this process can change it now
        path = f"/proc/self/fd/{fd}"
        if not os.path.exists(path):  # (no /proc mounted)
            raise OSError(errno.ENOENT, "no /proc/self/fd to load it from")
    except BaseException:
        os.close(fd)
        raise
    return path


def load(data: bytes, loader: Callable[[str], object], private_dir: Callable[[], Path] | None) -> object:
    """loader(path) on a path holding exactly `data`. `private_dir` makes (and returns) the 0700
    directory for the fallback copy; None: no fallback (a read-only cache)."""
    digest = hashlib.sha256(data).hexdigest()
    with _lock:
        path = _staged.get(digest)
        if path is None:
            try:
                path = _staged[digest] = _memfd(data)
            except (OSError, AttributeError) as exc:  # AttributeError: no os.memfd_create here
                if private_dir is None:
                    raise LoadEnvironmentError(f"no memfd to load a verified library from ({exc})") from exc
                return _load_private_copy(data, digest, loader, private_dir)
    return _classified(loader, path)


def _load_private_copy(data: bytes, digest: str, loader, private_dir) -> object:
    try:
        path = private_dir() / f"{digest[:16]}-{uuid.uuid4().hex[:8]}.so"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise LoadEnvironmentError(f"could not write the private copy of a verified library: {exc}") from exc
    try:
        return _classified(loader, str(path))
    finally:
        path.unlink(missing_ok=True)


def _classified(loader, path: str):
    try:
        return loader(path)
    except Exception as exc:
        if any(s in str(exc) for s in ENVIRONMENT_FAULTS):
            raise LoadEnvironmentError(f"this machine would not map a verified library: {exc}") from exc
        raise
