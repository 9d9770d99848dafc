"""The qkv op's Q modes (both steps, no Q norm, no Q RoPE, neither) timed round-robin in one process,
on a GPU: each on its own input buffers (as `bench` builds them, one shape after another) and on one
set shared by all four, so a difference by mode is told apart from one by order or buffer placement.

  python tools/time_q_modes.py --n 1 --rounds 6 --json out.json

Writes, per case, the median per call of every round (CUDA-graph replays as in `bench`) and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

MODES = [(True, True), (False, True), (True, False), (False, False)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1, help="tokens")
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument(
        "--rounds", type=int, default=6, help="rounds over every case, order reversed every other one"
    )
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    from attn_prologue.lab.provenance import provenance

    origin = provenance()
    sys.argv = sys.argv[:1]  # a module imported below parses sys.argv at import time
    from attn_prologue.lab import bench
    from attn_prologue.lab.timing import graph_time_us

    full = bench.Shape(n=a.n, cache_format=a.format)
    sets = bench.sets_for_cold_l2(full)  # the bench's input sets and calls per graph (run_shape)
    calls = max(sets, 20)
    shared = bench.input_sets(full, sets)
    fns = {}
    for norm, rope in MODES:
        shape = bench.Shape(n=a.n, cache_format=a.format, apply_q_norm=norm, apply_q_rope=rope)
        label = f"norm={int(norm)} rope={int(rope)}"
        fns[f"own buffers, {label}"] = bench.op_fns(shape, bench.input_sets(shape, sets), checked=False)
        fns[f"shared buffers, {label}"] = bench.op_fns(shape, shared, checked=False)
    rounds = {k: [] for k in fns}
    for r in range(a.rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            rounds[k].append(graph_time_us(fns[k], replays=a.replays, calls_per_graph=calls)["median_us"])
    cases = {k: {"rounds_us": v, "median_us": statistics.median(v)} for k, v in rounds.items()}
    for k, c in cases.items():
        print(
            f"{k:32s} median {c['median_us']:.3f} us  rounds " + " ".join(f"{x:.3f}" for x in c["rounds_us"])
        )
    if a.json:
        out = {"provenance": origin, "n": a.n, "format": a.format, "cases": cases}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
