"""Trust is checked on what is read, not on a path that can change meanwhile: swapping the cache root
for a symbolic link to someone else's tree between the check and the read (a hook placed at the first
open), or racing renames of the root from another process while loads run, never hands out the other
tree's bytes. What is read is verified through the descriptors that were checked."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
from attn_prologue import native
from attn_prologue.jit.kernel_cache import KernelCache, UntrustedCacheError

from .support import cache_entry
from .support.cache_entry import KEY


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cache_entry.build_one(tmp_path_factory.mktemp("races") / "cache")


@pytest.fixture
def ours_and_theirs(built, tmp_path):
    """This user's cache at tmp/cache and an intact foreign tree at tmp/theirs (marked in its meta)."""
    ours = cache_entry.copy_of(built, tmp_path / "cache")
    theirs = cache_entry.copy_of(built, tmp_path / "theirs")
    cache_entry.plant_foreign(theirs)
    return ours, theirs


def swap_at_open(monkeypatch, root, foreign, when):
    """At the first os.open whose path satisfies `when`, move the root away and put a link to
    `foreign` in its place (what anyone who can rename entries of the root's parent can do)."""
    real_open = os.open
    swapped = []

    def hooked(path, flags, mode=0o777, *, dir_fd=None):
        if not swapped and when(str(path)):
            swapped.append(str(path))
            os.rename(root, root.with_name("moved-away"))
            os.symlink(foreign, root)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", hooked)
    return swapped


def test_a_root_swapped_for_a_link_before_the_first_open_is_refused(ours_and_theirs, monkeypatch):
    ours, theirs = ours_and_theirs
    swapped = swap_at_open(monkeypatch, ours.root, theirs.root, lambda path: True)
    with pytest.raises(UntrustedCacheError, match=f"{ours.root} is a symbolic link"):
        ours.load(KEY, compile_if_missing=False)
    assert swapped and ours._loaded == {}


def test_a_root_swapped_after_its_entry_was_opened_still_reads_this_caches_bytes(
    ours_and_theirs, monkeypatch
):
    ours, theirs = ours_and_theirs
    mine = (ours.entry_dir(KEY) / "kernel.so").read_bytes()
    swapped = swap_at_open(monkeypatch, ours.root, theirs.root, lambda path: path.endswith("meta.json"))
    meta, so = ours._read_entry(KEY)
    assert swapped and ours.root.is_symlink()  # the swap happened, between the walk and the reads
    assert meta is not None and "foreign" not in meta and so == mine


def _plant_native(root, data: bytes) -> None:
    """An intact native fast-path entry holding `data` (nothing loads it here: only the read is tested)."""
    key, facts = native.entry_key("fastpath")
    entry = root / "native" / "fastpath" / key
    entry.mkdir(parents=True, mode=0o700)
    name = native.PARTS["fastpath"][0]
    (entry / name).write_bytes(data)
    meta = {**facts, "file": name, "sha256": hashlib.sha256(data).hexdigest()}
    (entry / "meta.json").write_text(json.dumps(meta))
    for p in (entry / name, entry / "meta.json"):
        os.chmod(p, 0o600)


def test_the_native_parts_are_read_through_the_same_checked_descriptors(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "cache", tmp_path / "theirs"
    _plant_native(ours, b"ours")
    _plant_native(theirs, b"theirs")
    assert native.verified("fastpath", ours)[1] == b"ours"
    swap_at_open(monkeypatch, ours, theirs, lambda path: True)
    with pytest.raises(UntrustedCacheError, match="is a symbolic link"):
        native.verified("fastpath", ours)


SWAPPER = r"""
import os, sys
root, parked, link = sys.argv[1:4]
print("swapping", flush=True)
while True:  # the root is this user's directory, then a link to the other tree, then the directory again
    os.rename(root, parked); os.rename(link, root)
    os.rename(root, link); os.rename(parked, root)
"""


def test_a_real_race_on_the_root_never_loads_the_other_trees_bytes(ours_and_theirs):
    """Another process swaps the root and a link to the other tree as fast as it can while this one
    reads the entry; every read is this cache's entry, a refusal, or a miss (the root briefly absent).
    Bounded: 3000 reads or 6 seconds."""
    ours, theirs = ours_and_theirs
    mine = hashlib.sha256((ours.entry_dir(KEY) / "kernel.so").read_bytes()).hexdigest()
    link = ours.root.with_name("link")
    os.symlink(theirs.root, link)
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(ours.root), str(ours.root.with_name("parked")), str(link)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: collections.Counter = collections.Counter()
    try:
        assert swapper.stdout.readline().strip() == "swapping"
        deadline = time.monotonic() + 6
        while sum(seen.values()) < 3000 and time.monotonic() < deadline:
            try:
                meta = KernelCache(ours.root).read_meta(KEY)
            except UntrustedCacheError:
                seen["refused"] += 1
                continue
            seen["miss" if meta is None else "foreign" if meta.get("foreign") else "ours"] += 1
            if meta is not None:
                assert "foreign" in meta or meta["so_sha256"] == mine
    finally:
        swapper.kill()
        swapper.wait()
    print(f"\n[race] {dict(seen)}")
    assert seen["foreign"] == 0, dict(seen)
    assert seen["ours"] > 0 and seen["refused"] + seen["miss"] > 0, dict(seen)  # the race was on
