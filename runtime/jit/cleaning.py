"""`cache --clean`: remove only what the kernel cache made.

Two proofs, both before anything is removed (and the first before anything below the root is read):
- the root carries the MARKER the cache writes when it creates a root (trusted_fs.py), or is the
  package's own default location (`.../attn_prologue/kernels`, made by versions before the marker);
- every entry below it, to the depth the cache writes, has a name and kind of a layout the cache makes
  (LAYOUT) and is this user's. One that is not is named in a NotACacheError and nothing is removed.
Removal goes through descriptors (never following a link: a link where a folder should be is removed
as a link). The root and its marker stay.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from ..errors import AttnPrologueError
from .trusted_fs import MARKER, Tree, UntrustedCacheError, listable

ANY = "any"  # a folder only the cache makes, at a depth only it writes: its contents are not looked into
FILE = "file"
_HEX = "[0-9a-f]"
_TMP = rf"\.[\w.-]+\.{_HEX}{{8}}\.tmp"  # write_private's temporary name
_ENTRY = {rf"kernel\.(so|ptx|o)|meta\.json|{_TMP}": FILE}
LAYOUT: dict = {
    re.escape(MARKER): FILE,
    r"selftest\.json|\.selftest-\w+\.tmp": FILE,
    "build": {rf"\d+-{_HEX}{{8}}": ANY},  # one folder per `build` run: <pid>-<random>
    "native": {
        "fastpath|torch_ops": {
            rf"{_HEX}{{20}}": {rf"meta\.json|[\w.-]+\.so|{_TMP}": FILE},
            rf"{_HEX}{{20}}\.lock": FILE,
            rf"\.{_HEX}{{20}}-[\w-]+": ANY,  # a build's temporary folder
        }
    },
    r"\.load": {rf"{_HEX}{{16}}-{_HEX}{{8}}\.so": FILE},
    rf"{_HEX}{{16}}-[a-z0-9]+-\w+": {  # DSL build + host
        r"sm_\w+": {  # target
            r"\w+": {  # variant
                rf"\w+-{_HEX}{{16}}": _ENTRY,  # launch config + source hash
                rf"\w+-{_HEX}{{16}}\.lock(-owner)?|{_TMP}": FILE,
                rf"\.tmp-\w+-{_HEX}{{16}}-{_HEX}{{8}}": ANY,
            }
        }
    },
}
MAX_LISTED = 5


class NotACacheError(AttnPrologueError, ValueError):
    """A directory to clean holds things the kernel cache does not make: it is not (only) a cache."""


def _default_root(root: Path) -> bool:
    """Is root the package's own default location (made before roots got a marker)?"""
    return root.parts[-2:] == ("attn_prologue", "kernels")


def _match(rules: dict, name: str):
    return next((rule for pattern, rule in rules.items() if re.fullmatch(pattern, name)), None)


def _strangers(dir_fd: int, rules: dict, where: Path, out: list[str]) -> None:
    """Append to `out` what below dir_fd the cache does not make (name, kind or owner)."""
    listed = listable(dir_fd)
    try:
        names = sorted(os.listdir(listed))
    finally:
        os.close(listed)
    for name in names:
        if len(out) > MAX_LISTED:
            return
        rule = _match(rules, name)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if rule is None or st.st_uid != os.geteuid():
            out.append(str(where / name))
        elif stat.S_ISLNK(st.st_mode):
            continue  # removed as a link, never followed
        elif rule == FILE:
            if not stat.S_ISREG(st.st_mode):
                out.append(str(where / name))
        elif not stat.S_ISDIR(st.st_mode):
            out.append(str(where / name))
        elif isinstance(rule, dict):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                _strangers(fd, rule, where / name, out)
            finally:
                os.close(fd)


def clean(tree: Tree) -> list[str]:
    """Remove what the cache made at tree's root (see the module's docstring); the names removed."""
    root = tree.root
    if not root.name:
        raise NotACacheError(
            "/ is the file system's root, not a kernel cache: name the cache directory itself"
        )
    if tree.trust != "own":
        raise UntrustedCacheError(f"{root} is a shared cache: only its owner cleans it")
    with tree.opened() as fd:
        if fd is None:
            return []
        try:
            os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            if not _default_root(root):
                raise NotACacheError(
                    f"{root} has no {MARKER}, which the kernel cache writes into every root it creates: it was "
                    "not made by the cache, so it is not cleaned (name the cache directory itself; a cache made "
                    f"before the marker existed: remove it by hand, or create {root / MARKER})"
                ) from None
        strangers: list[str] = []
        _strangers(fd, LAYOUT, root, strangers)
        if strangers:
            more = " ..." if len(strangers) > MAX_LISTED else ""
            raise NotACacheError(
                f"{root} holds {', '.join(strangers[:MAX_LISTED])}{more}, which the kernel cache does not make "
                "(or another user's): refusing to clean it; nothing was removed (name the cache directory itself)"
            )
        listed = listable(fd)
        try:
            names = sorted(n for n in os.listdir(listed) if n != MARKER)
        finally:
            os.close(listed)
        for name in names:
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=fd)  # (descriptor-based: never follows a link)
            else:
                os.unlink(name, dir_fd=fd)
        return names


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead(tree: Tree, parts: tuple[str, ...], pattern: str) -> list[str]:
    """Remove what a killed build left in root/parts: entries matching `pattern`, whose first group is
    the pid that made them, when no process has that pid now (a live one's are its own). The names
    removed. Builds on other hosts sharing this cache are not told apart (one host per cache assumed)."""
    removed = []
    with tree.opened(*parts) as fd:
        if fd is None:
            return removed
        listed = listable(fd)
        try:
            names = os.listdir(listed)
        finally:
            os.close(listed)
        for name in names:
            m = re.fullmatch(pattern, name)
            if m is None or int(m[1]) == os.getpid() or _running(int(m[1])):
                continue
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)  # (never follows a link)
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:  # removed meanwhile by another build
                continue
            removed.append(name)
    return removed
