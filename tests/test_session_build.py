"""The session build (tests/support/build.py) on a slow or busy machine: its limit grows with the
work left, a failure is reported once, and it reuses what the main command built without ever
writing into the user's kernel cache."""

from __future__ import annotations

import os
import stat

import pytest
from attn_prologue import native
from attn_prologue.jit.kernel_cache import KernelCache

from .support import build as session


def test_the_time_limit_follows_the_kernels_left_and_the_cores(monkeypatch):
    monkeypatch.delenv(session.ENV_TIMEOUT, raising=False)
    two_cores = session.build_timeout(497, cpus=2)
    assert two_cores == session.FIXED_SECONDS + session.CORE_SECONDS_PER_KERNEL * 497 / 2
    assert two_cores > 1392 * 2  # twice the loaded 2-core machine's whole build (issue 29)
    assert session.build_timeout(497, cpus=16) < two_cores
    assert (
        session.build_timeout(0, cpus=2) == session.FIXED_SECONDS
    )  # everything reused: import and link only
    monkeypatch.setenv(session.ENV_TIMEOUT, "5000")
    assert session.build_timeout(497, cpus=2) == 5000
    monkeypatch.setenv(session.ENV_TIMEOUT, "0")
    assert session.build_timeout(497, cpus=2) is None


def test_a_failed_session_build_is_reported_once(pytester):
    pytester.makeconftest(
        """
import pytest
from tests.conftest import built  # noqa: F401  (the suite's fixture, over the failure below)
from tests.support.build import BuildFailed


@pytest.fixture(scope="session")
def session_build():
    return BuildFailed("ninja: build stopped\\n" + "compile output line\\n" * 200)
"""
    )
    pytester.makepyfile(
        test_uses_the_build="""
import pytest


@pytest.mark.parametrize("i", range(5))
def test_inspects_the_build(built, i):
    pass


def test_needs_no_build():
    pass
"""
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=5)
    # the short summary's one-line reasons are as wide as the terminal: count the sections above it
    out, _, summary = result.stdout.str().partition("short test summary info")
    assert summary.count("ERROR") == 5, summary
    assert out.count("ninja: build stopped") == 1  # the full output, once
    assert out.count("compile output line") == 200
    first = "test_uses_the_build.py::test_inspects_the_build[0]"
    assert out.count(f"the session build failed (its output: the error of {first})") == 4
    assert "Traceback" not in out


def _tree(root):
    return {
        p: (st.st_mode, st.st_mtime_ns, st.st_size) for p in [root, *root.rglob("*")] for st in [os.lstat(p)]
    }


def test_reuse_copies_intact_entries_and_never_writes_the_users_cache(tmp_path, monkeypatch):
    user = KernelCache(tmp_path / "user" / "kernels")
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", str(user.root))
    monkeypatch.delenv(session.ENV_CLEAN, raising=False)
    user.ensure_built(session.CHEAP)  # what `python -m attn_prologue build` leaves behind, in small
    fastpath = native.build("fastpath", user.root)
    before = _tree(tmp_path / "user")

    mine = tmp_path / "session" / "kernels"
    mine.mkdir(parents=True, mode=0o700)
    assert session.reuse_user_cache(mine) == 1
    assert _tree(tmp_path / "user") == before  # read, never written (no lock, no build folder)
    copy = KernelCache(mine)
    assert copy.read_meta(session.CHEAP) is not None  # the copy verifies where it now is
    entry = copy.entry_dir(session.CHEAP)
    for d in [entry, *entry.relative_to(mine).parents]:
        assert stat.S_IMODE(os.stat(mine / d).st_mode) == 0o700, d
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in entry.iterdir()} == {
        "kernel.so": 0o600,
        "kernel.ptx": 0o600,
        "meta.json": 0o600,
    }
    assert native.built_path("fastpath", mine).read_bytes() == fastpath.read_bytes()

    monkeypatch.setenv(session.ENV_CLEAN, "1")  # CI: a clean build copies nothing
    assert session.reuse_user_cache(tmp_path / "clean") == 0

    monkeypatch.delenv(session.ENV_CLEAN)
    so = user.entry_dir(session.CHEAP) / "kernel.so"
    data = so.read_bytes()
    so.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a damaged entry under the same key: a miss
    (tmp_path / "again").mkdir(mode=0o700)
    assert session.reuse_user_cache(tmp_path / "again") == 0
    assert not KernelCache(tmp_path / "again").entry_dir(session.CHEAP).exists()


@pytest.mark.slow
def test_the_session_build_reports_what_it_reused(built):
    """With the main command's cache in place the session compiles nothing it could copy."""
    compiled = int(built.output.split(" compiled now)")[0].rsplit("(", 1)[1])
    assert compiled == len(session.ENTRIES) - built.reused
