"""Command line: `python -m attn_prologue <command>` (also the `attn-prologue` console script).

Build-time commands import codegen lazily; the serving path never does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .lab import commands as lab_commands
from .variants import DEFAULT_BUILD_TARGETS, TARGETS


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    out = [line, "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(out)


def cmd_list(args) -> int:
    from .formats import layout_rows

    print("Cache formats (per token; records first, scale records in a footer after all records):\n")
    print(_table(layout_rows(args.head_dim)))
    if args.why:
        from .formats import FORMATS, NUMERICS_HELP, numerics_rows, preset_rows

        print(
            "\nParity choices per format (run-time: `numerics=` on every entry point, the same rule in the"
            " kernels and the reference; not variant axes):\n"
        )
        print(_table(numerics_rows()))
        for choice, text in NUMERICS_HELP.items():
            print(f"  {type(choice).__name__}.{choice.name} ({choice.value}): {text}")
        print(
            '\nEngine presets (numerics="preset=NAME[, field=value ...]"; docs/formats.md cites each source):\n'
        )
        print(_table([{k: v for k, v in r.items() if k != "source"} for r in preset_rows()]))
        print(
            "\nOther run-time modes (arguments of every kernel, not variant axes: each is a uniform branch):\n"
            "  apply_q_norm / apply_q_rope (qkv, `q_flags` bits): skip the Q RMSNorm / the Q RoPE\n"
            "  compress_ratio r (kv, kv_norm): insert only rows with (position + 1) % r == 0, RoPE at\n"
            "    position // r * r (the compressed-cache and indexer-key writers); ratios per format:\n"
            + "".join(f"    {f.name}: {', '.join(map(str, f.compress_ratios))}\n" for f in FORMATS.values())
            + "  int32 slot ids: the same module compiled for that width (launch config `_s32`)\n"
            "  the Q layout is an axis (`_qi`: FlashMLA's chunk-interleaved Q), its addressing differs"
        )
    if args.variants:
        from .codegen.variants import dropped_combinations, variant_space  # noqa: F401

        vs = variant_space()
        print(f"\n{len(vs)} generated variants:")
        for v in vs:
            print(f"  {v.name}")
        if args.why:
            print("\nnot generated:")
            names = {v.name for v in vs}
            for v, why in dropped_combinations():
                if v.name not in names:  # (an SM90 "native" combination is the portable module's alias)
                    print(f"  {v.name}: {why}")
    if args.archs:
        from .codegen.archs import ARCH_SPECS

        print("\nDefault launch configs, and why:\n")
        for spec in ARCH_SPECS.values():
            print(f"  {spec.reasoning()}\n")
    return 0


def cmd_generate(args) -> int:
    from .codegen import generate

    out = Path(args.out) if args.out else None
    if args.check:
        ok, report = generate.check(out)
        print(report)
        return 0 if ok else 1
    r = generate.write(out)
    print(
        f"generate: {r['variants']} variants, {r['written']} files written, {r['removed']} removed, {r['seconds']:.2f}s -> {r['out']}"
    )
    return 0


def _cache(args):
    from .jit.kernel_cache import KernelCache

    return KernelCache(Path(args.cache_dir) if args.cache_dir else None)


def cmd_build(args) -> int:
    from .codegen import build, generate
    from .codegen.variants import variant_space
    from .launch import LaunchConfig

    ok, report = generate.check()
    if not ok:
        print(report)
        return 1
    from .errors import UnsupportedError
    from .variants import check_targets

    variants = variant_space()
    if args.variants:
        wanted = set(args.variants)
        variants = [v for v in variants if v.name in wanted or any(v.name.startswith(w) for w in wanted)]
        if not variants:
            print(
                f"build: no generated variant matches {' '.join(args.variants)} (`list --variants` names them)"
            )
            return 2
    try:
        targets = set(check_targets(args.targets.split(","))) if args.targets else None
        configs = [LaunchConfig.from_key(k) for k in args.config.split(",")] if args.config else None
    except (UnsupportedError, ValueError) as exc:
        print(f"build: {exc}")
        return 2
    cache = _cache(args)
    print(f"build: {len(variants)} variants -> {cache.root}")
    r = build.run(
        cache, jobs=args.jobs, targets=targets, variants=variants, configs=configs, verbose=args.verbose
    )
    print()
    print(build.summary_table(r["entries"]))
    print(
        f"\nbuild: {len(r['entries'])} kernels ready ({r['compiled']} compiled now) in {r['wall_seconds']:.1f}s wall "
        f"({r['jobs']} jobs)"
    )
    if args.report:
        build.write_report(r["entries"], Path(args.report))
    _build_native(cache.root.parent / "native")
    return 0


def _print_native(root: Path) -> None:
    """Whether the native parts are built for this Python, tvm_ffi and torch (beside the kernel cache)."""
    from . import native
    from .errors import AttnPrologueError

    for part in native.PARTS:
        try:
            path = native.built_path(part, root)
        except AttnPrologueError as exc:  # an untrusted entry: say so, do not load it
            path, why = None, str(exc)
        else:
            why = "not built for this environment (`build` builds it)"
        print(f"  native {part}: {path if path is not None else why}")


def _build_native(root: Path) -> None:
    """The native fast path and the C++ torch-op kernels (native/): without a C/C++ compiler the
    Python paths serve, so a failure is reported, not fatal."""
    import time

    from . import native

    if not native.enabled():
        print(f"build: native parts skipped ({native.ENV_NATIVE}=0)")
        return
    for part in native.PARTS:
        t0 = time.perf_counter()
        try:
            path = native.build(part, root)
        except native.NativeBuildError as exc:
            print(f"build: native {part} NOT built (the Python path serves instead): {exc}")
            continue
        print(f"build: native {part} -> {path} ({time.perf_counter() - t0:.1f}s)")


def cmd_cache(args) -> int:
    """Where the kernel cache is, what it holds per target, and (with --clean) emptying it."""
    import collections
    import shutil

    cache = _cache(args)
    root = cache.root
    print(f"kernel cache: {root}{'' if root.exists() else ' (does not exist yet)'}")
    if not root.exists():
        return 0
    entries: collections.Counter = collections.Counter()
    size = locks = 0
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        size += path.stat().st_size
        if path.name.endswith(".lock") or path.name.endswith(".lock-owner"):
            locks += 1
        elif path.name == "meta.json" and len(path.relative_to(root).parts) == 5:  # host/target/variant/entry
            entries[path.relative_to(root).parts[1]] += 1
    for target, count in sorted(entries.items()):
        print(f"  {target:8} {count:5d} kernels")
    print(f"  {sum(entries.values())} kernels, {locks} lock files, {size / 2**20:.1f} MiB")
    _print_native(root.parent / "native")
    if args.clean:
        for child in root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        print(f"cleaned {root}")
    return 0


def cmd_package_kernels(args) -> int:
    from .codegen import package
    from .codegen.variants import variant_space
    from .variants import check_targets

    targets = list(check_targets(args.targets.split(",")))
    variants = variant_space()
    if args.variants:
        variants = [v for v in variants if any(v.name.startswith(w) for w in args.variants)]
        if not variants:
            print(f"package-kernels: no generated variant matches {' '.join(args.variants)}")
            return 2
    wheel = package.package(_cache(args), targets, Path(args.out), variants, jobs=args.jobs)
    print(f"package-kernels: {wheel} (install it on the serving hosts: `pip install {wheel.name}`)")
    return 0


def cmd_compile_entries(args) -> int:
    from .codegen import build

    build.compile_entries(_cache(args), args.entries, Path(args.stamp) if args.stamp else None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attn_prologue", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="cache formats and their byte layouts (and the variant space)")
    s.add_argument("--head-dim", type=int, default=512, help="D used to show formats that take any D")
    s.add_argument("--variants", action="store_true", help="also list every generated variant")
    s.add_argument(
        "--why", action="store_true", help="with --variants: why the other combinations are not generated"
    )
    s.add_argument(
        "--archs", action="store_true", help="why each arch family's default launch config is what it is"
    )
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("generate", help="render every variant into generated/ (writes only what changed)")
    s.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 with a diff if stale"
    )
    s.add_argument("--out", help="output folder (default: the package's generated/)")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser(
        "build", help="compile every variant for every target into the kernel cache (no GPU needed)"
    )
    s.add_argument(
        "--cache-dir", help="kernel cache (default $ATTN_PROLOGUE_CACHE or ~/.cache/attn_prologue/kernels)"
    )
    s.add_argument("--jobs", "-j", type=int, help="parallel compile processes (default: CPU count)")
    s.add_argument(
        "--targets",
        help=f"comma-separated compile targets (default {','.join(DEFAULT_BUILD_TARGETS)}; also: "
        f"{','.join(t for t in TARGETS if t not in DEFAULT_BUILD_TARGETS)})",
    )
    s.add_argument("--variants", nargs="*", help="variant names or name prefixes (default: all)")
    s.add_argument(
        "--config",
        help="comma-separated launch config keys, e.g. w4_u1_pdl1_nc1 (default: each arch's default + tuned ones)",
    )
    s.add_argument("--report", help="write every entry's metadata as JSON here")
    s.add_argument("--verbose", "-v", action="store_true", help="show every compile command ninja runs")
    s.set_defaults(fn=cmd_build)

    s = sub.add_parser(
        "bench", help="time the op against a copy of its bytes, torch eager and torch.compile (GPU)"
    )
    s.add_argument(
        "--shapes",
        default="targets",
        choices=["targets", "indexer", "records", "modes", "all", "quick", "baseline"],
        help="which shape set to time (targets: the fp8_ds_mla targets' shapes; records: the V4.1 and NVFP4 "
        "records'; modes: the op modes V4.1 engines call)",
    )
    s.add_argument("--max-tokens", type=int, help="skip shapes with more tokens than this")
    s.add_argument(
        "--replays", type=int, default=30, help="CUDA-graph replays per measurement (median taken)"
    )
    s.add_argument(
        "--no-baselines", action="store_true", help="skip torch eager / torch.compile of the reference"
    )
    s.add_argument("--no-checked", action="store_true", help="skip the checked-mode cost measurement")
    s.add_argument("--json", help="write results here")
    s.add_argument("--png", help="draw GB/s against token count here")
    s.set_defaults(fn=lab_commands.run_bench)

    s = sub.add_parser("targets", help="check the performance targets against a bench JSON (no GPU needed)")
    s.add_argument("json", help="a file written by `bench --json`")
    s.set_defaults(fn=lab_commands.run_targets)

    s = sub.add_parser(
        "tune", help="sweep launch configs per token-count bucket on this GPU; write the tuning database"
    )
    s.add_argument(
        "--variants", nargs="*", help="variant names or prefixes (default: every variant of this GPU's arch)"
    )
    s.add_argument(
        "--buckets", help="comma-separated token counts (default: powers of two up to --max-tokens)"
    )
    s.add_argument("--max-tokens", type=int, default=32768, help="largest token-count bucket to tune")
    s.add_argument(
        "--space", default="default", choices=["default", "full"], help="config space to enumerate"
    )
    s.add_argument("--configs", help="comma-separated config keys instead of a space")
    s.add_argument("--heads", type=int, default=64, help="H: live Q heads the entries are tuned at")
    s.add_argument("--padded-heads", type=int, default=64, help="P: heads written (pads included)")
    s.add_argument("--jobs", type=int, help="compile processes")
    s.add_argument("--replays", type=int, default=15, help="CUDA-graph replays per timing (median taken)")
    s.add_argument(
        "--db", help="tuning database to merge into (default $ATTN_PROLOGUE_TUNING_DB or the shipped one)"
    )
    s.add_argument("--plot-dir", help="write one PNG per variant: GB/s per config across buckets")
    s.add_argument("--json", help="write every timing here")
    s.set_defaults(fn=lab_commands.run_tune)

    s = sub.add_parser(
        "simulate",
        help="play a serving engine (one GPU, or ranks with --tp/--dp): pool, KV cache, chunked prefill + "
        "decode, needle recall",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=32768,
        help="scheduler token budget per step (pool size)",
    )
    s.add_argument("--padded-heads", type=int, default=64, help="P: heads of the padded Q buffer")
    s.add_argument(
        "--heads",
        type=int,
        help="H: live heads of the one simulated rank (default 16 = 64 / TP4; not with --tp/--dp)",
    )
    s.add_argument("--layers", type=int, default=43, help="attention layers (DeepSeek-V4-Flash: 43)")
    s.add_argument("--block-size", type=int, default=64, help="tokens per KV-cache block")
    s.add_argument(
        "--micro-batches", type=int, default=2, help="scratch buffers (steps alternate between them)"
    )
    s.add_argument(
        "--kv-fraction", type=float, default=0.90, help="share of the free memory the KV cache takes"
    )
    s.add_argument(
        "--memory-budget-gb",
        type=float,
        help="cap the memory the simulation may use (GB = 1e9 bytes; "
        "default: the whole GPU); enforced with torch.cuda.set_per_process_memory_fraction",
    )
    s.add_argument("--seqs", type=int, default=8, help="concurrent sequences")
    s.add_argument("--prompt-len", type=int, default=30000, help="prompt tokens per sequence (+-5%%)")
    s.add_argument("--decode-steps", type=int, default=32, help="decode steps after the prompts' prefill")
    s.add_argument(
        "--needles",
        type=int,
        default=64,
        help="(sequence, position, layer) cache entries checked bit-exactly",
    )
    s.add_argument(
        "--allocating",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the schedule with the old allocating op (fresh [N, P, D] Q per call) under the same budget",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of prompts, inputs and the block allocator")
    s.add_argument("--json", help="write the results here")
    s.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks: --query-heads are sharded over them (a run across ranks)",
    )
    s.add_argument("--dp", type=int, help="data-parallel groups: the sequences are split over them")
    s.add_argument(
        "--query-heads",
        type=int,
        default=64,
        help="with --tp/--dp: the model's query heads (each rank runs query-heads / tp of them)",
    )
    s.add_argument(
        "--spawn",
        action="store_true",
        help="start the tp x dp ranks as local processes (otherwise run under torchrun, which sets RANK etc.)",
    )
    s.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        help="torch.distributed backend (default: nccl with a GPU per local rank, else gloo: ranks share GPUs)",
    )
    s.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: the PyTorch reference on CPU tensors instead of the kernels (no allocating mode)",
    )
    s.add_argument(
        "--timeout-s", type=float, default=600.0, help="how long a rank waits for the others in a collective"
    )
    s.set_defaults(fn=lab_commands.run_simulate)

    s = sub.add_parser(
        "cache", help="where the kernel cache is, its size and kernels per target; --clean empties it"
    )
    s.add_argument(
        "--cache-dir", help="the cache (default $ATTN_PROLOGUE_CACHE or ~/.cache/attn_prologue/kernels)"
    )
    s.add_argument("--clean", action="store_true", help="remove every entry, lock and build file in it")
    s.set_defaults(fn=cmd_cache)

    s = sub.add_parser("package-kernels", help="build kernels for chosen targets and package them as a wheel")
    s.add_argument("--targets", required=True, help=f"comma-separated compile targets ({','.join(TARGETS)})")
    s.add_argument("--out", default="dist", help="folder for the wheel (default dist/)")
    s.add_argument("--variants", nargs="*", help="variant name prefixes (default: all)")
    s.add_argument("--cache-dir", help="the kernel cache to build into and package from")
    s.add_argument("--jobs", "-j", type=int, help="parallel compile processes (default: CPU count)")
    s.set_defaults(fn=cmd_package_kernels)

    s = sub.add_parser("compile-entries", help="(internal: one ninja edge of `build`)")
    s.add_argument("--cache-dir", help="the kernel cache to compile into")
    s.add_argument("--stamp", help="file to write once every entry is in the cache (the edge's output)")
    s.add_argument("entries", nargs="+", help="variant:target:config triples")
    s.set_defaults(fn=cmd_compile_entries)

    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.fn in NEEDS_GPU and getattr(args, "device", "cuda") != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(
                f"attn_prologue {args.command}: needs a CUDA GPU, and none is available here", file=sys.stderr
            )
            return 2
    from .errors import AttnPrologueError

    try:
        return args.fn(args)
    except AttnPrologueError as exc:  # the package's own, typed errors: one line, no traceback
        print(f"attn_prologue {args.command}: {exc}", file=sys.stderr)
        return 2


NEEDS_GPU = {lab_commands.run_bench, lab_commands.run_tune, lab_commands.run_simulate}


if __name__ == "__main__":
    sys.exit(main())
