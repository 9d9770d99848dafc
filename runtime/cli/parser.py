"""The command line's commands and options. Each command names its handler as "module:function",
imported only once the arguments parsed, so `--help` and a mistyped argument import no torch."""

from __future__ import annotations

import argparse

from ..variants import DEFAULT_BUILD_TARGETS, HEAD_DIMS, TARGETS
from . import options as o

CLI = "attn_prologue.cli.commands"
LAB = "attn_prologue.lab.commands"
SHAPE_SETS = (
    "targets",
    "indexer",
    "records",
    "modes",
    "writers",
    "all",
    "quick",
    "baseline",
    "index_q",
)  # lab/shape_sets.default_shapes (index_q: lab/bench_index_q.py)
NOT_WRITTEN = "(default: not written)"
DEFAULT_CACHE = "(default: $ATTN_PROLOGUE_CACHE, else ~/.cache/attn_prologue/kernels)"
CACHE_DIR = f"the kernel cache {DEFAULT_CACHE}"
TARGETS_EPILOG = (
    "exit status: 0 when every target is met, 1 when one is missed, 2 when the file cannot be read "
    "or is not a bench result"
)


def _command(sub, name: str, handler: str, help: str, *, gpu: str | None = None, serving: bool = True, **kw):
    """A subcommand. gpu: what to say when no CUDA GPU is present ("" if no CPU alternative exists);
    serving: the command uses the serving API (the package's torch ops are registered first)."""
    s = sub.add_parser(name, help=help, description=help, formatter_class=o.HelpFormatter, **kw)
    s.set_defaults(handler=handler, gpu=gpu, serving=serving)
    return s


def _variants(s, what: str) -> None:
    s.add_argument("--variants", nargs="*", type=o.variant_pattern, metavar="NAME", help=what)


