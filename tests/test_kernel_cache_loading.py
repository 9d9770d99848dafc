"""Loading a verified entry does not depend on TMPDIR (a `noexec` or full /tmp loads as usual: the
bytes go through a sealed memfd), and a failure that is the machine's, not the entry's (no memfd and
a noexec cache, no space), is a typed LoadEnvironmentError that leaves the entry alone: never a
rebuild under a false "corrupted" warning. Installed kernel wheels that cannot be trusted are
skipped with one warning, and a miss then compiles. Files that are not regular files (a FIFO in place
of meta.json or kernel.so) are a miss, found without blocking."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import warnings

import pytest
from attn_prologue.jit import loading
from attn_prologue.jit.kernel_cache import CorruptEntryWarning, KernelCache

from .support import cache_entry
from .support.build import REPO
from .support.cache_entry import IS_ROOT, KEY

pytestmark = pytest.mark.tvm_ffi  # CI runs this file under every pinned TVM-FFI (.ci/run)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cache_entry.build_one(tmp_path_factory.mktemp("loading") / "cache")


LOADER = r"""
import hashlib, json, os, sys, warnings
from attn_prologue.jit.kernel_cache import CorruptEntryWarning, KernelCache
from tests.support.cache_entry import KEY
warnings.simplefilter("error", CorruptEntryWarning)  # a rebuild under a "corrupted" warning fails here
if sys.argv[2] == "no-memfd":
    del os.memfd_create
