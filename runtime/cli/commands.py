"""The build-side commands (`list`, `generate`, `build`, `cache`, `package-kernels`, and the internal
`compile-entries`); the lab's commands are in attn_prologue.lab.commands. Each imports what it needs
when it runs."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

from .options import matches


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    out = [line, "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(out)


def cmd_list(args) -> int:
    from ..codegen.variants import dropped_combinations, variant_space
    from ..formats import FORMATS, NUMERICS_HELP, layout_rows, numerics_rows, preset_rows

    space = variant_space()
    print("Cache formats (per token; records first, scale records in a footer after all records):\n")
    rows = layout_rows(args.head_dim)
    for row in rows:  # a format defined for any D is generated at the variant space's D values only
        if FORMATS[row["format"]].head_dim is None:
            dims = sorted({(v.head_dim, v.rope_dim) for v in space if v.cache_format == row["format"]})
            row["D/R"] = f"{', '.join(f'{d}/{r}' for d, r in dims)} (shown D={args.head_dim})"
    print(_table(rows))
    if args.why:
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
        print(f"\n{len(space)} generated variants:")
        for v in space:
            print(f"  {v.name}")
        if args.why:
            _print_not_generated({v.name for v in space}, dropped_combinations(), args.verbose)
    if args.archs:
        from ..codegen.archs import ARCH_SPECS

        print("\nDefault launch configs, and why:\n")
        for spec in ARCH_SPECS.values():
            print(f"  {spec.reasoning()}\n")
    return 0


def _print_not_generated(generated: set[str], dropped, verbose: bool) -> None:
    """One line per reason with its count; every name once, under the first reason that drops it (an
    SM90 "native" combination is the portable module's alias, so generated)."""
    by_reason: dict[str, list[str]] = {}
    seen = set(generated)
    for v, why in dropped:
        if v.name not in seen:
            seen.add(v.name)
            by_reason.setdefault(why, []).append(v.name)
    total = sum(map(len, by_reason.values()))
    print(
        f"\nnot generated: {total} names, {len(by_reason)} reasons"
        + ("" if verbose else " (--verbose: every name)")
    )
    for why, names in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        line = f"{len(names):4d} x {why}" + ("" if verbose else f" (e.g. {names[0]})")
        # a long reason is wrapped to a terminal's width (continued at 7 spaces; --verbose's names are at 9)
        print(textwrap.fill(line, width=100, initial_indent="  ", subsequent_indent=" " * 7))
        if verbose:
            print("".join(f"         {n}\n" for n in names), end="")


def cmd_generate(args) -> int:
    from ..codegen import generate

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
    from ..jit.kernel_cache import KernelCache

    return KernelCache(Path(args.cache_dir) if args.cache_dir else None)


def cmd_build(args) -> int:
    from ..codegen import build, generate
    from ..codegen.variants import variant_space

    ok, report = generate.check()
    if not ok:
        print(report)
        return 1
    variants = [v for v in variant_space() if matches(v.name, args.variants)]
    for spec in args.numerics or ():
        if not any(build.folded_bits(v, [spec]) for v in variants):
            print(
                f"build --numerics {spec!r}: no format of these variants takes it (or it is their defaults)"
            )
            return 2
    cache = _cache(args)
    print(f"build: {len(variants)} variants -> {cache.root}")
    # the native parts compile beside the kernels (a C++ compile of ~15 s on one core would otherwise
    # run alone after them); their lines are printed once the kernels are done
    native_lines: list[str] = []
    native_failure: list[BaseException] = []

    def native_parts() -> None:
        try:
            _build_native(cache.root, native_lines.append)
        except BaseException as exc:  # raised again below, in this thread
            native_failure.append(exc)

    native_build = threading.Thread(target=native_parts, daemon=True)
    native_build.start()
    r = build.run(
        cache,
        jobs=args.jobs,
        targets=args.targets,
        variants=variants,
        configs=args.config,
        numerics=args.numerics or (),
        verbose=args.verbose,
    )
    print()
    print(build.summary_table(r["entries"]))
    print(
        f"\nbuild: {len(r['entries'])} kernels ready ({r['compiled']} compiled now) in {r['wall_seconds']:.1f}s wall "
        f"({r['jobs']} jobs)"
    )
    if args.report:
        build.write_report(r["entries"], Path(args.report))
    native_build.join()
    print("\n".join(native_lines))
    if native_failure:
        raise native_failure[0]
    return 0


def _print_native(root: Path) -> None:
    """Whether the native parts are built for this Python, tvm_ffi and torch (in the kernel cache `root`)."""
    from .. import native
    from ..errors import AttnPrologueError

    for part in native.PARTS:
        try:
            path = native.built_path(part, root)
        except AttnPrologueError as exc:  # an untrusted entry: say so, do not load it
            path, why = None, str(exc)
        else:
            why = "not built for this environment (`build` builds it)"
        print(f"  native {part}: {path if path is not None else why}")


def _build_native(root: Path, say=print) -> None:
    """The native fast path and the C++ torch-op kernels (`root`/native/): without a C/C++ compiler the
    Python paths serve, so a failure is reported (through `say`), not fatal."""
    import time

    from .. import native

    if not native.enabled():
        say(f"build: native parts skipped ({native.ENV_NATIVE}=0)")
        return
    for part in native.PARTS:
        t0 = time.perf_counter()
        try:
            path = native.build(part, root)
        except native.NativeBuildError as exc:
            say(f"build: native {part} NOT built (the Python path serves instead): {exc}")
            continue
        say(f"build: native {part} -> {path} ({time.perf_counter() - t0:.1f}s)")


def cmd_cache(args) -> int:
    """Where the kernel cache is, what it holds per target, and (with --clean) emptying it."""
    import collections

    cache = _cache(args)
    root = cache.root
    print(f"kernel cache: {root}{'' if root.exists() else ' (does not exist yet)'}")
    if not root.exists():
        return 0
    if args.clean:  # checked (the cache's marker, its layouts) before anything below the root is walked
        removed = cache.clean()
        print(f"cleaned {root} ({', '.join(removed) or 'nothing to remove'})")
        return 0
    entries: collections.Counter = collections.Counter()
    size = 0  # (lock files are counted in the size only: one per entry, they say nothing)
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        size += path.stat().st_size
        if path.name == "meta.json" and len(path.relative_to(root).parts) == 5:  # host/target/variant/entry
            entries[path.relative_to(root).parts[1]] += 1
    for target, count in sorted(entries.items()):
        print(f"  {target:8} {count:5d} kernels")
    print(f"  {sum(entries.values())} kernels, {size / 2**20:.1f} MiB")
    _print_native(root)
    return 0


def cmd_package_kernels(args) -> int:
    from ..codegen import package
    from ..codegen.variants import variant_space

    variants = [v for v in variant_space() if matches(v.name, args.variants)]
    wheel = package.package(_cache(args), sorted(args.targets), Path(args.out), variants, jobs=args.jobs)
    print(f"package-kernels: {wheel} (install it on the serving hosts: `pip install {wheel.name}`)")
    return 0


def cmd_compile_entries(args) -> int:
    # A ninja edge's worker. tvm_ffi (imported by the DSL) imports torch only to pre-empt a symbol clash
    # on Windows (its __init__ says so): 2 of a worker's 3.5 s of imports on a 2-core machine. A compile
    # touches no tensor, so the worker imports tvm_ffi with torch hidden (the kernels are the same bytes);
    # whatever imports torch later still gets it.
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # (an import of it raises ImportError, which tvm_ffi catches)
        try:
            import tvm_ffi  # noqa: F401
        except ImportError:
            pass  # (no DSL here: the compile below says so)
        finally:
            del sys.modules["torch"]
    from ..codegen import build

    build.compile_entries(_cache(args), args.entries, Path(args.stamp) if args.stamp else None, args.verbose)
    return 0