def build_parser() -> o.Parser:
    p = o.Parser(prog="attn_prologue", description=__doc__.splitlines()[0], formatter_class=o.HelpFormatter)
    p.description = (
        "Generate, build, measure and tune the attn-prologue kernels (`<command> --help` for each)."
    )
    p.add_argument("--version", action=o.VersionAction,
                   help="the package's version and the DSL, tvm-ffi and torch versions installed")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    s = _command(sub, "list", f"{CLI}:cmd_list", "cache formats and their byte layouts (and the variant space)",
                 serving=False)  # fmt: skip
    s.add_argument("--head-dim", type=int, default=512, choices=sorted({d for d, _ in HEAD_DIMS}),
                   help="D at which formats that store any generated D are shown")  # fmt: skip
    s.add_argument("--variants", action="store_true", help="also list every generated variant")
    s.add_argument("--why", action="store_true",
                   help="with --variants: why the other combinations are not generated, one line per reason")  # fmt: skip
    s.add_argument(
        "--verbose", "-v", action="store_true", help="with --why: every combination under its reason"
    )
    s.add_argument(
        "--archs", action="store_true", help="why each arch family's default launch config is what it is"
    )

    s = _command(sub, "generate", f"{CLI}:cmd_generate",
                 "render every variant into generated/ (writes only what changed)", serving=False)  # fmt: skip
    s.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 with a diff if stale"
    )
    s.add_argument("--out", help="output folder (default: the package's generated/)")

    s = _command(sub, "build", f"{CLI}:cmd_build",
                 "compile every variant for every target into the kernel cache (no GPU needed)")  # fmt: skip
    s.add_argument("--cache-dir", help=CACHE_DIR)
    s.add_argument("--jobs", "-j", type=o.count(1), help="parallel compile processes (default: CPU count)")
    s.add_argument("--targets", type=o.targets,
                   help=f"comma-separated compile targets; one GPU type needs only its own, e.g. sm_90a for "
                   f"H100/H200 (default: {','.join(DEFAULT_BUILD_TARGETS)}; also: "
                   f"{','.join(t for t in TARGETS if t not in DEFAULT_BUILD_TARGETS)})")  # fmt: skip
    _variants(s, "variant names or name prefixes (default: all)")
    s.add_argument("--config", type=o.config_keys,
                   help="comma-separated launch config keys, e.g. w4_u1_pdl1_nc1_cs (default: each arch's default "
                   "and the tuned ones)")  # fmt: skip
    s.add_argument("--numerics", action="append", metavar="SPEC", type=o.numerics_spec,
                   help="also compile each defaults_only config folded to these parity choices (e.g. preset=vllm; "
                   "repeatable), for the formats that accept them: calls with exactly those choices then run "
                   "as fast as the defaults (default: none; they read the choices at run time)")  # fmt: skip
    s.add_argument("--report", help=f"write every entry's metadata as JSON here {NOT_WRITTEN}")
    s.add_argument(
        "--verbose", "-v", action="store_true", help="a line per kernel compiled and every command ninja runs"
    )

    s = _command(sub, "bench", f"{LAB}:run_bench",
                 "time the op against a copy of its bytes, torch eager and torch.compile (GPU)", gpu="")  # fmt: skip
    s.add_argument("--shapes", default="targets", choices=SHAPE_SETS,
                   help="which shape set to time (targets: the fp8_ds_mla targets' shapes; records: the V4.1 and "
                   "NVFP4 records'; modes: the op modes V4.1 engines call; writers: every writer alone at T = 1, "
                   "64, 2048 and 8192, the compressed writers and interleaved Q)")  # fmt: skip
    s.add_argument("--also", action="append", type=o.bench_change, metavar="CHANGE",
                   help="also time each shape with this change, right after it: lean_quant, defaults_only or "
                   "row_split=K (the dispatched config with that LaunchConfig knob set), or numerics=SPEC (e.g. numerics=preset=vllm); "
                   "repeatable; a shape the change does not apply to is skipped and counted (default: none)")  # fmt: skip
    s.add_argument(
        "--max-tokens", type=o.count(1), help="skip shapes with more tokens than this (default: none)"
    )
    s.add_argument(
        "--replays", type=o.count(1), default=30, help="CUDA-graph replays per measurement (median taken)"
    )
    s.add_argument(
        "--no-baselines", action="store_true", help="skip torch eager / torch.compile of the reference"
    )
    s.add_argument("--no-checked", action="store_true", help="skip the checked-mode cost measurement")
    s.add_argument("--json", help=f"write results here {NOT_WRITTEN}")
    s.add_argument("--png", help=f"draw GB/s against token count here {NOT_WRITTEN}")

    s = _command(sub, "targets", f"{LAB}:run_targets",
                 "check the performance targets against a bench JSON (no GPU needed)", epilog=TARGETS_EPILOG)  # fmt: skip
    s.add_argument("json", help="a file written by `bench --json` (e.g. results/bench-h200-targets.json)")

    s = _command(sub, "tune", f"{LAB}:run_tune",
                 "sweep launch configs per token-count bucket on this GPU; write the tuning database", gpu="")  # fmt: skip
    _variants(s, "variant names or prefixes (default: every variant of this GPU's arch)")
    s.add_argument("--buckets", type=o.counts(1),
                   help="comma-separated token counts (default: powers of two up to --max-tokens)")  # fmt: skip
    s.add_argument("--max-tokens", type=o.count(1), default=32768, help="largest token-count bucket to tune")
    s.add_argument(
        "--space", default="default", choices=["default", "full"], help="config space to enumerate"
    )
    s.add_argument(
        "--configs", type=o.config_keys, help="comma-separated config keys (default: those of --space)"
    )
    s.add_argument("--heads", type=o.count(1), default=64, help="H: live Q heads the entries are tuned at")
    s.add_argument("--padded-heads", type=o.count(1), default=64, help="P: heads written (pads included)")
    s.add_argument(
        "--compress-ratio", type=o.count(1), default=1,
        help="time the compressed writers' calls at this ratio (KV-only variants of formats that take it); "
        "their entries serve calls of that ratio",
    )  # fmt: skip
    s.add_argument(
        "--like", metavar="DB",
        help="re-time here what DB's entries chose: each variant over the configs chosen for it and the arch "
        "default, at the buckets, heads and compress ratios those entries were tuned at (a new GPU's database "
        "from another's choices; not with the options above) (default: none)",
    )  # fmt: skip
    s.add_argument(
        "--like-gpu", help="the GPU whose entries --like follows, when DB has several (default: its only one)"
    )
    s.add_argument(
        "--numerics", metavar="PRESET",
        help="index_q only: time its calls with this engine preset's numerics (sglang, tokenspeed, ...); the "
        "entries serve that preset's calls (default: the defaults', vLLM's, whose entries serve every call "
        "no preset's entry covers)",
    )  # fmt: skip
    s.add_argument("--jobs", type=o.count(1), help="compile processes (default: CPU count)")
    s.add_argument(
        "--replays", type=o.count(1), default=15, help="CUDA-graph replays per timing (median taken)"
    )
    s.add_argument(
        "--db", help="tuning database to merge into (default: $ATTN_PROLOGUE_TUNING_DB, else the shipped one)"
    )
    s.add_argument(
        "--plot-dir", help="write one PNG per variant: GB/s per config across buckets (default: none)"
    )
    s.add_argument("--json", help=f"write every timing here {NOT_WRITTEN}")
    s.set_defaults(parser_defaults=vars(s.parse_args([])))  # what `tune --like` tells given options by

    _simulate(sub)

    s = _command(sub, "cache", f"{CLI}:cmd_cache",
                 "where the kernel cache is, its size and kernels per target; --clean empties it",
                 serving=False)  # fmt: skip
    s.add_argument("--cache-dir", help=CACHE_DIR)
    s.add_argument("--clean", action="store_true", help="remove every entry, lock and build file in it")

    s = _command(sub, "package-kernels", f"{CLI}:cmd_package_kernels",
                 "build kernels for chosen targets and package them as a wheel")  # fmt: skip
    s.add_argument(
        "--targets",
        type=o.targets,
        required=True,
        help=f"comma-separated compile targets ({','.join(TARGETS)})",
    )
    s.add_argument("--out", default="dist", help="folder for the wheel")
    _variants(s, "variant name prefixes (default: all)")
    s.add_argument("--cache-dir", help=f"the kernel cache to build into and package from {DEFAULT_CACHE}")
    s.add_argument("--jobs", "-j", type=o.count(1), help="parallel compile processes (default: CPU count)")

    s = _command(
        sub,
        "compile-entries",
        f"{CLI}:cmd_compile_entries",
        "(internal: one ninja edge of `build`)",
        serving=False,
    )
    s.add_argument("--cache-dir", help=f"the kernel cache to compile into {DEFAULT_CACHE}")
    s.add_argument("--stamp", help="file to write once every entry is in the cache (default: none)")
    s.add_argument("--verbose", action="store_true", help="a line per kernel compiled")
    s.add_argument("entries", nargs="+", help="variant:target:config triples")
    return p


