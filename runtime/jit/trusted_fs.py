"""A cache tree opened through checked descriptors: what is checked is what is read.

Every directory from `/` down to a file is opened relative to its parent's descriptor without
following a link (O_NOFOLLOW) and checked through its own descriptor (fstat); a file is read through
the descriptor that was checked. So renaming a directory on the way (to a link, or to another
directory) after it was opened changes nothing that is read, and before, the link is refused and the
directory checked like any other. The root's ancestors are resolved once (realpath: /home may be a
link, if root's or this user's and in a directory others cannot write) and then walked the same way.

What is checked (UntrustedCacheError otherwise, naming the path and the fix):
- the root's ancestors, as OpenSSH's StrictModes checks a home directory: owned by root or by this
  user (in shared mode also by the root's owner), not writable by group or others unless sticky
  (/tmp). In shared mode the root's parent must not be writable by others even if sticky: there,
  whoever created the name first would own the cache, and shared mode trusts that owner;
- the root and everything in it: not a link, not writable by group or others, and in own mode owned
  by this user.
Directories this module creates (with their missing ancestors) are 0700 whatever the umask.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import AttnPrologueError

OWN, SHARED = "own", "shared"
TRUST_MODES = (OWN, SHARED)
ENV_CACHE_DIR, ENV_TRUST = "ATTN_PROLOGUE_CACHE", "ATTN_PROLOGUE_CACHE_TRUST"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WALK = os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
_LIST = os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC | os.O_RDONLY
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC  # a FIFO opens at once, then is refused


class UntrustedCacheError(AttnPrologueError, PermissionError):
    """A cache path is owned by someone else, writable by others, or a symbolic link."""


def refusal(path: Path, problem: str, trust: str, cache: Path | None = None) -> UntrustedCacheError:
    """The error for `path`; `cache` is given when path is one of the cache root's ancestors."""
    if cache is not None:
        where = f"kernel cache path {path} (an ancestor of the cache {cache})"
        fix = "use a cache in a directory only you or root can write"
    elif trust == OWN:
        where = f"kernel cache path {path}"
        fix = f"remove it, or use a cache directory of your own ({ENV_CACHE_DIR}=...)"
    else:
        where, fix = (
            f"kernel cache path {path}",
            "a shared cache must be read-only for everyone but its owner",
        )
    tail = f" (a trusted team cache: {ENV_TRUST}=shared)" if trust == OWN and cache is None else ""
    return UntrustedCacheError(f"{where} {problem}: refusing to load code from it; {fix}{tail}")


def _writable_by_others(st: os.stat_result) -> str:
    return f"is writable by other users (mode {stat.filemode(st.st_mode)})"


