"""`build`: a ninja graph that compiles every (variant, default config, target) into the kernel cache.

One edge per job: a worker process pays the DSL's import and first-compile warm-up (2-3 s on a 2-core
machine) once per edge instead of once per kernel, so the graph has as few edges as there are jobs.
Each edge takes every jobs-th entry of the list sorted by op, head dim, format and target, so every
edge holds the same mix of cheap and dear kernels and all of them finish together. Every (variant,
target) entry is compiled by exactly one edge; an entry's path contains its source hash, so an edited
template rebuilds exactly what changed and a second `build` finds nothing to do.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from attn_prologue import index_q, tuning
from attn_prologue.jit import cleaning, compiler
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.jit.trusted_fs import write_private
from attn_prologue.launch import LaunchConfig
from attn_prologue.parity import NumericsError
from attn_prologue.variants import CAPABILITIES, DEFAULT_BUILD_TARGETS, Op, Variant

from .variants import variant_space


def tuned_configs() -> dict[tuple[str, str], set[LaunchConfig]]:
    """(variant, target) -> configs the tuning database (shipped or $ATTN_PROLOGUE_TUNING_DB) names:
    the dispatcher may pick them at run time, so `build` compiles them too."""

    out: dict[tuple[str, str], set[LaunchConfig]] = collections.defaultdict(set)
    db = tuning.TuningDatabase.load(tuning.database_to_read())
    for e in db.entries:
        major, minor = (int(x) for x in str(e.get("capability", "0.0")).split("."))
        target = CAPABILITIES.get((major, minor), (None, None))[1]
        if target:
            out[(e["variant"], target)].add(LaunchConfig.from_key(e["config"]))
    return out


def build_keys(
    variants: Iterable[Variant],
    targets: set[str] | None = None,
    configs: Iterable[LaunchConfig] | None = None,
    numerics: Iterable[str] = (),
) -> list[tuple[Variant, KernelKey]]:
    """Every (variant, config, target) to compile: the given configs, or the arch default plus the
    configs the tuning database names for that variant and target. A given config with a knob the
    variant does not take (row_split, q_lanes: Variant.refusal) is left out for that variant. numerics: parity-choice
    spellings (e.g. "preset=vllm"); each defaults_only config is also compiled folded to each one's bits,
    for the formats that accept it (the dispatcher binds those modules to calls with exactly those bits;
    calls with other choices run the arch default config)."""
    given = set(configs or ())
    tuned = tuned_configs() if not given else {}
    keys = []
    for v in variants:
        for t in v.arch.targets:
            if t not in (DEFAULT_BUILD_TARGETS if targets is None else targets):
                continue
            chosen = {c for c in given if not v.refusal(c)} if given else {v.arch.default_config}
            chosen |= tuned.get((v.name, t), set())
            # calls with parity choices run the arch default (Runtime.serving_config), or these folded modules
            folding = [c for c in chosen if c.defaults_only]
            for bits in folded_bits(v, numerics):
                chosen |= {replace(c, defaults_only=False, folded_numerics=bits) for c in folding}
            if v.op is Op.INDEX_Q:  # its calls always run a module folded to their bits: each preset's
                presets = folded_bits(v, index_q.PRESETS) | {v.default_numerics}
                chosen = {c.folded_to(bits, v.default_numerics) for c in chosen for bits in presets}
            for cfg in sorted(chosen, key=lambda c: c.key):
                keys.append((v, KernelKey(v.name, cfg, t)))
    return keys


def folded_bits(v: Variant, numerics: Iterable[str]) -> set[int]:
    """The `numerics` bits of each spelling this variant accepts, other than its defaults'."""
    out = set()
    for spec in numerics:
        try:
            if v.op is Op.INDEX_Q:
                out.add(index_q.numerics_bits(spec, v.io_dtype.value, v.cache_format))
            else:
                out.add(v.format.numerics_flags(spec))
        except NumericsError:  # a preset or field this variant lacks: nothing to fold for it
            continue
    return out - {v.default_numerics}


def ninja_escape(path: str) -> str:
    """A path in a `build` line (outputs and inputs)."""
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def ninja_shell_word(value: str) -> str:
    """A variable value that ninja pastes into a shell command: quoted for the shell, `$` escaped."""
    return shlex.quote(value).replace("$", "$$")


def stamp_path(graph: Path, shard: str) -> Path:
    return graph.parent / "stamps" / f"{shard}.stamp"


MIN_ENTRIES_PER_EDGE = 8  # below this a worker's warm-up costs more than the parallelism gains


