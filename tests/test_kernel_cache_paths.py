"""Where the cache is and what it makes: its root is always absolute (a relative --cache-dir, an empty
XDG_CACHE_HOME), everything it creates is private whatever the umask (the ninja graph and its folder,
stamps, the native parts' lock, missing parents of the root), and `cache --clean` removes only what the
cache made, refusing a linked root, another user's root and a directory holding anything else."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from attn_prologue import native
from attn_prologue.codegen import build
from attn_prologue.jit import kernel_cache
from attn_prologue.jit.kernel_cache import KernelCache, NotACacheError, UntrustedCacheError
from attn_prologue.jit.trusted_fs import MARKER

from .support import cache_entry
from .support.build import kernels_only_env
from .support.cache_entry import IS_ROOT, KEY


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cache_entry.build_one(tmp_path_factory.mktemp("paths") / "cache")


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# ---- absolute roots -------------------------------------------------------------------------------------
def test_every_way_of_naming_the_root_gives_an_absolute_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert KernelCache("rel").root == tmp_path / "rel"
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", "env-rel")
    assert KernelCache().root == tmp_path / "env-rel"
    monkeypatch.delenv("ATTN_PROLOGUE_CACHE")
    for xdg in ("", "relative/xdg"):  # XDG: a value that is empty or not absolute is ignored
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert kernel_cache.default_cache_dir() == Path.home() / ".cache" / "attn_prologue" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.default_cache_dir() == tmp_path / "xdg" / "attn_prologue" / "kernels"


def test_build_into_a_relative_cache_dir(tmp_path):
    """ninja runs the workers in a folder of its own: a relative --cache-dir must still be this one."""
    cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", "rel", "--variants", KEY.variant,
           "--targets", KEY.target, "--config", KEY.config.key]  # fmt: skip
    env = kernels_only_env()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 kernels ready (1 compiled now)" in proc.stdout
    assert KernelCache(tmp_path / "rel").read_meta(KEY) is not None


# ---- private whatever the umask --------------------------------------------------------------------------
@pytest.fixture
def umask_000():
    old = os.umask(0)
    yield
    os.umask(old)


def test_missing_parents_of_the_root_are_made_private(tmp_path, umask_000):
    KernelCache(tmp_path / "a" / "b" / "cache").make_private_dirs("x")
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "cache", tmp_path / "a/b/cache/x"):
        assert mode(p) == 0o700, p


def test_the_ninja_graph_its_folder_and_the_stamps_are_private(built, tmp_path, monkeypatch, umask_000):
    """Another user able to edit build.ninja would choose the commands ninja runs."""
    cache = KernelCache(tmp_path / "cache")
    seen = {}

    def ninja(cmd, *_, **__):  # instead of running ninja: look at what `build` made for it
        here = Path(cmd[cmd.index("-C") + 1])
        seen.update({p: mode(p) for p in (here.parent, here, here / "build.ninja")})
        return 1

    monkeypatch.setattr(build, "run_ninja", ninja)
    with pytest.raises(SystemExit, match="ninja exit 1"):
        build.run(cache, targets={KEY.target}, variants=[_variant()], configs=[KEY.config])
    assert len(seen) == 3 and set(seen.values()) == {0o700, 0o600}, seen
    stamp = tmp_path / "graph" / "stamps" / "shard.stamp"
    build.compile_entries(cache, [], stamp)
    assert mode(stamp.parent) == 0o700 and mode(stamp) == 0o600


def _variant():
    from attn_prologue.variants import parse_name

    return parse_name(KEY.variant)


def test_the_native_parts_and_their_lock_are_private(tmp_path, monkeypatch, umask_000):
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", str(tmp_path / "kernels"))
    path = native.build("fastpath")
    made = [p for p in (tmp_path / "kernels").rglob("*")]
    assert any(p.name.endswith(".lock") for p in made) and path in made
    for p in made:
        assert mode(p) == (0o700 if p.is_dir() else 0o600), p


# ---- cleaning --------------------------------------------------------------------------------------------
def test_clean_removes_what_the_cache_made_and_keeps_the_root(built, tmp_path):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    for made in ("build/123-abcdef01", "native/fastpath", ".load"):
        cache.make_private_dirs(*made.split("/"))
    (cache.root / "selftest.json").write_text("{}")
    removed = cache.clean()
    assert ".load" in removed and "native" in removed and "selftest.json" in removed
    assert cache.root.is_dir() and [p.name for p in cache.root.iterdir()] == [MARKER]  # (its marker stays)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_clean_refuses_a_directory_holding_anything_else(built, tmp_path, monkeypatch):
    project = tmp_path / "project"
    cache_entry.copy_of(built, project)  # a cache's contents, and a project's files beside them
    (project / "README.md").write_text("mine")
    (project / "src").mkdir()
    before = _tree(project)
    with pytest.raises(
        NotACacheError, match="project/README.md, .*project/src, which the kernel cache does not make"
    ):
        KernelCache(project).clean()
    monkeypatch.chdir(project)
    proc = subprocess.run([sys.executable, "-m", "attn_prologue", "cache", "--cache-dir", ".", "--clean"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "refusing to clean it" in proc.stderr and "Traceback" not in proc.stderr
    assert _tree(project) == before


def test_clean_refuses_a_linked_root_and_never_follows_links_inside(built, tmp_path):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    link = tmp_path / "link"
    link.symlink_to(cache.root)
    before = _tree(cache.root)
    with pytest.raises(UntrustedCacheError, match="is a symbolic link"):
        KernelCache(link).clean()
    assert _tree(cache.root) == before
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("not the cache's")
    (cache.root / "build").symlink_to(elsewhere)  # a link where the cache keeps a folder
    cache.clean()
    assert (elsewhere / "keep").read_text() == "not the cache's" and not (cache.root / "build").exists()


@pytest.mark.skipif(not IS_ROOT, reason="a root owned by another user needs chown (root)")
def test_clean_refuses_another_users_root(built, tmp_path):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    os.chown(cache.root, 54321, 54321)
    with pytest.raises(UntrustedCacheError, match="owned by uid 54321"):
        cache.clean()
    os.chown(cache.root, 0, 0)  # back to this user: everything is still there
    assert cache.read_meta(KEY) is not None


# ---- clean needs the cache's own marker and layouts (issue 51, item 4) -------------------------------------
def _private_dir_with(root: Path, files: dict[str, bytes]) -> list[str]:
    root.mkdir(mode=0o700)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return _tree(root)


@pytest.mark.parametrize(
    "files",
    [
        {"build/myproject/important.o": b"mine", "native/keep": b"mine"},
        {"0123456789abcdef-my-photos/a.jpg": b"mine"},
    ],
    ids=["build and native of a project", "a folder named like a DSL build"],
)
def test_clean_refuses_a_directory_the_cache_did_not_make(tmp_path, files):
    """Names alone prove nothing: without the marker the cache writes into the roots it makes, nothing
    is removed (and nothing below the root is looked at)."""
    before = _private_dir_with(tmp_path / "dir", files)
    with pytest.raises(NotACacheError, match=f"has no {MARKER}"):
        KernelCache(tmp_path / "dir").clean()
    assert _tree(tmp_path / "dir") == before
    (tmp_path / "dir" / MARKER).write_text("")  # even marked, what is in it is no layout the cache makes
    with pytest.raises(NotACacheError, match="which the kernel cache does not make.*nothing was removed"):
        KernelCache(tmp_path / "dir").clean()
    assert _tree(tmp_path / "dir") == sorted([*before, MARKER])


def test_a_root_the_cache_makes_is_marked_and_an_existing_one_is_not(tmp_path):
    KernelCache(tmp_path / "new" / "cache").make_private_dirs("build")
    assert (tmp_path / "new" / "cache" / MARKER).is_file() and not (tmp_path / "new" / MARKER).exists()
    assert mode(tmp_path / "new" / "cache" / MARKER) == 0o600
    (tmp_path / "mine").mkdir()
    KernelCache(tmp_path / "mine").make_private_dirs("build")
    assert not (tmp_path / "mine" / MARKER).exists()


def test_clean_of_the_file_systems_root_is_refused_at_once():
    proc = subprocess.run([sys.executable, "-m", "attn_prologue", "cache", "--cache-dir", "/", "--clean"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "not a kernel cache" in proc.stderr and "Traceback" not in proc.stderr
