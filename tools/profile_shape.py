"""Where the time of one bench shape goes, on a GPU: ablations timed like `bench` (CUDA-graph
replay, cold L2) and, under Nsight Compute, the kernels' counters.

  python tools/profile_shape.py --n 8192 --h 16 --p 16 [--config KEY] [--json out.json]
  python tools/profile_shape.py --n 8192 --h 64 --p 64 --op-only --config KEY --config KEY2 \
      --copy-kinds sm1,sm,t64_v4_row,t64_v2_row_c8 --rounds 3 --json out.json
  python tools/profile_shape.py --n 8192 --h 64 --p 64 --op-only --q-layouts head_major,interleaved \
      --config KEY --copy-kinds sm1,t64_v4_row,t64_v4_row_qi --rounds 3 --json out.json
  ncu --clock-control none --profile-from-start off --metrics ... python tools/profile_shape.py ... --ncu

Ablations (same inputs, same run): the op; the op with every slot -1 (KV rows loaded, nothing
written to the cache); the KV-only op (kv_rope_insert) on the same rows (--op-only: the op alone);
the copies of the op's bytes, one per copy kind (copy_kernel.CopyKind: the bench's yardsticks and
any other structure, e.g. a kernel's Q pass's, or its stores in the interleaved Q layout: `_qi`) and
cudaMemcpy; with --q-layouts head_major,interleaved, the op in each Q layout; with P > H and pads written, torch's
zero fill of the pad heads alone (write-only bandwidth). --rounds R times every case R times over,
round-robin, and reports each case's median over the rounds (slow drifts of the machine fall on
every case alike). With --ncu, each is launched once between cudaProfilerStart/Stop instead of timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--p", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--format", default="fp8_ds_mla")
    ap.add_argument(
        "--zero-once", action="store_true", help="pad heads are not written (default: written as zeros)"
    )
    ap.add_argument(
        "--config", action="append", help="launch config key(s); default: the dispatcher's choice"
    )
    ap.add_argument(
        "--q-layouts",
        default="head_major",
        help="comma-separated Q layouts the op is timed in (head_major, interleaved), each with every config",
    )
    ap.add_argument("--op-only", action="store_true", help="no slots -1 and KV-only ablations")
    ap.add_argument(
        "--copy-kinds", default="sm,sm1", help="comma-separated SM copy kinds (names or CopyKind keys)"
    )
    ap.add_argument("--rounds", type=int, default=1, help="time every case this many times, round-robin")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--ncu", action="store_true", help="launch each case once inside cudaProfilerStart/Stop")
    ap.add_argument("--json")
    a = ap.parse_args()
    from attn_prologue.lab.provenance import provenance

    origin = provenance()  # before sys.argv is cut
    sys.argv = sys.argv[:1]  # a module imported below parses sys.argv at import time

    import torch
    from attn_prologue.lab import bench
    from attn_prologue.lab.timing import copy_fns, graph_time_us
    from attn_prologue.launch import LaunchConfig
    from attn_prologue.variants import QLayout

    shape = bench.Shape(
        n=a.n, h=a.h, p=a.p, head_dim=a.head_dim, cache_format=a.format, zero_once=a.zero_once
    )
    kv_shape = bench.Shape(n=a.n, h=a.h, p=a.p, head_dim=a.head_dim, cache_format=a.format, op="kv")
    nsets = bench.sets_for_cold_l2(shape)
    sets = bench.input_sets(shape, nsets)
    skip = [dict(s, slot_mapping=torch.full_like(s["slot_mapping"], -1)) for s in sets]
    configs = [LaunchConfig.from_key(k) for k in a.config] if a.config else [None]
    cases = {}
    layouts = [QLayout(x).value for x in a.q_layouts.split(",")]  # (a typo: ValueError, before any timing)
    for cfg in configs:
        tag = cfg.key if cfg else "dispatch"
        for layout in layouts:  # the same inputs: the layout changes only where q_out's bytes go
            named = tag if layout == "head_major" else f"{tag}, {layout}"
            cases[f"op[{named}]"] = bench.op_fns(
                dataclasses.replace(shape, q_layout=layout), sets, config=cfg
            )
        if not a.op_only:
            cases[f"op, slots -1[{tag}]"] = bench.op_fns(shape, skip, config=cfg)
            cases[f"kv only[{tag}]"] = bench.op_fns(kv_shape, sets, config=cfg)
    if (
        a.p > a.h and not a.zero_once
    ):  # the pad heads alone: torch's fill of q_out[:, H:] and of as many contiguous bytes
        cases["pads only: q_out[:, H:].zero_()"] = [lambda s=s: s["q_out"][:, a.h :].zero_() for s in sets]
        flat = [s["q_out"].view(-1)[: a.n * (a.p - a.h) * a.head_dim] for s in sets]
        cases["pads only: contiguous zero_()"] = [lambda f=f: f.zero_() for f in flat]
    kinds = a.copy_kinds.split(",")
    for kind in kinds:  # "copy" is the bench's first yardstick (sm); the others are named by kind
        cases["copy" if kind == "sm" else f"copy[{kind}]"] = copy_fns(shape.min_bytes(), nsets, kind)
    cases["memcpy"] = copy_fns(shape.min_bytes(), nsets, "memcpy")
    if not a.op_only:
        cases["copy kv bytes"] = copy_fns(kv_shape.min_bytes(), nsets, "sm")
    if a.ncu:
        for fns in cases.values():
            fns[0]()  # compile / bind outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for name, fns in cases.items():
            if name != "memcpy":
                fns[1 % len(fns)]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("profiled, in order:", [name for name in cases if name != "memcpy"])
        return
    calls = max(nsets, 20)
    out = {
        "provenance": origin,
        "shape": shape.label,
        "bytes": shape.min_bytes(),
        "kv_bytes": kv_shape.min_bytes(),
        "rounds": a.rounds,
        "us": {},
        "us_per_round": {name: [] for name in cases},
    }
    for _ in range(a.rounds):
        for name, fns in cases.items():
            t = graph_time_us(fns, replays=a.replays, calls_per_graph=calls)["median_us"]
            out["us_per_round"][name].append(t)
    out["us"] = {name: statistics.median(ts) for name, ts in out["us_per_round"].items()}
    for name, us in out["us"].items():
        nbytes = kv_shape.min_bytes() if "kv" in name else shape.min_bytes()
        if name.startswith("pads only"):
            nbytes = a.n * (a.p - a.h) * a.head_dim * 2
        print(f"{name:40} {us:9.2f} us  {nbytes / us / 1e3:8.1f} GB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
