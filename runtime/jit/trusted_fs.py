"""A cache tree opened through checked descriptors: what is checked is what is read.

Every directory from `/` down to a file is opened relative to its parent's descriptor without
following a link (O_NOFOLLOW) and checked through its own descriptor (fstat); a file is read through
the descriptor that was checked. So renaming a directory on the way (to a link, or to another
directory) after it was opened changes nothing that is read, and before, the link is refused and the
directory checked like any other. The path to the root is resolved once, link by link (/home may be
a link): every link met, links inside a link's target included, must be root's or this user's and sit
in a directory that passes the ancestor rule, or whoever could change it would choose the cache. The
resolved path is then walked the same way, so a link changed later is refused, never followed.

What is checked (UntrustedCacheError otherwise, naming the path and the fix):
- the root's ancestors, as OpenSSH's StrictModes checks a home directory: owned by root or by this
  user (in shared mode also by the root's owner), not writable by group or others unless sticky
  (/tmp). In shared mode the root's parent must not be writable by others even if sticky: there,
  whoever created the name first would own the cache, and shared mode trusts that owner;
- the root and everything in it: not a link, not writable by group or others, owned by this user
  (own mode) or by the root's owner or root (shared mode: a third user's subtree is not trusted).
Directories this module creates (with their missing ancestors) are 0700 whatever the umask; a root it
creates gets a MARKER file, which `clean` requires (so it never empties a directory it did not make).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
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
MAX_LINKS = 40  # links followed while resolving one path (the kernel's own limit, ELOOP)
MAX_FILE_BYTES = 1 << 30  # no kernel, native part or record comes near; a larger file is not the cache's
MAX_JSON_BYTES = 4 << 20  # a meta.json or record: a few KiB
MARKER = ".attn-prologue-cache"  # written into a root the cache creates; `clean` cleans only such roots


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
        self._opened = threading.local()  # owner: the uid of the root this thread's walk opened

    def inside_problem(self, st: os.stat_result, owner: int | None = None) -> str | None:
        """Why a path at or below the root (owned by uid `owner`) cannot be trusted (None: it can)."""
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return _writable_by_others(st)
        if self.trust == OWN and st.st_uid != os.geteuid():
            return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        if self.trust == SHARED and owner is not None and st.st_uid not in (0, owner):
            return f"is owned by uid {st.st_uid}, neither root nor the shared cache's owner (uid {owner})"
        return None

    def check(self, path: Path, st: os.stat_result) -> None:
        problem = self.inside_problem(st, getattr(self._opened, "owner", None))
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

    def _resolved_parent(self) -> Path:
        """The root's parent with every link met resolved, links inside a link's target included (as
        the kernel would resolve it). Each link must be this user's or root's, in a directory that
        passes the ancestor rule, or whoever could change it would choose the cache. A missing part
        ends the resolution (the walk then finds it missing, or makes it)."""
        here, todo, links = Path("/"), list(reversed(self.root.parent.parts[1:])), 0
        while todo:
            name = todo.pop()
            if name in ("", "."):
                continue
            if name == "..":
                here = here.parent
                continue
            try:
                st = os.lstat(here / name)
            except (FileNotFoundError, NotADirectoryError):
                return here.joinpath(name, *reversed(todo))
            if not stat.S_ISLNK(st.st_mode):
                here = here / name
                continue
            links += 1
            if links > MAX_LINKS:
                raise refusal(
                    here / name, f"leads through more than {MAX_LINKS} links", self.trust, self.root
                )
            if st.st_uid not in (0, os.geteuid()):
                problem = f"is a symbolic link owned by uid {st.st_uid} (neither root nor this user)"
                raise refusal(here / name, problem, self.trust, cache=self.root)
            self._check_ancestor(here, os.stat(here), None, False)
            target = os.readlink(here / name)
            if os.path.isabs(target):
                here = Path("/")
            todo.extend(reversed(Path(target).parts[1:] if os.path.isabs(target) else Path(target).parts))
        return here

    def _open_root(self, create: bool, fds: list[int]) -> int | None:
        if not self.root.name:
            raise UntrustedCacheError(
                "the file system's root / cannot be a kernel cache: name a directory of its own"
            )
        parent = self._resolved_parent()
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
        made: list[int] = []
        fd = self._open_dir(fd, self.root.name, self.root, create, fds, made)
        if fd is None:
            return None
        st = os.fstat(fd)
        for i, (path, ancestor) in enumerate(ancestors):
            self._check_ancestor(path, ancestor, st.st_uid, i == len(ancestors) - 1)
        self._opened.owner = st.st_uid
        self.check(self.root, st)
        if made:  # a root this call made: mark it as the cache's own (what `clean` requires)
            write_at(
                fd, MARKER, b"made by attn_prologue's kernel cache (attn-prologue cache --clean empties it)\n"
            )
        return fd

    def _open_dir(
        self, parent_fd: int, name: str, where: Path, create: bool, fds: list[int], made: list | None = None
    ) -> int | None:
        """Open directory `name` in parent_fd without following a link (a link is refused; anything
        else that is not a directory is a miss); make it 0700 if missing and create=True (and then
        append its descriptor to `made`)."""
        try:
            fd = os.open(name, _WALK, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:  # made meanwhile (another builder): checked like any other
                pass
            else:
                fd = os.open(name, _LIST, dir_fd=parent_fd)
                fds.append(fd)
                os.fchmod(fd, 0o700)  # (mkdir's mode went through the umask)
                if made is not None:
                    made.append(fd)
                return fd
            fd = os.open(name, _LIST, dir_fd=parent_fd)
            fds.append(fd)
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

    def read(self, dir_fd: int, name: str, where: Path, limit: int | None = None) -> bytes | None:
        """The bytes of regular file `name` in dir_fd, checked through the descriptor they are read
        from; None if it is missing, not a regular file (a FIFO, a device, a directory) or larger
        than `limit` (a file the cache did not write: never read whole into memory)."""
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
            if limit is None:
                limit = MAX_JSON_BYTES if name.endswith(".json") else MAX_FILE_BYTES
            if st.st_size > limit:
                return None
            data = f.read(limit + 1)
            return data if len(data) <= limit else None  # (grew meanwhile)


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


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """A new 0600 file `name` in the directory dir_fd (nothing if it exists: it is not replaced)."""
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd
        )
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


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