class Tree:
    """A cache root under a trust mode (`own` or `shared`)."""

    def __init__(self, root: Path, trust: str):
        self.root, self.trust = Path(root), trust

    def inside_problem(self, st: os.stat_result) -> str | None:
        """Why a path at or below the root cannot be trusted (None: it can)."""
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return _writable_by_others(st)
        if self.trust == OWN and st.st_uid != os.geteuid():
            return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        return None

    def check(self, path: Path, st: os.stat_result) -> None:
        problem = self.inside_problem(st)
        if problem:
            raise refusal(path, problem, self.trust)

    def _check_ancestor(self, path: Path, st: os.stat_result, owner: int | None, is_parent: bool) -> None:
        trusted = {0, os.geteuid()} | ({owner} if self.trust == SHARED and owner is not None else set())
        if st.st_uid not in trusted:
            problem = f"is owned by uid {st.st_uid} (neither root nor this user, uid {os.geteuid()})"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
            st.st_mode & stat.S_ISVTX and not (self.trust == SHARED and is_parent)
        ):
            problem = _writable_by_others(st) + (
                ": anyone could have made the shared cache in it" if st.st_mode & stat.S_ISVTX else ""
            )
        else:
            return
        raise refusal(path, problem, self.trust, cache=self.root)

    @contextmanager
    def opened(self, *parts: str, create: bool = False) -> Iterator[int | None]:
        """A descriptor of root/parts, every directory on the way checked; None where part of the path
        does not exist (create=True: missing directories are made 0700, ancestors of the root too).
        Descriptors are closed on exit."""
        fds: list[int] = []
        try:
            fd = self._open_root(create, fds)
            for depth, name in enumerate(parts):
                if fd is None:
                    break
                where = self.root.joinpath(*parts[: depth + 1])
                fd = self._open_dir(fd, name, where, create, fds)
                if fd is not None:
                    self.check(where, os.fstat(fd))
            yield fd
        finally:
            for fd in reversed(fds):
                os.close(fd)

    def _check_links_on_the_way(self) -> None:
        """The walk resolves links above the root first (realpath): each must be this user's or root's,
        in a directory that passes the ancestor rule, or whoever made it would choose the cache."""
        here = Path("/")
        for name in self.root.parent.parts[1:]:
            try:
                st = os.lstat(here / name)
            except FileNotFoundError:
                return
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (0, os.geteuid()):
                    problem = f"is a symbolic link owned by uid {st.st_uid} (neither root nor this user)"
                    raise refusal(here / name, problem, self.trust, cache=self.root)
                self._check_ancestor(here, os.stat(here), None, False)
            here = here / name

    def _open_root(self, create: bool, fds: list[int]) -> int | None:
        self._check_links_on_the_way()
        parent = Path(os.path.realpath(self.root.parent))
        fd = os.open("/", _WALK)
        fds.append(fd)
        ancestors = [(Path("/"), os.fstat(fd))]
        for depth, name in enumerate(parent.parts[1:], start=2):
            if create:  # check before making anything below it
                self._check_ancestor(*ancestors[-1], None, False)
            fd = self._open_dir(fd, name, Path(*parent.parts[:depth]), create, fds)
            if fd is None:
                return None
            ancestors.append((Path(*parent.parts[:depth]), os.fstat(fd)))
        if create:
            self._check_ancestor(*ancestors[-1], None, True)
        fd = self._open_dir(fd, self.root.name, self.root, create, fds)
        if fd is None:
            return None
        st = os.fstat(fd)
        for i, (path, ancestor) in enumerate(ancestors):
            self._check_ancestor(path, ancestor, st.st_uid, i == len(ancestors) - 1)
        self.check(self.root, st)
        return fd

    def _open_dir(self, parent_fd: int, name: str, where: Path, create: bool, fds: list[int]) -> int | None:
        """Open directory `name` in parent_fd without following a link (a link is refused; anything
        else that is not a directory is a miss); make it 0700 if missing and create=True."""
        try:
            fd = os.open(name, _WALK, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:  # made meanwhile (another builder): checked like any other
                pass
            fd = os.open(name, _LIST, dir_fd=parent_fd)
            fds.append(fd)
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, 0o700)  # (mkdir's mode went through the umask)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:  # ELOOP: a link; ENOTDIR: a link (O_PATH) or anything else that is not a directory
                link = exc.errno == errno.ELOOP or stat.S_ISLNK(
                    os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode
                )
            except FileNotFoundError:  # gone meanwhile
                return None
            if link:
                raise refusal(where, "is a symbolic link", self.trust) from None
            if create:
                raise NotADirectoryError(
                    f"{where} is in the kernel cache's way and not a directory"
                ) from None
            return None
        fds.append(fd)
        return fd

    def read(self, dir_fd: int, name: str, where: Path) -> bytes | None:
        """The bytes of regular file `name` in dir_fd, checked through the descriptor they are read
        from; None if it is missing or not a regular file (a FIFO, a device, a directory)."""
        try:
            fd = os.open(name, _READ, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refusal(where, "is a symbolic link", self.trust) from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            self.check(where, st)
            return f.read()


def read_regular(path: Path, limit: int) -> str:
    """The text of a regular file of at most `limit` bytes (ValueError otherwise). Opened without
    blocking, so a FIFO planted in its place is refused instead of hanging the reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path} has {st.st_size} bytes, more than the {limit} it may have")
        return f.read(limit + 1).decode()


def listable(fd: int) -> int:
    """A descriptor of the same directory that can be listed (a walk's may be O_PATH); the caller closes it."""
    return os.open(".", _LIST, dir_fd=fd)


def write_private(path: Path, data: str | bytes) -> None:
    """Write a 0600 file (whatever the umask) through a fresh temporary name and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
