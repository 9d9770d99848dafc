"""The directories above a cache are checked as OpenSSH's StrictModes checks a home directory (owned by
root or this user, not writable by others unless sticky), a shared cache's parent may not be writable
by others at all (there, whoever made the name first would own the cache), and the native parts live
inside the cache root the user named, so a directory planted beside it by another local user is never
loaded, at import or later."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from attn_prologue import native
from attn_prologue.jit.kernel_cache import KernelCache, UntrustedCacheError

from .support import cache_entry
from .support.cache_entry import IS_ROOT, KEY, OTHER_UID


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cache_entry.build_one(tmp_path_factory.mktemp("shared") / "cache")


def cache_in(built, parent: Path, mode: int, **kw) -> KernelCache:
    parent.mkdir()
    cache = cache_entry.copy_of(built, parent / "cache", **kw)
    os.chmod(parent, mode)
    return cache


def test_a_cache_in_a_directory_others_can_write_is_refused(built, tmp_path):
    cache = cache_in(built, tmp_path / "open", 0o777)
    for attempt in (lambda: cache.read_meta(KEY), lambda: cache.make_private_dirs("build")):
        with pytest.raises(UntrustedCacheError, match=r"open \(an ancestor of the cache .*writable by other"):
            attempt()
    with pytest.raises(UntrustedCacheError, match="an ancestor"):
        KernelCache(cache.root, trust="shared").read_meta(KEY)
    missing = KernelCache(tmp_path / "open" / "new" / "cache")
    with pytest.raises(UntrustedCacheError, match="an ancestor"):  # nothing is made below it either
        missing.make_private_dirs()
    assert not (tmp_path / "open" / "new").exists()


def test_a_sticky_directory_holds_an_own_cache_but_not_a_shared_one(built, tmp_path):
    cache = cache_in(built, tmp_path / "tmp", 0o1777)  # like /tmp
    assert cache.read_meta(KEY) is not None  # only its owner could have made or renamed it
    with pytest.raises(UntrustedCacheError, match="anyone could have made the shared cache in it"):
        KernelCache(cache.root, trust="shared").read_meta(KEY)


@pytest.mark.skipif(not IS_ROOT, reason="planting another user's directories needs chown (root)")
def test_an_ancestor_owned_by_a_third_user_is_refused_unless_it_owns_the_shared_cache(built, tmp_path):
    cache = cache_in(built, tmp_path / "team", 0o755)
    os.chown(tmp_path / "team", 54321, 54321)
    with pytest.raises(UntrustedCacheError, match=r"team \(an ancestor .* owned by uid 54321"):
        cache.read_meta(KEY)
    for p in [cache.root, *cache.root.rglob("*")]:
        os.chown(p, 54321, 54321)
    assert KernelCache(cache.root, trust="shared").read_meta(KEY) is not None  # its owner owns the parent
    os.chown(tmp_path / "team", 54322, 54322)
    with pytest.raises(UntrustedCacheError, match="owned by uid 54322"):
        KernelCache(cache.root, trust="shared").read_meta(KEY)


@pytest.mark.skipif(not IS_ROOT, reason="a link owned by another user needs lchown (root)")
def test_a_link_above_the_cache_must_be_this_users_or_roots(built, tmp_path):
    """/tmp/link -> a directory holding the cache: the link chooses which cache is read, so whoever may
    have made it matters (in a sticky directory only its owner can replace it)."""
    cache_in(built, tmp_path / "real", 0o755)
    (tmp_path / "tmp").mkdir(mode=0o1777)
    os.chmod(tmp_path / "tmp", 0o1777)
    link = tmp_path / "tmp" / "link"
    link.symlink_to(tmp_path / "real")
    assert KernelCache(link / "cache").read_meta(KEY) is not None
    os.lchown(link, 54321, 54321)
    with pytest.raises(UntrustedCacheError, match=r"link \(an ancestor .* symbolic link owned by uid 54321"):
        KernelCache(link / "cache", trust="shared").read_meta(KEY)


def test_the_native_parts_live_inside_the_named_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", str(tmp_path / "kernels"))
    path = native.build("fastpath")
    assert path.is_relative_to(tmp_path / "kernels" / "native")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels"]  # nothing beside it


PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(getenv("AP_MARKER"), "w");
  if (f) { fputs("foreign code ran\n", f); fclose(f); }
}
"""

VICTIM = (
    "import attn_prologue; from attn_prologue import native, torch_op; "
    "print(native.fastpath() is not None, torch_op.cuda_kernels())"
)