def _simulate(sub) -> None:
    s = _command(sub, "simulate", f"{LAB}:run_simulate",
                 "play a serving engine (one GPU, or ranks with --tp/--dp): pool, KV cache, chunked prefill + "
                 "decode, needle recall", gpu="`--device cpu` runs the same schedule through the PyTorch reference")  # fmt: skip
    s.add_argument("--max-num-batched-tokens", type=o.count(1), default=32768,
                   help="scheduler token budget per step (pool size)")  # fmt: skip
    s.add_argument("--padded-heads", type=o.count(1), default=64, help="P: heads of the padded Q buffer")
    s.add_argument("--heads", type=o.count(1),
                   help="H: live heads of the one simulated rank (default: 16 = 64 / TP4; not with --tp/--dp)")  # fmt: skip
    s.add_argument("--layers", type=o.count(1), default=43, help="attention layers (DeepSeek-V4-Flash: 43)")
    s.add_argument("--block-size", type=o.count(1), default=64, help="tokens per KV-cache block")
    s.add_argument(
        "--micro-batches", type=o.count(1), default=2, help="scratch buffers (steps alternate between them)"
    )
    s.add_argument(
        "--kv-fraction", type=o.number(0, 1), default=0.90, help="share of the free memory the KV cache takes"
    )
    s.add_argument("--memory-budget-gb", type=o.number(0),
                   help="cap the memory the simulation may use (GB = 1e9 bytes; default: the whole GPU); enforced "
                   "with torch.cuda.set_per_process_memory_fraction")  # fmt: skip
    s.add_argument("--seqs", type=o.count(1), default=8, help="concurrent sequences")
    s.add_argument("--prompt-len", type=o.count(1), default=30000, help="prompt tokens per sequence (+-5%%)")
    s.add_argument(
        "--decode-steps", type=o.count(0), default=32, help="decode steps after the prompts' prefill"
    )
    s.add_argument("--needles", type=o.count(0), default=64,
                   help="(sequence, position, layer) cache entries checked bit-exactly")  # fmt: skip
    s.add_argument("--allocating", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the schedule with the old allocating op (fresh [N, P, D] Q per call) under the "
                   "same budget")  # fmt: skip
    s.add_argument(
        "--seed", type=o.count(0), default=0, help="seed of prompts, inputs and the block allocator"
    )
    s.add_argument("--json", help=f"write the results here {NOT_WRITTEN}")
    s.add_argument("--tp", type=o.count(1),
                   help="tensor-parallel ranks: --query-heads are sharded over them (default: one rank)")  # fmt: skip
    s.add_argument(
        "--dp", type=o.count(1), help="data-parallel groups: the sequences are split over them (default: one)"
    )
    s.add_argument("--query-heads", type=o.count(1), default=64,
                   help="with --tp/--dp: the model's query heads (each rank runs query-heads / tp of them)")  # fmt: skip
    s.add_argument("--spawn", action="store_true",
                   help="start the tp x dp ranks as local processes (otherwise run under torchrun, which sets RANK etc.)")  # fmt: skip
    s.add_argument("--backend", choices=["nccl", "gloo"],
                   help="torch.distributed backend (default: nccl with a GPU per local rank, else gloo: ranks share GPUs)")  # fmt: skip
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda", type=o.device_name,
                   help="cpu: the PyTorch reference on CPU tensors instead of the kernels (no allocating mode)")  # fmt: skip
    s.add_argument(
        "--timeout-s",
        type=o.number(0),
        default=600.0,
        help="how long a rank waits for the others in a collective",
    )