def balanced_shards(
    keys: list[tuple[Variant, KernelKey]], jobs: int
) -> dict[str, list[tuple[Variant, KernelKey]]]:
    """The keys in one part per job (fewer for a small build: at least MIN_ENTRIES_PER_EDGE each),
    `part<i>of<n>`: part i takes entries i, i + n, i + 2n, ... of the keys sorted by variant name and
    target, so each part has the same mix of ops, head dims, formats and targets."""
    ordered = sorted(keys, key=lambda vk: (vk[1].variant, vk[1].target, vk[1].config.key))
    parts = max(1, min(max(1, jobs), len(ordered) // MIN_ENTRIES_PER_EDGE))
    return {f"part{i + 1}of{parts}": ordered[i::parts] for i in range(parts)}


def write_graph(
    cache: KernelCache,
    keys: list[tuple[Variant, KernelKey]],
    path: Path,
    jobs: int = 2,
    verbose: bool = False,
) -> dict:
    """Write a ninja graph compiling `keys`; returns {shard: [the entries' meta paths]}.

    An edge's output is a stamp file its worker writes once every entry of the shard is published, not
    the entries themselves: ninja deletes the outputs of an edge it interrupts (Ctrl-C), and a finished
    entry must survive that. The graph lives in a directory of its own per `build`, so two builds of
    different sets never share a graph or ninja's log."""
    shards = balanced_shards(keys, jobs)
    lines = [
        "# Generated by `python -m attn_prologue build`. One edge per job (codegen/build.py).",
        "ninja_required_version = 1.10",
        f"python = {ninja_shell_word(sys.executable)}",
        f"cache = {ninja_shell_word(str(cache.root))}",
        "",
        "rule compile",
        "  command = $python -m attn_prologue compile-entries --cache-dir $cache --stamp $out"
        + (" --verbose" if verbose else "")
        + " $entries",
        "  description = compile $shard ($count kernels)",
        "",
    ]
    shared = [ninja_escape(str(path)) for path in compiler.shared_sources()]
    outputs = {}
    for shard, items in shards.items():
        ins = sorted({ninja_escape(str(compiler.module_path(v.name))) for v, _ in items}) + shared
        entries = " ".join(shlex.quote(f"{k.variant}:{k.target}:{k.config.key}") for _, k in items)
        lines.append(f"build {ninja_escape(str(stamp_path(path, shard)))}: compile {' '.join(ins)}")
        lines.append(f"  entries = {entries}")
        lines.append(f"  shard = {shard}")
        lines.append(f"  count = {len(items)}")
        outputs[shard] = [str(cache.meta_path(k)) for _, k in items]
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the commands ninja runs: private)
    write_private(path, "\n".join(lines) + "\n")
    return outputs


def compile_entries(
    cache: KernelCache, specs: list[str], stamp: Path | None = None, verbose: bool = False
) -> None:
    """Worker: compile 'variant:target:config' entries into the cache (a ninja edge), then its stamp;
    a line per kernel only when verbose (`build --verbose`)."""
    for spec in specs:
        variant, target, cfg = spec.split(":")
        t0 = time.perf_counter()
        meta = cache.ensure_built(KernelKey(variant, LaunchConfig.from_key(cfg), target))
        if verbose:
            regs = resources(meta)["registers"]
            print(f"  {variant} {target} {cfg}: {regs} regs, {time.perf_counter() - t0:.2f}s", flush=True)
    if stamp is not None:
        stamp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(stamp, "".join(f"{s}\n" for s in specs))


PROGRESS_SECONDS = 1.0  # how often the published entries are counted


def run_ninja(
    cmd: list[str], cache: KernelCache, keys: list[KernelKey], lines: bool = False, out=None
) -> int:
    """Run ninja, counting the entries published so far (ninja shows an edge's output only when the
    edge ends, and there is one edge per job): on a terminal one line rewritten in place; in a log (not
    a terminal, or `lines`) a line each time another quarter is done, three at most. Its exit status."""
    out = out or sys.stdout
    in_place = not lines and out.isatty()
    t0 = time.perf_counter()
    quarters = 0

    def show(done: int, end: str = "") -> None:
        text = f"build: {done}/{len(keys)} kernels compiled ({time.perf_counter() - t0:.0f}s)"
        out.write(f"\r{text}{end}" if in_place else f"{text}\n")
        out.flush()

    proc = subprocess.Popen(cmd)
    try:
        while True:
            try:
                returncode = proc.wait(timeout=PROGRESS_SECONDS)
            except subprocess.TimeoutExpired:
                done = sum(cache.meta_path(k).exists() for k in keys)
                if in_place:
                    show(done)
                elif quarters < 4 * done // len(keys) < 4:
                    quarters = 4 * done // len(keys)
                    show(done)
                continue
            if in_place:  # the last count stays on its line; the summary follows
                show(sum(cache.meta_path(k).exists() for k in keys), "\n")
            return returncode
    except BaseException:  # (Ctrl-C: ninja and its workers got the SIGINT too; as subprocess.run does)
        proc.kill()
        proc.wait()
        raise


def run(
    cache: KernelCache,
    *,
    jobs: int | None = None,
    targets: set[str] | None = None,
    variants: list[Variant] | None = None,
    configs: list[LaunchConfig] | None = None,
    numerics: Iterable[str] = (),
    verbose: bool = False,
) -> dict:
    """Compile what is missing of (variants x targets x configs) with ninja; every entry is checked
    afterwards. An intact entry is never rebuilt, so a second `build` runs no compile at all."""
    variants = variants if variants is not None else variant_space()
    keys = build_keys(variants, targets, configs, numerics)
    missing = [(v, k) for v, k in keys if cache.read_meta(k) is None]
    jobs = jobs or os.cpu_count() or 2
    t0 = time.perf_counter()
    graph = None
    if missing:
        cleaning.remove_dead(cache.tree, ("build",), r"(\d+)-[0-9a-f]{8}")  # what killed builds left
        here = cache.make_private_dirs("build", f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        graph = here / "build.ninja"
        write_graph(cache, missing, graph, jobs, verbose)
        cmd = [sys.executable, "-m", "ninja", "-C", str(here), "-f", graph.name, "-j", str(jobs)]
        cmd.append("-v" if verbose else "--quiet")  # (--quiet: no status line per edge; failures still print)
        try:
            returncode = run_ninja(cmd, cache, [k for _, k in missing], lines=verbose)
        finally:
            shutil.rmtree(here, ignore_errors=True)  # (its stamps, graph and log are this build's alone)
        if returncode != 0:
            raise SystemExit(f"build failed (ninja exit {returncode}); see the output above")
    wall = time.perf_counter() - t0
    metas = []
    for _, k in keys:
        meta = cache.read_meta(k)
        if meta is None:
            raise SystemExit(f"build finished but {k.variant} [{k.target}] has no intact cache entry")
        metas.append(meta)
    return {"wall_seconds": wall, "entries": metas, "compiled": len(missing), "jobs": jobs}


def resources(meta: dict) -> dict:
    """The entry's register and stack facts; an entry whose meta lacks them (written by hand, or by an
    older build) reports None for each, so summaries never fail on it."""
    found = meta.get("resources")
    found = found if isinstance(found, dict) else {}
    return {k: found.get(k) for k in ("registers", "frame_bytes", "min_stack_bytes", "local_sections")}


def _access_bits(meta: dict, kind: str) -> set[int]:
    ptx = meta.get("ptx")
    widths = ptx.get("global_access_bits") if isinstance(ptx, dict) else None
    return {int(k.rsplit(".", 1)[1]) for k in widths or () if k.startswith(kind)}


def summary_table(metas: list[dict]) -> str:
    """Per target: kernels, registers (min-max), stack/spills, global access widths, compile time
    (facts an entry does not record are left out of the min/max and sums)."""
    by_target = collections.defaultdict(list)
    for m in metas:
        by_target[m["target"]].append(m)
    header = f"{'target':8} {'kernels':>7} {'regs':>7} {'stack':>5} {'local':>5} {'loads (bits)':>16} {'stores (bits)':>16} {'compile s (sum/max)':>20}"
    rows = [header, "-" * len(header)]
    for target in sorted(by_target):
        ms = by_target[target]
        res = [resources(m) for m in ms]
        regs = [r["registers"] for r in res if isinstance(r["registers"], int)] or [0]
        stack = max((r["frame_bytes"] or 0) + (r["min_stack_bytes"] or 0) for r in res)
        local = sum(
            1
            for m, r in zip(ms, res)
            if (isinstance(m.get("ptx"), dict) and m["ptx"].get("local_memory")) or r["local_sections"]
        )
        loads = sorted(set().union(*(_access_bits(m, "ld") for m in ms)))
        stores = sorted(set().union(*(_access_bits(m, "st") for m in ms)))
        secs = [m.get("compile_seconds") for m in ms]
        secs = [t for t in secs if isinstance(t, (int, float))] or [0.0]
        rows.append(
            f"{target:8} {len(ms):7d} {min(regs):>3}-{max(regs):<3} {stack:5d} {local:5d} "
            f"{'/'.join(map(str, loads)):>16} {'/'.join(map(str, stores)):>16} {sum(secs):>12.1f} / {max(secs):.2f}"
        )
    return "\n".join(rows)


def write_report(metas: list[dict], path: Path) -> None:
    path.write_text(json.dumps(metas, indent=1, sort_keys=True))
