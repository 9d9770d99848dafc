"""`tune`: sweep launch configs of variants over token-count buckets on the present GPU.

Configs are enumerated from the template's knobs, pruned (duplicates, configs that cannot differ
from a smaller one at a bucket are still timed: the pruning here is validity and identity), compiled
in parallel worker processes while the main process times the ones already built, each timed under
CUDA-graph replay with cold L2 (timing.graph_time_us over rotated input sets). A failure scores
infinity and is reported. The best config per (variant, bucket) goes into the tuning database.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import dispatch, tuning
from ..index_q import numerics_bits
from ..jit.kernel_cache import KernelCache, KernelKey
from ..launch import LaunchConfig, all_configs
from ..variants import Op, QOut, parse_name
from . import bench, bench_index_q
from .timing import graph_time_us

# The default sweep: the knobs that won somewhere on the H200. Persistent grids never did (--space
# full has them); register caps (min_ctas_per_sm) only pay for 4- and 8-warp CTAs of one pass, at 48
# resident warps; KV spread only with them, when Q has few heads (results/README.md, ab7). lean_quant
# won 25 of the writers' 32 entries (results/tune-writers-h200.json.gz). The cos/sin rows late
# (cos_sin_late) only where large calls won: 4-warp CTAs of one pass, and the writers' lean configs.
DEFAULT_SPACE = (
    [
        LaunchConfig(w, u, pdl, nc, streaming=cs)
        for w in (2, 4, 8, 16)
        for u in (1, 2)
        for pdl in (True, False)
        for nc in (True, False)
        for cs in (True, False)
    ]
    + [
        LaunchConfig(w, 1, pdl, nc, streaming=True, min_ctas_per_sm=48 // w, spread_kv=spread)
        for spread in (False, True)
        for w in (4, 8)
        for pdl in (True, False)
        for nc in (True, False)
    ]
    + [  # the leaner exact quantization arithmetic (same bytes), on the configs that won most often
        LaunchConfig(w, u, True, True, streaming=True, lean_quant=True) for w in (2, 4, 8, 16) for u in (1, 2)
    ]
    + [  # and compiled for the format defaults only (calls with parity choices: Runtime.serving_config)
        LaunchConfig(w, 1, True, True, streaming=True, lean_quant=True, defaults_only=True)
        for w in (2, 4, 8, 16)
    ]
    + [  # the same without the streaming hint: the compressed writers' scan kernel won by 1.1-1.5x
        # (results/experiments/tune-comp-r4-h200-f876c85.json.gz), and with two passes the qkv op at
        # T = 8192: 263.4 against 267.2 us (results/experiments/tune-qkv-8192-ab-h200-3305275.json)
        LaunchConfig(w, u, True, True, lean_quant=True, defaults_only=True)
        for w in (1, 2, 4, 8, 16)
        for u in (1, 2)
    ]
    + [  # a KV row over 2 warps (plain KV writers of D = 512 only: Variant.row_splits), for decode sizes
        LaunchConfig(w, u, True, True, streaming=True, lean_quant=True, defaults_only=True, row_split=2)
        for w in (2, 4, 8, 16)
        for u in (1, 2)
    ]
    + [  # the cos/sin rows after the PDL wait, for large calls, on the large calls' winners
        LaunchConfig(4, 1, pdl, nc, streaming=True, min_ctas_per_sm=m, lean_quant=lean, cos_sin_late=True)
        for pdl in (True, False)
        for nc in (True, False)
        for m in (0, 12)
        for lean in (False, True)
    ]
    + [
        LaunchConfig(w, 1, True, True, streaming=True, lean_quant=True, defaults_only=True, cos_sin_late=True)
        for w in (2, 8, 16)
    ]
    + [  # Q rows on 16 lanes (modules with Q rows only: Variant.q_lanes): interleaved Q at T = 8192 on
        # w2_u2_pdl1_nc1_lq_d_q16 in 258.4 us against 265.3 staged on 32 lanes
        # (results/experiments/tune-q-lanes-h200-6c12705.json)
        LaunchConfig(w, u, True, True, streaming=cs, lean_quant=True, defaults_only=True, q_lanes=16)
        for w in (2, 4)
        for u in (1, 2)
        for cs in (False, True)
    ]
)

# index_q's knobs (templates/index_q.py.jinja): warps, passes, PDL, the non-coherent and streaming loads, lanes a row
# (no KV rows to spread, no quantization choice to lean, no cos/sin rows to load late)
INDEX_Q_SPACE = [
    LaunchConfig(w, u, pdl, nc, streaming=cs, q_lanes=lanes)
    for w in (2, 4, 8, 16)
    for u in (1, 2, 4)
    for pdl in (True, False)
    for nc in (True, False)
    for cs in (True, False)
    for lanes in (0, 4)  # a row on the module's 8 lanes or on 4
]


def space_for(variant: str, space: str = "default") -> list[LaunchConfig]:
    """The configs `tune` sweeps for `variant` by default (`space`: "default" or "full")."""
    if parse_name(variant).op is Op.INDEX_Q:
        return list(INDEX_Q_SPACE)
    return all_configs() if space == "full" else list(DEFAULT_SPACE)


def module_timed(variant: str, config: LaunchConfig) -> LaunchConfig:
    """The module a timing of `config` runs: an index_q call runs its config folded to its bits (the tuner
    times the defaults', vLLM's); the entry keeps `config`, which serving folds to each call's bits."""
    if parse_name(variant).op is Op.INDEX_Q:
        return config.folded_to(numerics_bits(None), parse_name(variant).default_numerics)
    return config


