"""The kernel cache as a code-loading path: what it creates is private, what it loads is trusted
and is exactly what was verified, broken metadata is a miss, locks time out naming the holder.

One real entry is compiled per module (a cheap sm_90a kernel); each test copies it into a cache of
its own and then plants the condition it checks."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import (
    CacheLockTimeout,
    KernelCache,
    KernelKey,
    UntrustedCacheError,
)

from .support import cache_entry
from .support.cache_entry import IS_ROOT, KEY, OTHER_UID


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cache_entry.build_one(tmp_path_factory.mktemp("trust") / "cache")


def copy_of(built: KernelCache, tmp_path, **kw) -> KernelCache:
    return cache_entry.copy_of(built, tmp_path / "cache", **kw)


def test_everything_created_is_private_whatever_the_umask(built):
    entry = built.entry_dir(KEY)
    assert built.read_meta(KEY) is not None
    dirs = [built.root / p for p in entry.relative_to(built.root).parents] + [entry]
    assert len(dirs) >= 5 and built.root in dirs
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    files = sorted(entry.iterdir())
    assert {f.name for f in files} == {"kernel.so", "kernel.ptx", "meta.json"}
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


@pytest.mark.skipif(not IS_ROOT, reason="planting another user's entry needs chown (root)")
def test_an_entry_owned_by_another_user_is_refused_unless_shared(built, tmp_path):
    cache = copy_of(built, tmp_path)
    for p in [cache.root, *cache.root.rglob("*")]:
        os.chown(p, 54321, 54321, follow_symlinks=False)
    with pytest.raises(UntrustedCacheError, match="owned by uid 54321") as info:
        cache.load(KEY, compile_if_missing=False)
    assert str(cache.root) in str(info.value) and "ATTN_PROLOGUE_CACHE" in str(info.value)
    shared = KernelCache(cache.root, trust="shared")
    assert shared.read_meta(KEY) is not None  # a trusted team cache: loads (the .so is verified)
    with pytest.raises(FileNotFoundError, match="read-only"):  # and is never written
        shared.ensure_built(KernelKey(KEY.variant, KEY.config, "sm_100a"))


@pytest.mark.parametrize("where", ["root", "entry dir", "kernel.so", "meta.json"])
def test_a_path_writable_by_others_is_refused(built, tmp_path, where):
    cache = copy_of(built, tmp_path)
    entry = cache.entry_dir(KEY)
    target = {
        "root": cache.root,
        "entry dir": entry,
        "kernel.so": entry / "kernel.so",
        "meta.json": entry / "meta.json",
    }
    p = target[where]
    os.chmod(p, os.stat(p).st_mode | stat.S_IWOTH)
    with pytest.raises(UntrustedCacheError, match="writable by other users"):
        cache.load(KEY, compile_if_missing=False)
    with pytest.raises(UntrustedCacheError):  # also refused as the shared, read-only kind
        KernelCache(cache.root, trust="shared").read_meta(KEY)


@pytest.mark.parametrize("what", ["kernel.so", "entry dir"])
def test_a_symbolic_link_in_the_cache_is_refused(built, tmp_path, what):
    cache = copy_of(built, tmp_path)
    entry = cache.entry_dir(KEY)
    elsewhere = tmp_path / "elsewhere"
    if what == "kernel.so":
        elsewhere.write_bytes((entry / "kernel.so").read_bytes())
        (entry / "kernel.so").unlink()
        (entry / "kernel.so").symlink_to(elsewhere)
    else:
        shutil.move(entry, elsewhere)
        entry.symlink_to(elsewhere)
    with pytest.raises(UntrustedCacheError, match="symbolic link"):
        cache.load(KEY, compile_if_missing=False)


@pytest.mark.parametrize("text", ["[]", "null", "7", '"a string"', "{}"])
def test_meta_json_that_is_not_an_entry_is_a_miss(built, tmp_path, text):
    cache = copy_of(built, tmp_path)
    (cache.entry_dir(KEY) / "meta.json").write_text(text)
    assert cache.read_meta(KEY) is None
    with pytest.raises(FileNotFoundError, match="not built"):
        cache.load(KEY, compile_if_missing=False)


def test_the_host_platform_is_part_of_the_key(built, monkeypatch):
    here = built.entry_dir(KEY)
    assert compiler.host_tag() in str(here)
    assert built.read_meta(KEY)["host"] == compiler.host_tag()
    compiler.host_tag.cache_clear()
    monkeypatch.setattr(compiler.platform, "machine", lambda: "aarch64")
    try:
        assert built.entry_dir(KEY) != here and "aarch64" in str(built.entry_dir(KEY))
        assert built.read_meta(KEY) is None  # an x86-64 object is not offered to an aarch64 host
    finally:
        compiler.host_tag.cache_clear()


def test_a_held_build_lock_times_out_naming_the_holder(built, tmp_path):
    cache = copy_of(built, tmp_path, lock_timeout=0.5)
    other = KernelKey(KEY.variant, KEY.config, "sm_100a")
    d = cache.entry_dir(other)
    d.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(d) + ".lock", str(d) + ".lock-owner"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockTimeout, match=f"held by pid {holder.pid}"):
            cache.ensure_built(other)
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = r"""
import os, sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire()
open(sys.argv[2], "w").write(f"pid {os.getpid()} on test\n")
print("held", flush=True); time.sleep(60)
"""


# ---- a second user, for real: another uid in another process ------------------------------------
AS_OTHER_USER = r"""
import json, os, site, sys
for p in os.environ["AP_SITE_DIRS"].split(os.pathsep):  # this package and its dependencies
    site.addsitedir(p)
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.variants import ArchFamily

