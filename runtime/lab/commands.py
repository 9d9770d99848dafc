"""The lab's command-line commands (`bench`, `targets`, `tune`, `simulate`): attn_prologue.cli
parses and range-checks the arguments (lists, names and numbers arrive converted) and calls these."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from .. import dispatch, tuning
from ..errors import InputError
from ..formats import ScaleCode, get_format
from ..parity import NumericsError
from ..variants import generated, parse_name
from . import bench, bench_index_q, plots, shape_sets, simulate, targets, tune
from .provenance import provenance
from .timing import l2_bytes


def _with_changes(shapes: list, changes: list[tuple[str, object]]) -> tuple[list, list[str]]:
    """Each shape, then its copy under each `--also` change that applies to it (lean_quant: a format
    that quantizes; numerics: one whose format accepts the choices; row_split: a module that takes it);
    and the skipped ones' reasons."""
    out, skipped = [], []
    for shape in shapes:
        out.append(shape)
        for field, value in changes:
            changed = replace(shape, **{field: value})
            fmt = get_format(shape.cache_format)
            unscaled = fmt.scale in (ScaleCode.NONE, ScaleCode.TENSOR_F32)  # no per-block scale
            try:
                if field == "numerics":
                    fmt.numerics_flags(value)
                elif field == "lean_quant" and unscaled:
                    raise NumericsError(f"{fmt.name} has no per-block scale for lean_quant to compute")
                elif field == "row_split":
                    takes = dispatch.default_runtime().variant(shape.request).row_splits
                    if value not in takes:
                        raise ValueError(f"its module takes row_split {takes} (Variant.row_splits)")
            except (NumericsError, ValueError) as exc:
                skipped.append(f"{changed.label}: {str(exc).splitlines()[0]}")
                continue
            out.append(changed)
    return out, skipped


def run_bench(args) -> int:
    if args.shapes == "index_q":  # the indexer's Q prologue: its own inputs and bytes
        return bench_index_q.run(args)
    origin = provenance()
    shapes = shape_sets.default_shapes(args.shapes)
    if args.max_tokens:
        shapes = [s for s in shapes if s.n <= args.max_tokens]
    shapes, skipped = _with_changes(shapes, args.also or [])
    for line in skipped:
        print(f"skipped {line}")
    # host overhead in the fresh process, and again after the shapes (their torch.compile baselines
    # and graphs stay in the process): both are reported and checked
    host = bench.host_overhead_us(bench.Shape(n=1))
    results = []
    for i, shape in enumerate(shapes):
        r = bench.run_shape(
            shape,
            baselines=not args.no_baselines,
            replays=args.replays,
            count_sass=args.shapes in shape_sets.SASS_SHAPE_SETS,
        )
        results.append(r)
        if args.json:  # written after every shape: a run cut short keeps what it measured
            bench.save(bench.document(results, {"partial": True}, origin), args.json)
        instr = f", {bench.sass.summary(r.sass)} instructions per value" if r.sass else ""
        print(
            f"[{i + 1}/{len(shapes)}] {shape.label}: {r.op['median_us']:.2f} us, {r.gbs:.0f} GB/s, "
            f"{r.copy['median_us'] / r.op['median_us']:.1%} of copy ({r.copy['kind']}){instr}",
            flush=True,
        )
    print()
    print(bench.print_table(results))
    host_end = bench.host_overhead_us(bench.Shape(n=1))
    for label, h in (("fresh process", host), ("after the shapes", host_end)):
        print(
            f"\nhost overhead per eager call (T=1, whole Python path, {label}): bound op {h['bound_op_us']:.2f} us; "
            f"one-call function {h['median_us']:.2f} us; bare TVM-FFI call {h['bare_tvm_ffi_call_us']:.2f} us; "
            f"through torch.ops {h['torch_ops_call_us']:.2f} us"
        )
    checked = []
    if not args.no_checked:
        for n in (1, 2048, 8192):  # the always-on bounds checks: their cost at decode and at prefill sizes
            c = bench.checked_cost(bench.Shape(n=n), replays=args.replays)
            checked.append(c)
            print(
                f"bounds checks, {c['shape']}: {c['checked_us']:.2f} us vs {c['unchecked_us']:.2f} us without "
                f"({c['cost']:+.1%}, {c['checked_us'] - c['unchecked_us']:+.3f} us; run-to-run spread "
                f"{c['unchecked_spread']:.1%})"
            )
    meta = {
        "skipped": skipped,  # `--also` copies of shapes whose format lacks the change, with the reason
        "checked_mode": checked,
        "host_overhead": host,
        "host_overhead_end": host_end,
        "l2_bytes": l2_bytes(),
    }
    doc = bench.document(results, meta, origin)
    if args.json:
        bench.save(doc, args.json)
    if args.png:
        plots.bench_plot(results, args.png, origin["device"]["name"])
    print("\n" + targets.print_targets(targets.check_targets(doc)))
    return 0