def for_preset(variant: str, configs: list[LaunchConfig], preset: str | None) -> list[LaunchConfig]:
    """`tune --numerics PRESET`: index_q's configs folded to the preset's bits, so that the tuner times that
    preset's modules and its entries serve exactly that preset's calls (tuning.entry_numerics). The
    defaults' bits (or no preset) leave them unfolded: those entries serve every call."""
    v = parse_name(variant)
    if preset is None:
        return list(configs)
    if v.op is not Op.INDEX_Q:
        raise ValueError(f"{variant}: only index_q's calls are tuned per numerics preset")
    bits = numerics_bits(preset, v.io_dtype.value, v.cache_format)
    if bits == v.default_numerics:
        return list(configs)
    return [c.folded_to(bits, v.default_numerics) for c in configs]


def prune(configs: list[LaunchConfig]) -> list[LaunchConfig]:
    """Drop invalid and duplicate configs (by key), keeping order."""
    seen, out = set(), []
    for c in configs:
        if c.key in seen or c.warps_per_cta * 32 > 1024:
            continue
        seen.add(c.key)
        out.append(c)
    return out


def shape_for(
    variant: str, n: int, h: int, p: int, block_size: int = 64, compress_ratio: int = 1
) -> bench.Shape:
    """The bench shape whose calls run `variant` (on a device of its arch family); a variant no call
    reaches that way (a `_portable` twin where the arch converts natively) is a ValueError, not a
    timing of another module."""
    v = parse_name(variant)
    shape = bench.Shape(
        n=n, h=h, p=p, head_dim=v.head_dim, rope_dim=v.rope_dim, cache_format=v.cache_format,
        block_size=block_size, op=v.op.value, dtype=v.io_dtype.value, q_fp8=v.q_out is QOut.FP8,
        q_layout=v.q_layout.value, compress_ratio=compress_ratio,
    )  # fmt: skip
    reached = shape.request.variant(v.arch).name
    if reached != variant:
        raise ValueError(f"the tuner's calls for {variant} would run {reached}: it cannot time {variant}")
    return shape


def _compile_job(cache_root: str, variant: str, config_key: str, target: str) -> tuple[str, str, str | None]:
    try:
        meta = KernelCache(cache_root).ensure_built(
            KernelKey(variant, LaunchConfig.from_key(config_key), target)
        )
    except Exception as exc:  # reported, scored as infinity
        return variant, config_key, f"{type(exc).__name__}: {exc}"
    res = meta["resources"]
    if res["frame_bytes"] or res["min_stack_bytes"] or res["local_sections"] or meta["ptx"]["local_memory"]:
        return (
            variant,
            config_key,
            f"pruned: spills to local memory ({res['frame_bytes']} B frame, {res['registers']} registers)",
        )
    return variant, config_key, None