cache = KernelCache(sys.argv[1])
try:
    outcome = {"loaded": callable(cache.load(KEY))}
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc)}
so = (cache.entry_dir(KEY) / "kernel.so").read_bytes()
print(json.dumps({**outcome, "compiles": cache.compiles, "so_sha256": hashlib.sha256(so).hexdigest()}))
"""

# in a mount namespace of its own: a 64 KiB tmpfs at $1 (noexec, or filled up), then the command
IN_NAMESPACE = {
    "noexec TMPDIR": 'mount -t tmpfs -o noexec,size=64k tmpfs "$1"',
    # (room for tempfile's probe of a usable TMPDIR, not for a kernel)
    "full TMPDIR": 'mount -t tmpfs -o size=64k tmpfs "$1" && head -c 56k /dev/zero > "$1/fill"',
    "no memfd, noexec cache": 'mount -t tmpfs -o noexec tmpfs "$1" && cp -a "$2" "$1/cache"',
}


def _unshare_works() -> bool:
    if not IS_ROOT or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs root and a mount namespace (unshare -m)")
@pytest.mark.parametrize("case", list(IN_NAMESPACE))
def test_loading_survives_a_hardened_tmp_and_never_rebuilds_for_the_machines_fault(built, tmp_path, case):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    mine = hashlib.sha256((cache.entry_dir(KEY) / "kernel.so").read_bytes()).hexdigest()
    mount = tmp_path / "mnt"
    mount.mkdir()
    no_memfd = case.startswith("no memfd")
    root = mount / "cache" if no_memfd else cache.root
    script = IN_NAMESPACE[case] + ' && shift 2 && exec "$@"'
    command = ["unshare", "-m", "sh", "-c", script, "sh", str(mount), str(cache.root),
               sys.executable, "-c", LOADER, str(root), "no-memfd" if no_memfd else "memfd"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(mount)}
    run = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["compiles"] == 0 and got["so_sha256"] == mine, got  # never rebuilt
    if no_memfd:  # the private copy sits in the noexec cache: the machine's fault, typed
        assert got["error"] == "LoadEnvironmentError", got
        assert "would not map a verified library" in got["message"]
    else:
        assert got.get("loaded") is True, got


def _no_memfd(monkeypatch, why=errno.ENOSPC):
    def refuse(*_):
        raise OSError(why, os.strerror(why))

    monkeypatch.setattr(os, "memfd_create", refuse)
    monkeypatch.setattr(loading, "_loaded", {})  # (bytes loaded earlier in this process would be found there)


def test_without_a_memfd_an_own_cache_loads_from_a_private_copy_it_then_removes(built, tmp_path, monkeypatch):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    _no_memfd(monkeypatch)
    old = os.umask(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert callable(cache.load(KEY, compile_if_missing=False))
    finally:
        os.umask(old)
    private = cache.root / ".load"
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and list(private.iterdir()) == []


def test_a_shared_cache_without_a_memfd_is_a_typed_error_and_the_entry_stays(built, tmp_path, monkeypatch):
    cache = cache_entry.copy_of(built, tmp_path / "cache", trust="shared")
    before = sorted((p.name, p.read_bytes()) for p in cache.entry_dir(KEY).iterdir())
    _no_memfd(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "corrupted" warning
        with pytest.raises(loading.LoadEnvironmentError, match="No space left"):
            cache.load(KEY)
    assert sorted((p.name, p.read_bytes()) for p in cache.entry_dir(KEY).iterdir()) == before


LIBRARY = "int which(void) { return %d; }\n"


def _open_memfds() -> int:
    targets = []
    for n in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{n}"))
        except FileNotFoundError:  # (the listing's own descriptor)
            pass
    return sum("memfd:attn-prologue" in t for t in targets)


@pytest.mark.parametrize("private", [True, False], ids=["named in the cache", "kept open (shared cache)"])
def test_two_libraries_loaded_in_turn_are_two_libraries(tmp_path, monkeypatch, private):
    """The loader hands back a library it has loaded when asked for the same path again: a memfd
    closed after loading would let the next one reuse its number, and so its name."""
    monkeypatch.setattr(loading, "_loaded", {})
    cc = shutil.which("cc") or shutil.which("gcc")
    libs = []
    for n in (1, 2):
        (tmp_path / f"lib{n}.c").write_text(LIBRARY % n)
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / f"lib{n}.so"), str(tmp_path / f"lib{n}.c")],
                       check=True)  # fmt: skip
        libs.append((tmp_path / f"lib{n}.so").read_bytes())
    cache = KernelCache(tmp_path / "cache")
    where = (lambda: cache.tree.opened(".load", create=True)) if private else None
    before = _open_memfds()
    got = [loading.load(data, ctypes.CDLL, where).which() for data in libs]
    assert got == [1, 2]
    assert loading.load(libs[0], ctypes.CDLL, where).which() == 1  # the same bytes: what was loaded
    if private:  # named through a link that is gone, the memfd closed
        assert _open_memfds() == before and list((cache.root / ".load").iterdir()) == []
    else:
        assert _open_memfds() == before + 2


# ---- installed kernel wheels that cannot be trusted ---------------------------------------------------
def test_an_untrusted_prebuilt_tree_is_skipped_with_one_warning_and_a_miss_compiles(built, tmp_path):
    """What a kernels wheel installed under umask 002 looks like: its files group-writable."""
    team = cache_entry.copy_of(built, tmp_path / "wheel", trust="shared", prebuilt=[])
    for p in team.entry_dir(KEY).iterdir():
        os.chmod(p, 0o664)
    own = KernelCache(tmp_path / "own", prebuilt=[team])
    with pytest.warns(
        CorruptEntryWarning, match=f"prebuilt kernels in {team.root} not used.*writable"
    ) as seen:
        with pytest.raises(FileNotFoundError, match="is not built"):
            own.load(KEY, compile_if_missing=False)
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skipped from now on: no second warning
        assert callable(own.load(KEY))  # compiled into the own cache instead
    assert own.compiles == 1 and own.prebuilt_loads == 0 and own.prebuilt == []


# ---- not regular files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["meta.json", "kernel.so"])
def test_a_fifo_in_place_of_an_entry_file_is_a_miss_without_blocking(built, tmp_path, name):
    cache = cache_entry.copy_of(built, tmp_path / "cache")
    fifo = cache.entry_dir(KEY) / name
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    got = []
    reader = threading.Thread(target=lambda: got.append(cache.read_meta(KEY)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked opening the FIFO: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail(f"read_meta blocked on a FIFO {name}")
    assert got == [None]


def test_builds_summary_takes_a_meta_without_resources_or_ptx(built):
    """An intact entry whose meta.json lacks the resource and PTX facts (written by hand or by an older
    build) still loads; `build`'s summary reports what the other entries say instead of failing."""
    from attn_prologue.codegen import build

    full = built.read_meta(KEY)
    bare = {k: v for k, v in full.items() if k not in ("resources", "ptx", "compile_seconds")}
    odd = {**full, "resources": "n/a", "ptx": ["n/a"]}
    table = build.summary_table([full, bare, odd])
    row = next(line for line in table.splitlines() if line.startswith(KEY.target))
    regs = full["resources"]["registers"]
    assert f" 3 {regs:>3}-{regs:<3}" in row, table
    assert build.resources(bare) == dict.fromkeys(
        ("registers", "frame_bytes", "min_stack_bytes", "local_sections")
    )