def run_targets(args) -> int:
    """Exit 0 when every target is met, 1 when one is missed; a file that cannot be read or holds no
    bench results is an InputError (one line, exit 2)."""
    rows = targets.check_file(Path(args.json))
    print(targets.print_targets(rows))
    missed = sum(not r["met"] for r in rows)
    print(f"\ntargets: {len(rows) - missed} met, {missed} missed ({targets.summary(rows)}) ({args.json})")
    return 0 if missed == 0 else 1


def run_tune(args) -> int:
    like = _like_source(args) if args.like else None  # its options are checked before the GPU is
    facts = dispatch.default_runtime().device()
    arch, target = facts.arch, facts.target
    names = sorted(
        n
        for n in generated()
        if parse_name(n).arch is arch and parse_name(n).conversions is arch.default_conversions
    )
    names = [n for n in names if not args.variants or any(n.startswith(w) for w in args.variants)]
    if args.compress_ratio != 1:  # the compressed writers: KV-only modules of a format that takes it
        names = [
            n
            for n in names
            if not parse_name(n).op.has_q
            and args.compress_ratio in get_format(parse_name(n).cache_format).compress_ratios
        ]
    if not names:
        ratio = f" writing compress ratio {args.compress_ratio}" if args.compress_ratio != 1 else ""
        print(f"tune: no {arch.value} variant{ratio} matches {args.variants}")
        return 1
    default = arch.default_config
    if args.numerics is not None:
        try:
            for n in names:  # (checked before any sweep starts)
                tune.for_preset(n, [default], args.numerics)
        except (ValueError, NumericsError) as exc:
            raise InputError(f"tune --numerics {args.numerics}: {exc}") from None
        if like is not None:
            raise InputError("tune --numerics: not with --like (its entries say what they were tuned for)")
    if like is not None:
        try:
            followed_entries = tune.like_followed(like, names, args.like_gpu)
            plan = tune.like_groups(followed_entries, default)
            followed = tune.like_record(args.like, followed_entries)
        except ValueError as exc:
            raise InputError(f"tune --like {args.like}: {exc}") from None
    else:
        followed = None
        # each variant's space (index_q's knobs are its own), the heuristic's choice always among them
        buckets = args.buckets or tuning.default_buckets(args.max_tokens)
        configs = {
            n: tune.for_preset(
                n, tune.prune([*(args.configs or tune.space_for(n, args.space)), default]), args.numerics
            )
            for n in names
        }
        plan = [tune.SweepPlan(args.heads, args.padded_heads, args.compress_ratio, tuple(buckets), configs)]
    origin = provenance()
    env = tuning.current_environment()
    sweeps, new, default_us = [], [], []
    for sweep_plan in plan:
        variants, buckets = list(sweep_plan.configs), list(sweep_plan.buckets)
        print(
            f"tune: {len(variants)} variants x {max(map(len, sweep_plan.configs.values()))} configs x {len(buckets)} buckets"
            f" (H={sweep_plan.heads}, P={sweep_plan.padded_heads}, compress ratio {sweep_plan.compress_ratio})"
            f" on {torch.cuda.get_device_name()} ({target})"
        )
        sweep = tune.run(
            variants, buckets, sweep_plan.configs, h=sweep_plan.heads, p=sweep_plan.padded_heads,
            compress_ratio=sweep_plan.compress_ratio, jobs=args.jobs, replays=args.replays,
            numerics=args.numerics,
        )  # fmt: skip
        sweeps.append(sweep)
        made = tune.entries(
            sweep, variants, buckets, env, sweep_plan.heads, sweep_plan.padded_heads, provenance=origin,
            compress_ratio=sweep_plan.compress_ratio,
        )  # fmt: skip
        new += made
        default_us += [
            sweep.timings.get(
                (e["variant"], e["bucket"], tune.for_preset(e["variant"], [default], args.numerics)[0].key),
                float("inf"),
            )
            for e in made
        ]
    db_path = Path(args.db) if args.db else tuning.database_path()
    tuning.TuningDatabase.merge_into(db_path, new)
    print(f"\n{'variant':44} {'T':>6} {'best config':>16} {'us':>9} {'default us':>10} {'gain':>6}")
    for e, d in zip(new, default_us):
        print(
            f"{e['variant']:44} {e['bucket']:6d} {e['config']:>16} {e['us']:9.2f} {d:10.2f} {d / e['us']:5.2f}x"
        )
    for sweep in sweeps:
        for v, key, b, err in sweep.failures:
            print(f"FAILED {v} {key} T={b}: {err}")
    print(f"\ntune: {sum(s.seconds for s in sweeps):.1f}s, {len(new)} entries merged into {db_path}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(tune.document(sweeps, env, default, origin, followed), indent=1)
        )
    if args.plot_dir:
        for sweep_plan, sweep in zip(plan, sweeps):
            # a variant is in one sweep per (H, P, compress ratio): several under --like
            tag = (
                ""
                if len(plan) == 1
                else f"_h{sweep_plan.heads}_p{sweep_plan.padded_heads}_r{sweep_plan.compress_ratio}"
            )
            for v in sweep_plan.configs:
                plots.tune_plot(
                    sweep, v, list(sweep_plan.buckets), sweep_plan.heads, sweep_plan.padded_heads,
                    Path(args.plot_dir) / f"tune_{v}{tag}.png",
                )  # fmt: skip
    return 0


