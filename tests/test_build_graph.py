"""The ninja build graph: every (variant, target) is an output of exactly one edge, the session's
graph matches its subset, and a second `build` does no work."""

from __future__ import annotations

import collections
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from attn_prologue.codegen import build, generate
from attn_prologue.codegen.variants import variant_space
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import Variant, parse_name

from .support.build import ENTRIES, build_cli

# ---- the build graph ----------------------------------------------------------------------------------
_COLON = object()


def _ninja_words(text: str) -> list:
    """Split a ninja `build` line into words, undoing `$ `, `$:` and `$$`; an unescaped ':' is _COLON."""
    words, cur, i = [], "", 0
    while i < len(text):
        c = text[i]
        if c == "$":
            cur += text[i + 1]
            i += 2
            continue
        if c in " :":
            if cur:
                words.append(cur)
                cur = ""
            if c == ":":
                words.append(_COLON)
        else:
            cur += c
        i += 1
    if cur:
        words.append(cur)
    return words


def parse_graph(path: Path) -> tuple[dict, list[dict]]:
    variables, edges = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("build "):
            words = _ninja_words(line[len("build ") :])
            colon = words.index(_COLON)
            edges.append(
                {"outputs": words[:colon], "rule": words[colon + 1], "inputs": words[colon + 2 :], "vars": {}}
            )
        elif line.startswith("  ") and edges and "=" in line:
            name, _, value = line.strip().partition(" = ")
            edges[-1]["vars"][name] = value
        elif re.match(r"^[a-z_]+ = ", line):
            name, _, value = line.partition(" = ")
            variables[name] = value
    return variables, edges


def _check_graph(root: Path, keys: list[tuple[Variant, KernelKey]]):
    cache = KernelCache(root)
    graph = root / "build" / "build.ninja"
    _, edges = parse_graph(graph)
    expected = {str(cache.meta_path(k)): (v, k) for v, k in keys}
    outputs = collections.Counter(o for e in edges for o in e["outputs"])
    assert set(outputs) == set(expected)
    assert all(n == 1 for n in outputs.values()), [o for o, n in outputs.items() if n > 1][:5]
    lib = str(compiler.kernel_lib_path())
    for e in edges:
        assert e["rule"] == "compile"
        specs = shlex.split(e["vars"]["entries"])
        assert int(e["vars"]["count"]) == len(specs) == len(e["outputs"])
        from_specs = set()
        for spec in specs:
            variant, target, cfg = spec.split(":")
            from_specs.add(str(cache.meta_path(KernelKey(variant, LaunchConfig.from_key(cfg), target))))
        assert from_specs == set(e["outputs"])  # the edge compiles exactly what it promises
        vs = {expected[o][0] for o in e["outputs"]}
        assert {build.shard_of(v) for v in vs} == {e["vars"]["shard"]}
        assert set(e["inputs"]) == {str(compiler.module_path(v.name)) for v in vs} | {lib}
    # ninja itself reads the same graph: the same outputs, and commands a shell splits correctly
    run = [sys.executable, "-m", "ninja", "-C", str(graph.parent), "-f", graph.name, "-t"]
    targets = subprocess.run(run + ["targets", "all"], capture_output=True, text=True, check=True).stdout
    assert sorted(line.rsplit(": ", 1)[0] for line in targets.splitlines()) == sorted(expected)
    commands = subprocess.run(
        run + ["commands"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(commands) == len(edges)
    prefix = [sys.executable, "-m", "attn_prologue", "compile-entries", "--cache-dir", str(root)]
    argvs = [shlex.split(c) for c in commands]
    assert all(argv[: len(prefix)] == prefix for argv in argvs), argvs[0][: len(prefix)]
    assert sorted(argv[len(prefix) :] for argv in argvs) == sorted(
        shlex.split(e["vars"]["entries"]) for e in edges
    )
    return edges


def test_full_build_graph_is_complete(tmp_path):
    """Every (variant, target) of the manifest is an output of exactly one edge (nothing compiled)."""
    root = tmp_path / "kernel cache: with $pecial chars"
    keys = build.build_keys(variant_space())
    manifest = (generate.default_out_dir() / "MANIFEST").read_text().split()
    pairs = {(v.name, k.target) for v, k in keys}
    assert pairs == {(n, t) for n in manifest for t in parse_name(n).arch.targets}
    assert len(pairs) == 352
    assert (
        len(keys)
        == len({(k.variant, k.target, k.config.key) for _, k in keys})
        == 352
        + sum(len(cs - {parse_name(v).arch.default_config}) for (v, _), cs in build.tuned_configs().items())
    )
    build.write_graph(KernelCache(root), keys, root / "build" / "build.ninja")
    edges = _check_graph(root, keys)
    assert len(edges) == len({build.shard_of(v) for v, _ in keys})
    assert not list(root.rglob("meta.json"))  # writing the graph compiles nothing


@pytest.mark.slow
def test_session_build_graph_matches_the_subset(built):
    _check_graph(built.root, ENTRIES)


@pytest.mark.slow
def test_second_build_does_no_work(built):
    sos = {k: built.cache.entry_dir(k) / "kernel.so" for _, k in ENTRIES}
    before = {k: p.stat().st_mtime_ns for k, p in sos.items()}
    proc, seconds = build_cli(built.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    print(f"\n[test_build] second build: {seconds:.2f}s")
    assert "ninja: no work to do." in out
    assert not re.search(r"^\[\d+/\d+\] compile ", out, re.M)
    assert {k: p.stat().st_mtime_ns for k, p in sos.items()} == before
    assert f"build: {len(ENTRIES)} kernels ready" in out
    assert seconds < 30, f"a no-op build took {seconds:.1f}s"
