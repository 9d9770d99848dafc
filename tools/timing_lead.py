"""How much of a timed interval was the host's launch of the replay: a few bench shapes, the op and
the copy of its bytes, timed with the lab's method (timing.graph_time_us: replays queued behind
spins) and with its method before (lead=False: each replay launched after the last one finished),
round-robin, on one GPU in one process.

  python tools/timing_lead.py [--rounds 3] [--replays 20] [--busy 8] [--json out.json]

--busy N runs N CPU-bound processes beside the timing, as `tune` does with its compile workers, so
the lead's effect on a busy host shows too (default: 0, an idle host).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys

# (label, bench.Shape fields): decode sizes, where the launch is a large part of a call, the small
# compressed calls that the tuner mis-timed on a busy host, and a prefill size, where it is not
SHAPES = [
    ("qkv fp8_ds_mla T=1", dict(n=1, h=64, p=64)),
    ("qkv fp8_ds_mla T=64", dict(n=64, h=64, p=64)),
    ("kv nvfp4_v41 T=1", dict(n=1, op="kv", cache_format="nvfp4_v41")),
    ("kv nvfp4_v41 T=64", dict(n=64, op="kv", cache_format="nvfp4_v41")),
    (
        "kv_norm mxfp4 T=2048 r=4",
        dict(n=2048, op="kv_norm", head_dim=128, cache_format="mxfp4", compress_ratio=4),
    ),
    ("kv fp8_ds_mla T=8192 r=4", dict(n=8192, op="kv", compress_ratio=4)),
    ("qkv fp8_ds_mla T=8192", dict(n=8192, h=64, p=64)),
]


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="time every case this many times, round-robin")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside the timing")
    ap.add_argument("--json")
    a = ap.parse_args()
    from attn_prologue.lab.provenance import provenance

    origin = provenance()
    sys.argv = sys.argv[:1]  # a module imported below parses sys.argv at import time
    from attn_prologue.lab import bench, timing

    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    busy = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(a.busy)]
    cases = {}
    for label, fields in SHAPES:
        shape = bench.Shape(**{"head_dim": 512, "cache_format": "fp8_ds_mla", **fields})
        nsets = bench.sets_for_cold_l2(shape)
        sets = bench.input_sets(shape, nsets)
        cases[label] = (
            max(nsets, 20),
            bench.op_fns(shape, sets),
            timing.copy_fns(shape.min_bytes(), nsets, "sm1"),
        )
    for p in busy:
        p.start()
    methods = (False, True)  # lead
    rows = {(label, what, lead): [] for label in cases for what in ("op", "copy") for lead in methods}
    try:
        for _ in range(a.rounds):
            for label, (calls, op, copy) in cases.items():
                for lead in methods:
                    for what, fns in (("op", op), ("copy", copy)):
                        t = timing.graph_time_us(fns, replays=a.replays, calls_per_graph=calls, lead=lead)
                        rows[(label, what, lead)].append(t["median_us"])
    finally:
        stop.set()
    out = {
        "provenance": origin,
        "lead_cycles": timing.LEAD_CYCLES,
        "busy": a.busy,
        "rounds": a.rounds,
        "shapes": [],
    }
    print(f"{'shape':28} {'op us':>8} {'lead':>8} {'copy us':>8} {'lead':>8} {'op/copy':>8} {'lead':>8}")
    for label in cases:
        med = {(w, c): statistics.median(rows[(label, w, c)]) for w in ("op", "copy") for c in methods}
        out["shapes"].append(
            {
                "shape": label,
                "op_us": med[("op", False)],
                "op_us_lead": med[("op", True)],
                "copy_us": med[("copy", False)],
                "copy_us_lead": med[("copy", True)],
                "per_round": {
                    f"{w}_{'lead' if c else 'no_lead'}": rows[(label, w, c)]
                    for w in ("op", "copy")
                    for c in methods
                },
            }
        )
        r0, r1 = med[("op", False)] / med[("copy", False)], med[("op", True)] / med[("copy", True)]
        print(
            f"{label:28} {med[('op', False)]:8.3f} {med[('op', True)]:8.3f} {med[('copy', False)]:8.3f} "
            f"{med[('copy', True)]:8.3f} {r0:8.3f} {r1:8.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
