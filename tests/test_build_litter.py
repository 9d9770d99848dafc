"""What a killed build leaves (issue 51, item 7): its `build/<pid>-<random>` graph folder and a native
part's temporary folder `.<key>-<pid>-<random>` are removed by the next build once no process has that
pid; a running build's folders (this process's, or a live pid's) are left alone."""

from __future__ import annotations

import subprocess

import pytest
from attn_prologue import native
from attn_prologue.codegen import build
from attn_prologue.jit.kernel_cache import KernelCache
from attn_prologue.variants import parse_name


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # (gone; reused within this test only by a rare coincidence)


def test_a_killed_builds_graph_folder_is_removed_by_the_next_build(tmp_path, monkeypatch, dead_pid):
    cache = KernelCache(tmp_path / "cache")
    dead, live = f"{dead_pid}-0badf00d", "1-0badf00d"  # pid 1 always runs
    for name in (dead, live):
        cache.make_private_dirs("build", name)
        (cache.root / "build" / name / "build.ninja").write_text("")
    monkeypatch.setattr(build, "run_ninja", lambda *a, **k: 0)  # (nothing is compiled here)
    with pytest.raises(SystemExit, match="no intact cache entry"):
        build.run(cache, targets={"sm_90a"}, variants=[parse_name("kv_d512r64_bf16_bf16_sm90")])
    assert sorted(p.name for p in (cache.root / "build").iterdir()) == [live]


def test_a_killed_native_builds_temporary_folder_is_removed_by_the_next_build(tmp_path, dead_pid):
    root = tmp_path / "cache"
    key = native.entry_key("fastpath")[0]
    parent = KernelCache(root).make_private_dirs("native", "fastpath")
    dead, live = parent / f".{key}-{dead_pid}-abc123", parent / f".{key}-1-abc123"
    for d in (dead, live):
        d.mkdir(mode=0o700)
        (d / "half.so").write_bytes(b"partial")
    native.build("fastpath", root)
    assert not dead.exists() and live.exists()
