"""Handing verified bytes to the dynamic loader, so that the bytes hashed are the bytes mapped.

The bytes go into a sealed memfd (Linux: memory, not a file system, so a `noexec` or full TMPDIR
does not matter). The loader knows a library by the path it was opened under, and asked for a path
it has loaded before it hands back that library without opening anything; so the memfd is opened
through a name of its own, a link to `/proc/self/fd/N` in a 0700 directory inside a cache root this
user owns, removed once loaded (the link is only a name: the pages mapped are the memfd's). Without
such a directory (a shared cache) the memfd is loaded from `/proc/self/fd/N` and stays open, so that
number never names anything else. Without a memfd (not Linux, a policy that forbids executable
memfds) the bytes go into a 0600 file in that directory instead. What one process loaded for some
bytes is handed out again for the same bytes and loader.

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

_loaded: dict[tuple[str, Callable], object] = {}  # (sha256, loader) -> what the loader returned
_lock = threading.Lock()


class LoadEnvironmentError(AttnPrologueError, OSError):
    """A verified library could not be handed to the loader on this machine (no memory or disk for
    the private copy, a noexec mount, a security policy): not the entry's fault, so never rebuilt."""


def load(data: bytes, loader: Callable[[str], object], private_dir: Callable[[], Path] | None) -> object:
    """loader(path) on a path holding exactly `data`. `private_dir` makes (and returns) the 0700
    directory for the name of the memfd or the fallback copy; None: there is none (a shared cache)."""
    key = (hashlib.sha256(data).hexdigest(), loader)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load_once(data, key[0], loader, private_dir)
        return _loaded[key]


def _load_once(data: bytes, digest: str, loader, private_dir) -> object:
    try:
        fd = _memfd(data)
    except (OSError, AttributeError) as exc:  # AttributeError: no os.memfd_create here
        if private_dir is None:
            raise LoadEnvironmentError(f"no memfd to load a verified library from ({exc})") from exc
        return _load_private_copy(data, digest, loader, private_dir)
    proc_path = f"/proc/self/fd/{fd}"
    link = _link_to(proc_path, digest, private_dir)
    keep = False
    try:
        result = _classified(loader, proc_path if link is None else str(link))
        keep = link is None  # loaded under the descriptor's own name: that number must name nothing else
        return result
    finally:
        if link is not None:
            link.unlink(missing_ok=True)
        if not keep:
            os.close(fd)


def _memfd(data: bytes) -> int:
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
        if not os.path.exists(f"/proc/self/fd/{fd}"):  # (no /proc mounted)
            raise OSError(errno.ENOENT, "no /proc/self/fd to load it from")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_to(target: str, digest: str, private_dir) -> Path | None:
    """A fresh name for `target` in the private directory (None: there is none, or it is not writable)."""
    if private_dir is None:
        return None
    try:
        link = private_dir() / f"{digest[:16]}-{uuid.uuid4().hex[:8]}.so"
        os.symlink(target, link)
    except OSError:
        return None
    return link


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
