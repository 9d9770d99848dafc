"""The ninja build graph: every (variant, target) is an output of exactly one edge, the session's
graph matches its subset, and a second `build` does no work."""

from __future__ import annotations

import collections
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from attn_prologue import index_q
from attn_prologue.codegen import build, generate
from attn_prologue.codegen.variants import variant_space
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.variants import DEFAULT_BUILD_TARGETS, Op, Variant, parse_name

from .support.build import ENTRIES, build_cli, kernels_only_env

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


def _check_graph(root: Path, keys: list[tuple[Variant, KernelKey]], graph: Path):
    cache = KernelCache(root)
    _, edges = parse_graph(graph)
    expected = {f"{k.variant}:{k.target}:{k.config.key}": (v, k) for v, k in keys}
    specs = collections.Counter(spec for e in edges for spec in shlex.split(e["vars"]["entries"]))
    assert set(specs) == set(expected)
    assert all(n == 1 for n in specs.values()), [s for s, n in specs.items() if n > 1][:5]
    shared = {str(path) for path in compiler.shared_sources()}
    for e in edges:
        assert e["rule"] == "compile"
        mine = shlex.split(e["vars"]["entries"])
        assert int(e["vars"]["count"]) == len(mine)
        vs = {expected[spec][0] for spec in mine}
        assert re.fullmatch(r"part\d+of\d+", e["vars"]["shard"]) and vs
        assert set(e["inputs"]) == {str(compiler.module_path(v.name)) for v in vs} | shared
        # the edge's output is its stamp, never an entry: ninja deletes an interrupted edge's outputs
        assert e["outputs"] == [str(build.stamp_path(graph, e["vars"]["shard"]))]
        assert not any(str(cache.root) in o and o.endswith("meta.json") for o in e["outputs"])
    # ninja itself reads the same graph: the same outputs, and commands a shell splits correctly
    run = [sys.executable, "-m", "ninja", "-C", str(graph.parent), "-f", graph.name, "-t"]
    targets = subprocess.run(run + ["targets", "all"], capture_output=True, text=True, check=True).stdout
    assert sorted(line.rsplit(": ", 1)[0] for line in targets.splitlines()) == sorted(
        o for e in edges for o in e["outputs"]
    )
    commands = subprocess.run(
        run + ["commands"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(commands) == len(edges)
    prefix = [sys.executable, "-m", "attn_prologue", "compile-entries", "--cache-dir", str(root), "--stamp"]
    argvs = [shlex.split(c) for c in commands]
    assert all(argv[: len(prefix)] == prefix for argv in argvs), argvs[0][: len(prefix)]
    assert sorted(argv[len(prefix) + 1 :] for argv in argvs) == sorted(
        shlex.split(e["vars"]["entries"]) for e in edges
    )
    return edges


def test_full_build_graph_is_complete(tmp_path):
    """Every (variant, target) of the manifest is in exactly one edge (nothing compiled)."""
    root = tmp_path / "kernel cache: with $pecial chars"
    keys = build.build_keys(variant_space())
    manifest = (generate.default_out_dir() / "MANIFEST").read_text().split()
    pairs = {(v.name, k.target) for v, k in keys}
    assert pairs == {
        (n, t) for n in manifest for t in parse_name(n).arch.targets if t in DEFAULT_BUILD_TARGETS
    }
    # 80 sm90 modules x 1 target + 126 sm100 x 1 default target + 126 sm120 x 1 (sm_120f)
    assert len(pairs) == 80 + 126 + 126 == 332
    assert (
        len(keys)
        == len({(k.variant, k.target, k.config.key) for _, k in keys})
        == 332
        + sum(
            len(cs - {parse_name(v).arch.default_config})
            for (v, _), cs in build.tuned_configs().items()
            if parse_name(v).op is not Op.INDEX_Q
        )
        # an index_q module: each of its configs (the default and its tuned ones) folded to the defaults'
        # bits and to each preset's, instead of once; a config tuned for one preset (`tune --numerics`)
        # is already folded to its bits: compiled once
        + sum(
            len(
                {
                    c.folded_to(bits, v.default_numerics)
                    for c in build.tuned_configs().get((v.name, t), set()) | {v.arch.default_config}
                    for bits in build.folded_bits(v, index_q.PRESETS) | {v.default_numerics}
                }
            )
            - 1  # (its default config folded to the defaults' bits: one of the 332)
            for v, t in {(v, k.target) for v, k in keys if v.op is Op.INDEX_Q}
        )
    )
    graph = root / "build" / "one" / "build.ninja"
    build.write_graph(KernelCache(root), keys, graph, jobs=2)
    edges = _check_graph(root, keys, graph)
    # one edge per job, each with every op, head dim and target (the same mix), sizes within one entry
    counts = [int(e["vars"]["count"]) for e in edges]
    assert len(edges) == 2 and max(counts) - min(counts) <= 1
    for e in edges:
        mine = [spec.split(":") for spec in shlex.split(e["vars"]["entries"])]
        assert {parse_name(v).op for v, _t, _c in mine} == {v.op for v, _ in keys}
        assert {parse_name(v).head_dim for v, _t, _c in mine} == {v.head_dim for v, _ in keys}
        assert {t for _v, t, _c in mine} == {k.target for _, k in keys}
    assert not list(root.rglob("meta.json"))  # writing the graph compiles nothing


def test_shards_balance_for_the_jobs():
    """One part per job, sizes within one entry, every key in exactly one part; a small build takes
    fewer parts (at least MIN_ENTRIES_PER_EDGE entries each), never an empty one."""
    keys = build.build_keys(variant_space())
    spec = lambda k: (k.variant, k.target, k.config.key)  # noqa: E731
    for jobs, n_keys, parts in ((2, len(keys), 2), (8, len(keys), 8), (2, 16, 2), (2, 15, 1), (4, 3, 1)):
        shards = build.balanced_shards(keys[:n_keys], jobs)
        sizes = [len(items) for items in shards.values()]
        assert len(shards) == parts and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (
            jobs,
            n_keys,
            sizes,
        )
        assert sorted(spec(k) for items in shards.values() for _, k in items) == sorted(
            spec(k) for _, k in keys[:n_keys]
        )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_ninja_reports_progress_and_the_exit_status(tmp_path, monkeypatch, capsys):
    """While ninja runs the entries already published are counted: in a log, a line per quarter of
    them done (three at most); on a terminal, one line rewritten in place that keeps the last count.
    The command's exit status comes back (here a stand-in that publishes one entry of two)."""
    cache = KernelCache(tmp_path / "cache")
    keys = [k for _, k in build.build_keys([v for v in variant_space() if v.name.startswith(SMALL)])][:2]
    cache.meta_path(keys[0]).parent.mkdir(parents=True)
    cache.meta_path(keys[0]).write_text("{}")
    monkeypatch.setattr(build, "PROGRESS_SECONDS", 0.2)
    wait = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    assert build.run_ninja(wait, cache, keys) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"build: 1/2 kernels compiled \(\d+s\)", lines[0]), lines
    terminal = _Terminal()
    assert build.run_ninja(wait, cache, keys, out=terminal) == 0
    shown = terminal.getvalue()
    assert shown.count("\n") == 1 and shown.endswith("\n") and shown.count("\r") >= 3
    assert all(
        re.fullmatch(r"build: 1/2 kernels compiled \(\d+s\)", s) for s in shown.strip().split("\r")[1:]
    )
    assert build.run_ninja([sys.executable, "-c", "raise SystemExit(3)"], cache, keys) == 3


def test_a_kernel_line_each_only_when_verbose(tmp_path):
    """`build` passes --verbose on to its workers (and -v to ninja), else --quiet: a per-kernel line is
    printed only when asked for."""
    keys = build.build_keys([v for v in variant_space() if v.name.startswith(SMALL)])
    for verbose in (False, True):
        graph = tmp_path / str(verbose) / "build.ninja"
        build.write_graph(KernelCache(tmp_path / "cache"), keys, graph, jobs=1, verbose=verbose)
        rule = next(line for line in graph.read_text().splitlines() if line.startswith("  command = "))
        assert ("--verbose" in rule) == verbose


@pytest.mark.slow
def test_the_session_build_leaves_no_graph_behind(built):
    assert not (built.root / "build").exists() or not any((built.root / "build").iterdir())


@pytest.mark.slow
def test_second_build_does_no_work(built):
    sos = {k: built.cache.entry_dir(k) / "kernel.so" for _, k in ENTRIES}
    before = {k: p.stat().st_mtime_ns for k, p in sos.items()}
    proc, seconds = build_cli(built.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    print(f"\n[test_build] second build: {seconds:.2f}s")
    assert f"{len(ENTRIES)} kernels ready (0 compiled now)" in out
    assert not re.search(r"^\[\d+/\d+\] compile ", out, re.M)
    assert {k: p.stat().st_mtime_ns for k, p in sos.items()} == before
    assert f"build: {len(ENTRIES)} kernels ready" in out
    assert seconds < 30, f"a no-op build took {seconds:.1f}s"


SMALL = "kv_d512r64_bf16_bf16"  # 3 variants, 4 kernels: one edge, quick to compile


def test_ctrl_c_during_a_build_keeps_every_finished_entry(tmp_path):
    """An interrupt stops ninja and its worker; entries published before it stay intact (ninja only
    removes the interrupted edge's stamp), and the next build compiles just the rest."""
    root = tmp_path / "cache"
    cmd = [
        sys.executable,
        "-m",
        "attn_prologue",
        "build",
        "--cache-dir",
        str(root),
        "--variants",
        SMALL,
        "-j",
        "1",
    ]
    env = kernels_only_env()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    cache = KernelCache(root)
    keys = [k for _, k in build.build_keys([v for v in variant_space() if v.name.startswith(SMALL)])]
    deadline = time.monotonic() + 300
    while not any(cache.read_meta(k) for k in keys) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    proc.communicate(timeout=120)
    done = [k for k in keys if cache.read_meta(k) is not None]
    assert done, "nothing finished before the interrupt (the test needs one entry published)"
    assert all(cache.entry_dir(k).joinpath("kernel.so").exists() for k in done)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"{len(keys)} kernels ready ({len(keys) - len(done)} compiled now)" in again.stdout


def test_two_builds_of_different_sets_into_one_cache(tmp_path):
    root = tmp_path / "cache"
    sets = [SMALL, "kv_d128r64_bf16_bf16"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(root), "--variants", v, "-j", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for v in sets
    ]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    for out in outs:  # not a terminal: at most three progress lines, no line per kernel or ninja edge
        assert len(re.findall(r"^build: \d+/\d+ kernels compiled", out, re.M)) <= 3
        assert not re.search(r" regs, |^\[\d+/\d+\] ", out, re.M), out
    cache = KernelCache(root)
    keys = [k for _, k in build.build_keys([v for v in variant_space() if v.name.startswith(tuple(sets))])]
    assert all(cache.read_meta(k) is not None for k in keys)