@pytest.mark.skipif(not IS_ROOT, reason=f"running a process as another user (uid {OTHER_UID}) needs root")
def test_native_parts_planted_beside_a_shared_cache_by_another_user_never_run(tmp_path):
    """A team cache directly inside a world-writable sticky directory, used with trust=shared; another
    real user (uid 65534) creates `native/` beside it holding an intact-looking fast-path entry whose
    library writes a marker file when loaded. Importing the package and using the fast path must not
    run it: the native parts are read from inside the root only, and that root is refused."""
    with tempfile.TemporaryDirectory(prefix="attn-prologue-shared-") as top:
        top = Path(top)
        os.chmod(top, 0o1777)
        team = top / "cache"
        team.mkdir(mode=0o755)
        staged = top / "staged"  # what the other user copies in: a key-matching entry of its own
        key, facts = native.entry_key("fastpath")
        name = native.PARTS["fastpath"][0]
        entry = staged / "native" / "fastpath" / key
        entry.mkdir(parents=True)
        (tmp_path / "planted.c").write_text(PLANTED)
        cc = shutil.which("cc") or shutil.which("gcc")
        subprocess.run(
            [cc, "-shared", "-fPIC", "-o", str(entry / name), str(tmp_path / "planted.c")], check=True
        )
        so = (entry / name).read_bytes()
        (entry / "meta.json").write_text(
            json.dumps({**facts, "file": name, "sha256": hashlib.sha256(so).hexdigest()})
        )
        for p in [*staged.rglob("*"), staged]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        planted = cache_entry.as_other_user("cp", "-r", str(staged / "native"), str(top / "native"))
        assert planted.returncode == 0, planted.stderr
        assert os.stat(top / "native" / "fastpath" / key / name).st_uid == OTHER_UID

        marker = tmp_path / "marker"
        env = {**os.environ, "ATTN_PROLOGUE_CACHE": str(team), "ATTN_PROLOGUE_CACHE_TRUST": "shared",
               "AP_MARKER": str(marker)}  # fmt: skip
        run = subprocess.run([sys.executable, "-W", "always", "-c", VICTIM], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert not marker.exists(), "the other user's library was loaded"
        assert run.stdout.split() == ["False", "Python"]
        assert "anyone could have made the shared cache in it" in run.stderr


# ---- below a shared root: the root's owner or root only (issue 51, item 2) ----------------------------------
def _planted_entry(tmp_path: Path, into: Path) -> Path:
    """An intact-looking fast-path entry in into/native whose library writes $AP_MARKER when loaded."""
    key, facts = native.entry_key("fastpath")
    name = native.PARTS["fastpath"][0]
    entry = into / "native" / "fastpath" / key
    entry.mkdir(parents=True)
    (tmp_path / "planted.c").write_text(PLANTED)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(entry / name), str(tmp_path / "planted.c")], check=True)
    so = (entry / name).read_bytes()
    (entry / "meta.json").write_text(
        json.dumps({**facts, "file": name, "sha256": hashlib.sha256(so).hexdigest()})
    )
    for p in [into, *into.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return entry


@pytest.mark.skipif(
    not IS_ROOT, reason=f"a subtree owned by another user (uid {OTHER_UID}) needs chown (root)"
)
def test_a_third_users_native_subtree_in_a_root_owned_shared_tree_never_runs(tmp_path):
    """A root-owned team cache whose native/ subtree belongs to uid 65534: shared trust trusts the
    tree's owner (root), not anyone who owns a part of it, so importing the package loads nothing."""
    team = tmp_path / "team" / "cache"
    team.parent.mkdir()
    _planted_entry(tmp_path, team)
    for p in [team / "native", *(team / "native").rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID)
    marker = tmp_path / "marker"
    env = {**os.environ, "ATTN_PROLOGUE_CACHE": str(team), "ATTN_PROLOGUE_CACHE_TRUST": "shared",
           "AP_MARKER": str(marker)}  # fmt: skip
    run = subprocess.run([sys.executable, "-W", "always", "-c", VICTIM], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert not marker.exists(), "the third user's library was loaded"
    assert run.stdout.split() == ["False", "Python"]
    assert f"owned by uid {OTHER_UID}, neither root nor the shared cache's owner (uid 0)" in run.stderr


@pytest.mark.skipif(
    not IS_ROOT, reason=f"a directory owned by another user (uid {OTHER_UID}) needs chown (root)"
)
@pytest.mark.parametrize("where", ["variant dir", "kernel.so"])
def test_a_kernel_tree_with_a_part_owned_by_a_third_user_is_refused(built, tmp_path, where):
    """As a shared cache and as an installed kernels wheel (read as one): skipped with one warning."""
    tree = cache_in(built, tmp_path / "wheel", 0o755, trust="shared", prebuilt=[])
    for p in [tree.root, *tree.root.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    target = tree.entry_dir(KEY).parent if where == "variant dir" else tree.entry_dir(KEY) / "kernel.so"
    os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedCacheError, match=f"owned by uid {OTHER_UID}, neither root nor the shared"):
        tree.read_meta(KEY)
    mine = KernelCache(tmp_path / "mine", prebuilt=[tree])
    with pytest.warns(UserWarning, match=f"prebuilt kernels in {tree.root} not used: .*uid {OTHER_UID}"):
        assert not mine._read_prebuilt(KEY)[0]
    os.chown(target, 0, 0)  # root's: trusted like the owner's
    assert tree.read_meta(KEY) is not None
