"""Handing verified bytes to the dynamic loader, so that the bytes hashed are the bytes mapped.

The bytes go into a sealed memfd (Linux: memory, not a file system, so a `noexec` or full TMPDIR
does not matter). The loader knows a library by the path it was opened under, and asked for a path
it has loaded before it hands back that library without opening anything; so the memfd is opened
through a name of its own: a link to `/proc/self/fd/N` made in the 0700 `.load` directory inside a
cache root this user owns, through that directory's checked descriptor D, and handed to the loader as
`/proc/self/fd/D/<name>`, never as a path below the cache root: no link on the way to the cache is
resolved again after the checks (the link is only a name: the pages mapped are the memfd's; it is
removed once loaded). Without such a directory (a shared cache) the memfd is loaded from
`/proc/self/fd/N` and stays open, so that number never names anything else. Without a memfd (not
Linux, a policy that forbids executable memfds) the bytes go into a 0600 file made in that directory
through D instead, loaded the same way. What one process loaded for some bytes is handed out again
for the same bytes and loader.

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
from contextlib import AbstractContextManager, ExitStack

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


PrivateDir = Callable[[], AbstractContextManager]  # () -> context yielding a checked directory descriptor


def load(data: bytes, loader: Callable[[str], object], private_dir: PrivateDir | None) -> object:
    """loader(path) on a path holding exactly `data`. `private_dir()` is a context that makes (if
    missing), checks and yields a descriptor of the 0700 directory for the name of the memfd or the
    fallback copy; None: there is none (a shared cache)."""
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
    keep = False
    try:
        with ExitStack() as stack:
            dir_fd = None if private_dir is None else _entered(stack, private_dir)
            name = None if dir_fd is None else _link_in(dir_fd, proc_path, digest)
            if name is not None:
                try:
                    return _classified(loader, f"/proc/self/fd/{dir_fd}/{name}")
                finally:
                    os.unlink(name, dir_fd=dir_fd)
        keep = True  # loaded under the descriptor's own name: that number must name nothing else
        return _classified(loader, proc_path)
    except BaseException:
        keep = False
        raise
    finally:
        if not keep:
            os.close(fd)


def _entered(stack: ExitStack, private_dir) -> int | None:
    """The private directory's checked descriptor (None: there is none here: read-only, full, untrusted)."""
    try:
        return stack.enter_context(private_dir())
    except OSError:
        return None


def _link_in(dir_fd: int, target: str, digest: str) -> str | None:
    """A fresh name for `target` in the directory dir_fd (None: it is not writable)."""
    name = f"{digest[:16]}-{uuid.uuid4().hex[:8]}.so"
    try:
        os.symlink(target, name, dir_fd=dir_fd)
    except OSError:
        return None
    return name


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


def _load_private_copy(data: bytes, digest: str, loader, private_dir) -> object:
    try:
        with private_dir() as dir_fd:
            if not os.path.isdir(f"/proc/self/fd/{dir_fd}"):
                raise OSError(errno.ENOENT, "no /proc/self/fd to load the copy through its checked directory")
            name = f"{digest[:16]}-{uuid.uuid4().hex[:8]}.so"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return _classified(loader, f"/proc/self/fd/{dir_fd}/{name}")
            finally:
                os.unlink(name, dir_fd=dir_fd)
    except LoadEnvironmentError:
        raise
    except OSError as exc:
        raise LoadEnvironmentError(f"could not stage the private copy of a verified library: {exc}") from exc


def _classified(loader, path: str):
    try:
        return loader(path)
    except Exception as exc:
        if any(s in str(exc) for s in ENVIRONMENT_FAULTS):
            raise LoadEnvironmentError(f"this machine would not map a verified library: {exc}") from exc
        raise