# what `tune --like` takes from the source database instead of the command line
_LIKE_TAKES = ("buckets", "max_tokens", "space", "configs", "heads", "padded_heads", "compress_ratio")


def _like_source(args) -> list[dict]:
    """`tune --like DB`: DB's entries, once the options it replaces were checked to be unset."""
    given = [f"--{k.replace('_', '-')}" for k in _LIKE_TAKES if getattr(args, k) != args.parser_defaults[k]]
    if given:
        raise InputError(f"tune --like takes {', '.join(given)} from its database: give them without --like")
    if not Path(args.like).is_file():
        raise InputError(f"tune --like {args.like}: no such file")
    return tuning.TuningDatabase.load(Path(args.like)).entries


def run_simulate(args) -> int:
    """One simulated rank; or, with --tp/--dp/--spawn or under torchrun, a run across ranks."""
    across = args.tp is not None or args.dp is not None or args.spawn or simulate.torchrun_env() is not None
    tp, dp = (1 if n is None else n for n in (args.tp, args.dp))
    if across and args.heads is not None:
        raise InputError(
            "--heads is the one simulated rank's head count; across ranks, --query-heads is sharded over --tp"
        )
    if across:
        heads = args.query_heads // max(tp, 1)  # tp <= 0 is refused by check_options
    else:
        heads = 16 if args.heads is None else args.heads
    opts = simulate.SimOptions(
        max_num_batched_tokens=args.max_num_batched_tokens,
        padded_heads=args.padded_heads,
        heads=heads,
        layers=args.layers,
        block_size=args.block_size,
        micro_batches=args.micro_batches,
        kv_fraction=args.kv_fraction,
        memory_budget_bytes=None if args.memory_budget_gb is None else int(args.memory_budget_gb * 1e9),
        seqs=args.seqs,
        prompt_len=args.prompt_len,
        decode_steps=args.decode_steps,
        needles=args.needles,
        allocating=args.allocating,
        seed=args.seed,
        json_path=args.json,
        device=None if args.device == "cuda" else args.device,
        tp=tp,
        dp=dp,
        query_heads=args.query_heads if across else None,
        backend=args.backend,
        timeout_s=args.timeout_s,
    )
    if not across:
        results = simulate.run(opts)
    elif args.spawn:
        results = simulate.run_spawned(opts)
    elif simulate.torchrun_env() is not None:
        results = simulate.run_torchrun(opts)
    elif tp * dp == 1:
        results = simulate.run_in_process(opts)
    else:
        raise InputError(
            f"--tp {tp} --dp {dp} needs {tp * dp} processes: add --spawn to start them here, or start them with "
            f"torchrun --nproc-per-node {tp * dp} -m attn_prologue simulate ..."
        )
    return 0 if results["passed"] else 1