@dataclass
class Sweep:
    timings: dict = field(default_factory=dict)  # (variant, bucket, config key) -> us (inf on failure)
    failures: list = field(default_factory=list)
    seconds: float = 0.0
    shape: dict = field(default_factory=dict)  # the heads, heads written and compress ratio it timed

    def best(self, variant: str, bucket: int) -> tuple[str, float]:
        cands = [(us, key) for (v, b, key), us in self.timings.items() if v == variant and b == bucket]
        us, key = min(cands)
        return key, us


def run(
    variants: list[str],
    buckets: list[int],
    configs: list[LaunchConfig] | dict[str, list[LaunchConfig]],
    *,
    h: int = 64,
    p: int = 64,
    compress_ratio: int = 1,
    jobs: int | None = None,
    replays: int = 15,
    numerics: str | None = None,
    cache=None,
    log: Callable[[str], None] = print,
) -> Sweep:
    """Time every (variant, config, bucket); configs given per variant (a dict) time each variant over
    its own. compress_ratio > 1 times the variants' compressed calls (KV-only modules of a format that
    takes that ratio); `numerics` (index_q: a preset, with configs for_preset) times calls with its bits."""
    cache = cache or dispatch.default_runtime().cache
    target = dispatch.default_runtime().device().target
    configs_of = configs if isinstance(configs, dict) else dict.fromkeys(variants, configs)
    sweep = Sweep(shape={"heads": h, "padded_heads": p, "compress_ratio": compress_ratio})
    t0 = time.perf_counter()
    work = [(v, c) for v in variants for c in prune(configs_of[v]) if not parse_name(v).refusal(c)]
    total = len(work) * len(buckets)
    done = 0
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(
        max_workers=jobs or max(1, min(8, (multiprocessing.cpu_count() or 2) - 1)), mp_context=ctx
    ) as pool:
        futures = {
            pool.submit(_compile_job, str(cache.root), v, module_timed(v, c).key, target): c for v, c in work
        }
        for fut in cf.as_completed(futures):
            variant, _, err = fut.result()
            config = futures[fut]
            key = config.key
            for b in buckets:
                us = math.inf
                if err is None:
                    try:
                        us = time_config(
                            variant, config, b, h=h, p=p, replays=replays, compress_ratio=compress_ratio,
                            numerics=numerics,
                        )  # fmt: skip
                    except Exception as exc:
                        err = f"{type(exc).__name__}: {exc}"
                if err is not None:
                    sweep.failures.append((variant, key, b, err))
                sweep.timings[(variant, b, key)] = us
                done += 1
            elapsed = time.perf_counter() - t0
            eta = elapsed / done * (total - done)
            log(
                f"[{done}/{total}] {variant} {key}: "
                + ("FAILED " + err if err else "ok")
                + f"  elapsed {elapsed:.0f}s, ETA {eta:.0f}s"
            )
    sweep.seconds = time.perf_counter() - t0
    return sweep


def time_config(
    variant: str,
    config: LaunchConfig,
    n: int,
    *,
    h: int,
    p: int,
    replays: int,
    compress_ratio: int = 1,
    numerics: str | None = None,
) -> float:
    v = parse_name(variant)
    if v.op is Op.INDEX_Q:
        return bench_index_q.time_config(
            v.cache_format, v.io_dtype.torch_dtype, config, n, h, replays, numerics
        )
    shape = shape_for(variant, n, h, p, compress_ratio=compress_ratio)
    nsets = bench.sets_for_cold_l2(shape)
    sets = bench.input_sets(shape, nsets)
    # fewer replays for long calls: ~30 ms of GPU time per measurement is plenty
    est_us = max(2.0, shape.min_bytes() / 4e6)
    calls = max(nsets, min(20, int(3000 / est_us) + 1))
    reps = max(3, min(replays, int(30000 / (est_us * calls)) + 1))
    return graph_time_us(bench.op_fns(shape, sets, config=config), replays=reps, calls_per_graph=calls)[
        "median_us"
    ]


# what each database entry keeps of the run's provenance (the GPU and versions are its key fields)
ENTRY_PROVENANCE = ("date", "git_commit", "git_dirty", "command")


