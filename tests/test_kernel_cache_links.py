"""Links on the way to the cache (issue 51, item 1): every link met while resolving the root's path,
links inside a link's target included, is checked by the link rule (root's or this user's, in a
directory that passes the ancestor rule), and the loader is never handed a name below the cache root:
it gets `/proc/self/fd/<checked directory>/<name>`, so a link changed after the checks changes nothing
that is loaded (a hooked, deterministic case and a bounded real race)."""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from attn_prologue.jit import loading
from attn_prologue.jit.kernel_cache import KernelCache, UntrustedCacheError

from .support.cache_entry import IS_ROOT, OTHER_UID


def _chain(tmp_path, team_mode: int = 0o755):
    """tmp/home/c -> tmp/team/x -> tmp/real, the cache at tmp/home/c/cache (really tmp/real/cache)."""
    for d in ("home", "team", "real"):
        (tmp_path / d).mkdir()
    os.chmod(tmp_path / "team", team_mode)
    (tmp_path / "team" / "x").symlink_to(tmp_path / "real")
    (tmp_path / "home" / "c").symlink_to(tmp_path / "team" / "x")
    return tmp_path / "home" / "c" / "cache"


@pytest.mark.skipif(not IS_ROOT, reason="a link owned by another user needs lchown (root)")
@pytest.mark.parametrize("trust", ["own", "shared"])
def test_a_link_inside_a_links_target_owned_by_another_user_is_refused(tmp_path, trust):
    root = _chain(tmp_path)
    os.lchown(tmp_path / "team" / "x", OTHER_UID, OTHER_UID)
    KernelCache(tmp_path / "real" / "cache").make_private_dirs()
    with pytest.raises(
        UntrustedCacheError, match=rf"team/x \(an ancestor .*\) is a symbolic link owned by uid {OTHER_UID}"
    ):
        KernelCache(root, trust=trust).read_files((), ("meta.json",))


def test_a_link_inside_a_links_target_in_a_directory_others_can_write_is_refused(tmp_path):
    root = _chain(tmp_path, team_mode=0o775)  # group-writable: anyone in the group could change team/x
    os.chmod(tmp_path / "team", 0o775)
    KernelCache(tmp_path / "real" / "cache").make_private_dirs()
    with pytest.raises(UntrustedCacheError, match=r"team \(an ancestor .* writable by other users"):
        KernelCache(root).read_files((), ("meta.json",))


def test_a_chain_of_trusted_links_is_followed_and_a_loop_is_refused(tmp_path):
    root = _chain(tmp_path)
    KernelCache(root).make_private_dirs("x")
    assert (tmp_path / "real" / "cache" / "x").is_dir()
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    with pytest.raises(UntrustedCacheError, match="more than 40 links"):
        KernelCache(tmp_path / "loop" / "cache").read_files((), ("meta.json",))


def _reader(path: str) -> bytes:
    """A stand-in loader: what the dynamic loader would map is what opening `path` reads."""
    with open(path, "rb") as f:
        return f.read()


def test_the_loader_gets_the_checked_directory_not_a_path_that_is_resolved_again(tmp_path, monkeypatch):
    """Hooked: as the loader is called, the link on the way is moved to another tree holding a library
    under the very name the load uses. What the loader reads is still the verified bytes."""
    root = _chain(tmp_path)
    theirs = tmp_path / "theirs" / "cache" / ".load"
    theirs.mkdir(parents=True)
    cache = KernelCache(root)
    monkeypatch.setattr(loading, "_loaded", {})
    fixed = uuid.UUID(int=0xFEED)
    monkeypatch.setattr(loading.uuid, "uuid4", lambda: fixed)
    data = b"the verified bytes"
    name = f"{hashlib.sha256(data).hexdigest()[:16]}-{fixed.hex[:8]}.so"
    (theirs / name).write_bytes(b"their library")
    seen = []

    def loader(path: str):
        (tmp_path / "team" / "x").unlink()
        (tmp_path / "team" / "x").symlink_to(tmp_path / "theirs")  # the chain now leads to their tree
        seen.append(path)
        return _reader(path)

    got = loading.load(data, loader, lambda: cache.tree.opened(".load", create=True))
    assert got == data and seen[0].startswith("/proc/self/fd/") and str(root) not in seen[0]


ATTACKER = r"""
import os, sys
theirs = sys.argv[1]
print("watching", flush=True)
while True:  # every name that appears in their .load becomes their library
    for name in os.listdir(theirs):
        if not name.startswith("tmp"):
            try:
                with open(os.path.join(theirs, "tmp" + name), "wb") as f:
                    f.write(b"their library")
                os.replace(os.path.join(theirs, "tmp" + name), os.path.join(theirs, name))
            except OSError:
                pass
"""
FLIPPER = r"""
import os, sys
link, ours, theirs = sys.argv[1:4]
print("flipping", flush=True)
while True:
    for target in (theirs, ours):
        os.symlink(target, link + ".new"); os.replace(link + ".new", link)
"""


@pytest.mark.skipif(not IS_ROOT, reason=f"a tree and a process of another user (uid {OTHER_UID}) need root")
def test_a_real_race_on_a_link_above_the_cache_never_loads_other_bytes(request, monkeypatch):
    """Another process flips a link on the way between this cache's tree and another user's, whose
    .load that user fills with its library under every name that appears there; loads run meanwhile.
    Each load reads the verified bytes (from the memfd's own name when their tree is refused). Before
    the fix a load named `<root>/.load/<name>`, resolved again after the checks. Bounded: 1500 loads
    or 4 seconds."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")  # one the other user can run
    if python is None:
        pytest.skip("no system python3 for the other user's process")
    tmp_path = Path(
        tempfile.mkdtemp(prefix="attn-prologue-race-")
    )  # (pytest's tmp is 0700: theirs unreachable)
    os.chmod(tmp_path, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(tmp_path, ignore_errors=True))
    root = _chain(tmp_path)
    KernelCache(root).make_private_dirs(".load")
    theirs = tmp_path / "theirs"
    (theirs / "cache" / ".load").mkdir(parents=True, mode=0o700)
    for p in (theirs, theirs / "cache", theirs / "cache" / ".load"):
        os.chown(p, OTHER_UID, OTHER_UID)
    procs = [
        subprocess.Popen([sys.executable, "-c", FLIPPER, str(tmp_path / "team" / "x"), str(tmp_path / "real"),
                          str(theirs)], stdout=subprocess.PIPE, text=True),
        subprocess.Popen([python, "-c", ATTACKER, str(theirs / "cache" / ".load")], stdout=subprocess.PIPE,
                         text=True, user=OTHER_UID, group=OTHER_UID, extra_groups=[]),
    ]  # fmt: skip
    seen: collections.Counter = collections.Counter()
    monkeypatch.setattr(loading, "_loaded", {})
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["flipping", "watching"]
        deadline = time.monotonic() + 4
        i = 0
        while i < 1500 and time.monotonic() < deadline:
            i += 1
            data = b"ours %d" % i
            try:
                got = loading.load(data, _reader, lambda: KernelCache(root).tree.opened(".load", create=True))
            except (UntrustedCacheError, OSError):
                seen["refused"] += 1
                continue
            seen["ours" if got == data else "foreign"] += 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(f"\n[race] {dict(seen)}")
    assert seen["foreign"] == 0 and seen["ours"] > 0, dict(seen)