print(json.dumps({"euid": os.geteuid()}), flush=True)
if sys.argv[1] == "probe":
    raise SystemExit(0)
mine, team, own = (KernelCache(p) for p in sys.argv[2:5])
key = KernelKey("kv_d512r64_bf16_bf16_sm90", ArchFamily.SM90.default_config, "sm_90a")
missing = KernelKey(key.variant, key.config, "sm_100a")

def outcome(f):
    try:
        return {"ok": repr(f())}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}

print(json.dumps({
    "load another user's cache": outcome(lambda: mine.load(key, compile_if_missing=False)),
    "build into another user's cache": outcome(lambda: mine.ensure_built(missing)),
    "read it as a shared cache": outcome(lambda: KernelCache(team.root, trust="shared").read_meta(key) is not None),
    "build into the shared cache": outcome(lambda: KernelCache(team.root, trust="shared").ensure_built(missing)),
    "build a cache of its own": outcome(lambda: own.ensure_built(key)["variant"]),
}))
"""


def _site_dirs() -> str:
    import site

    return os.pathsep.join([*site.getsitepackages(), site.getusersitepackages()])


def _as_other_user(*args: str, home: Path) -> subprocess.CompletedProcess:
    """Run AS_OTHER_USER as OTHER_UID (umask 000) with the first interpreter that user can run."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")  # when this one is in a private home
    candidates = dict.fromkeys(c for c in (sys.executable, os.path.realpath(sys.executable), system) if c)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "AP_SITE_DIRS": _site_dirs(),
    }
    why = []
    for python in candidates:
        try:
            r = subprocess.run(
                [python, "-c", AS_OTHER_USER, *args], user=OTHER_UID, group=OTHER_UID, extra_groups=[],
                umask=0, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:  # no CAP_SETUID, or not executable by that uid
            why.append(f"{python}: {exc}")
            continue
        first = r.stdout.splitlines()[:1]
        if first and json.loads(first[0]).get("euid") == OTHER_UID:
            return r
        why.append(f"{python}: exit {r.returncode}, {r.stderr.strip().splitlines()[-1:] or r.stdout[:200]}")
    pytest.skip(f"cannot run this package's Python as uid {OTHER_UID}: {'; '.join(why)}")


@pytest.mark.skipif(not IS_ROOT, reason=f"running a process as another user (uid {OTHER_UID}) needs root")
def test_a_second_user_refuses_a_cache_it_does_not_own_unless_shared(built):
    """Two real users: the cache of one is refused by the other (loading and building into it), naming
    the path; a team cache (read-only for everyone but its owner) is used only in shared mode and is
    never written; and the other user's own build is private to it (umask 000) and refused by the first."""
    with tempfile.TemporaryDirectory(prefix="attn-prologue-uid-") as top:
        top = Path(top)
        os.chmod(top, 0o755)  # reachable by the other user; what it may read inside is up to the caches
        home = top / "home"
        home.mkdir()
        os.chown(home, OTHER_UID, OTHER_UID)
        _as_other_user("probe", home=home)  # skips cleanly where that user cannot run this Python
        mine = top / "mine"
        shutil.copytree(built.root, mine, symlinks=True)  # as built: 0700 / 0600, owned by this user
        team = top / "team"
        shutil.copytree(built.root, team, symlinks=True)
        for p in [team, *team.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        team_before = sorted(str(p) for p in team.rglob("*"))
        theirs = home / "cache"

        r = _as_other_user("run", str(mine), str(team), str(theirs), home=home)
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout.splitlines()[1])

        for what in ("load another user's cache", "build into another user's cache"):
            assert seen[what]["error"] == "UntrustedCacheError", seen[what]
            assert f"kernel cache path {mine} is owned by uid {os.geteuid()}" in seen[what]["message"]
            assert f"not by this user (uid {OTHER_UID})" in seen[what]["message"]
        assert seen["read it as a shared cache"] == {"ok": "True"}
        assert seen["build into the shared cache"]["error"] == "KernelNotBuiltError"  # (a FileNotFoundError)
        assert "read-only" in seen["build into the shared cache"]["message"]
        assert sorted(str(p) for p in team.rglob("*")) == team_before  # nothing written there
        assert seen["build a cache of its own"] == {"ok": repr(KEY.variant)}

        entry = KernelCache(theirs).entry_dir(KEY)
        for p in [theirs, *theirs.rglob("*")]:  # the other user's build: private to it, whatever its umask
            st = os.lstat(p)
            if p.suffix == ".lock" or p.name.endswith(".lock-owner"):
                continue
            assert st.st_uid == OTHER_UID, p
            assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p
        assert (entry / "kernel.so").is_file()
        with pytest.raises(UntrustedCacheError, match=f"owned by uid {OTHER_UID}") as info:
            KernelCache(theirs).load(KEY, compile_if_missing=False)
        assert str(theirs) in str(info.value)
        assert KernelCache(theirs, trust="shared").read_meta(KEY) is not None  # a team cache of theirs: ok