def entries(
    sweep: Sweep,
    variants: list[str],
    buckets: list[int],
    env,
    h: int,
    p: int,
    *,
    provenance: dict,
    compress_ratio: int = 1,
) -> list[dict]:
    """The tuning-database entries: the fastest config per (variant, bucket), failures left out; an
    entry timed at a compress ratio > 1 says so (`compress_ratio`), one at 1 leaves it out."""
    origin = {k: provenance[k] for k in ENTRY_PROVENANCE}
    out = []
    for v in variants:
        for b in buckets:
            key, us = sweep.best(v, b)
            if math.isinf(us):
                continue
            out.append(
                {
                    **env.as_dict(),
                    "variant": v,
                    "bucket": b,
                    "config": key,
                    "us": round(us, 3),
                    "heads": h,
                    "padded_heads": p,
                    **({"compress_ratio": compress_ratio} if compress_ratio != 1 else {}),
                    "provenance": origin,
                }
            )
    return out


def document(
    sweeps: Sweep | list[Sweep], env, default: LaunchConfig, provenance: dict, followed: dict | None = None
) -> dict:
    """What `tune --json` writes: every timing (inf for a failure) with the heads, heads written and
    compress ratio it was timed at, and the failures' reasons; under `--like`, `followed` (`like_record`:
    the source's choices, so that the file alone says how they fared)."""
    sweeps = [sweeps] if isinstance(sweeps, Sweep) else sweeps
    return {
        **({"like": followed} if followed is not None else {}),
        "provenance": provenance,
        "seconds": sum(s.seconds for s in sweeps),
        "env": env.as_dict(),
        "default": default.key,
        "timings": [
            {"variant": v, "bucket": b, "config": k, "us": us, **s.shape}
            for s in sweeps
            for (v, b, k), us in sorted(s.timings.items())
        ],
        "failures": [f for s in sweeps for f in s.failures],
    }


def like_record(database: str, entries: list[dict]) -> dict:
    """The `like` object of a `tune --like --json` file: the database followed, its GPU and the
    (variant, bucket, heads, heads written, compress ratio) -> config choices followed."""
    return {
        "database": database,
        "gpu": entries[0]["gpu"],
        "choices": [
            dict(zip(("heads", "padded_heads", "compress_ratio"), tuning.entry_shape(e)),
                 variant=e["variant"], bucket=e["bucket"], config=e["config"])
            for e in sorted(entries, key=lambda e: (e["variant"], tuning.entry_shape(e), e["bucket"]))
        ],
    }  # fmt: skip


@dataclass(frozen=True)
class SweepPlan:
    """One sweep: the head counts, compress ratio and buckets it times, and each variant's configs."""

    heads: int
    padded_heads: int
    compress_ratio: int
    buckets: tuple[int, ...]
    configs: dict  # variant -> its configs


def like_followed(source: list[dict], names: list[str], gpu: str | None = None) -> list[dict]:
    """The source entries `tune --like` follows: those of `names` on one GPU. Entries of several GPUs
    need `gpu` to say which one (a ValueError names them); no entry for `names` is a ValueError too."""
    mine = [e for e in source if e["variant"] in names]
    gpus = sorted({e["gpu"] for e in mine})
    if gpu is not None:
        mine = [e for e in mine if e["gpu"] == gpu]
    elif len(gpus) > 1:
        raise ValueError(
            f"the source database has entries of {len(gpus)} GPUs for these variants: name one of {gpus}"
        )
    if not mine:
        raise ValueError(
            f"the source database has no entry for these variants{f' on {gpu}' if gpu else ''} (it has {gpus})"
        )
    return mine


def like_groups(followed: list[dict], default: LaunchConfig) -> list[SweepPlan]:
    """The sweeps that re-time here what another GPU's tuning chose: for each (heads, heads written,
    compress ratio, buckets) of the `followed` entries (`like_followed`), each variant over the configs
    chosen for it at that shape plus `default`."""
    shapes: dict = {}  # (heads, written, ratio, variant) -> (buckets, configs in first-seen order)
    for e in sorted(followed, key=lambda e: e["bucket"]):
        key = (*tuning.entry_shape(e), e["variant"])
        buckets, configs = shapes.setdefault(key, (set(), {}))
        buckets.add(e["bucket"])
        configs[LaunchConfig.from_key(e["config"])] = None
    groups: dict = {}
    for (h, p, r, v), (buckets, configs) in sorted(shapes.items()):
        group = groups.setdefault((h, p, r, tuple(sorted(buckets))), {})
        group[v] = prune([*configs, default])
    return [SweepPlan(h, p, r, b, configs) for (h, p, r, b), configs in groups.items()]
