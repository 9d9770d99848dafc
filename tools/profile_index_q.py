"""Why an index_q row is below its copy: Nsight Compute's counters of one launch of each preset and
format at one token count (H = 64), beside the same-bytes SM copies the bench measures against.

    python tools/profile_index_q.py [--tokens 32768] [--ncu ncu] [--json OUT]

The script runs itself under `ncu --clock-control none` (the clocks left as the bench runs them); the
child warms every case up, then launches each once between cudaProfilerStart/Stop, so that the
profiled kernels are exactly the cases, in order. Per kernel it reports the time, the DRAM bytes and
bandwidth, the warp instructions issued, how busy the schedulers' issue slots were, the occupancy and
the stall reasons per issued instruction: a row whose issue slots are near full while DRAM is not is
bound by instruction issue; a row with DRAM near the copy's is bound by memory (docs/index-q.md).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import subprocess
import sys

import torch
from attn_prologue import index_q_ops
from attn_prologue.lab import bench_index_q as b
from attn_prologue.lab.provenance import provenance
from attn_prologue.lab.timing import copy_fns

# always read (names as in Nsight Compute 2023-2025 for sm_90)
CORE_METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__warps_eligible.avg.per_cycle_active",
    "launch__registers_per_thread",
)
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "not_selected", "math_pipe_throttle",
          "lg_throttle", "mio_throttle", "no_instruction", "dispatch_stall", "drain", "barrier")  # fmt: skip
# read when this ncu knows them (the run falls back to the core set if it refuses one)
STALL_METRICS = tuple(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS)


def cases(tokens: int) -> list[dict]:
    out = []
    for fmt in ("fp8_token", "mxfp4"):
        out += [{"kind": "op", "fmt": fmt, "numerics": p, "tokens": tokens} for p in b.PRESETS]
        out += [{"kind": "copy", "copy": k, "fmt": fmt, "tokens": tokens, "bytes": b.min_bytes(tokens, fmt)}
                for k in ("sm", "sm1")]  # fmt: skip
    return out


def child(tokens: int, order_path: str) -> None:
    """Each case once after a warm-up, between cudaProfilerStart and Stop."""
    calls = []
    for c in cases(tokens):
        if c["kind"] == "op":
            s = b.input_sets(tokens, c["fmt"], 1, c["numerics"])[0]
            calls.append(functools.partial(index_q_ops.index_q_rope_quant, **s))
        else:
            calls.append(copy_fns(c["bytes"], 1, c["copy"])[0])
    for call in calls:  # compile, load, first launch: outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(order_path, "w") as f:
        json.dump(cases(tokens), f)


# to seconds or bytes (ncu prints what `--print-units base` calls each metric's base unit: "ns", "nsecond",
# "byte", ...)
SCALE = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0,
         "second": 1.0, "byte": 1.0, "B": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6,
         "Gbyte": 1e9, "GB": 1e9}  # fmt: skip


def number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_raw_csv(text: str) -> list[dict]:
    """ncu --csv --page raw: a header of column names, a row of units, then one row per kernel. Each
    row maps a column to its value as printed, and "units" to each column's unit."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # (ncu's own ==PROF== lines dropped)
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return []
    header, units, body = rows[0], rows[1], rows[2:]
    return [{**{h: number(v) for h, v in zip(header, r)}, "units": dict(zip(header, units))} for r in body]


def in_base_units(raw: dict, metric: str) -> float:
    """A time in seconds or a size in bytes; NaN for a unit this script does not know (never a silent 1)."""
    unit = raw["units"].get(metric, "")
    if unit not in SCALE:
        sys.stderr.write(f"{metric}: unit {unit!r} is not one this script converts\n")
    return raw[metric] * SCALE.get(unit, float("nan"))


def summarize(case: dict, raw: dict) -> dict:
    seconds = in_base_units(raw, "gpu__time_duration.sum")
    dram = in_base_units(raw, "dram__bytes_read.sum") + in_base_units(raw, "dram__bytes_write.sum")
    out = {
        **case,
        "kernel": raw.get("Kernel Name"),
        "us": round(seconds * 1e6, 2),
        "dram_bytes": dram,
        "dram_tb_s": round(dram / seconds / 1e12, 3),
        "dram_pct_of_peak": raw["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
        "warp_instructions": int(raw["smsp__inst_executed.sum"]),
        "issue_slots_busy_pct": raw["smsp__issue_active.avg.pct_of_peak_sustained_active"],
        "occupancy_pct": raw["sm__warps_active.avg.pct_of_peak_sustained_active"],
        "eligible_warps_per_cycle": raw["smsp__warps_eligible.avg.per_cycle_active"],
        "registers": raw["launch__registers_per_thread"],
    }
    stalls = {s: raw[m] for s, m in zip(STALLS, STALL_METRICS) if m in raw}
    if stalls:
        out["stall_cycles_per_issue"] = stalls
    # the metrics asked for as ncu printed them, with their units (ncu's raw page adds ~300 device columns)
    kept = [m for m in CORE_METRICS + STALL_METRICS if m in raw]
    out["raw"] = {**{m: raw[m] for m in kept}, "units": {m: raw["units"][m] for m in kept}}
    return out


def profile(ncu: str, tokens: int) -> tuple[list[dict], list[str]]:
    order = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"profile-index-q-{os.getpid()}.json")
    me = [sys.executable, os.path.abspath(__file__), "--child", "--tokens", str(tokens), "--order", order]
    for metrics in (CORE_METRICS + STALL_METRICS, CORE_METRICS):
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "--print-units", "base", "--metrics", ",".join(metrics), *me]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        rows = parse_raw_csv(run.stdout)
        if run.returncode == 0 and rows:
            with open(order) as f:
                want = json.load(f)
            if len(rows) != len(want):  # kept whole, for reading by hand
                sys.stderr.write(f"ncu profiled {len(rows)} kernels for {len(want)} cases\n")
                return [{"unmatched": True, **r} for r in rows], cmd
            return [summarize(c, r) for c, r in zip(want, rows)], cmd
        sys.stderr.write(
            f"ncu failed ({run.returncode}) with {len(metrics)} metrics:\n{run.stderr[-3000:]}\n"
        )
    raise SystemExit("ncu gave no counters")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--ncu", default="ncu", help="the Nsight Compute command line tool")
    ap.add_argument("--json", help="write the rows here, with the provenance")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.tokens, a.order)
        return 0
    rows, cmd = profile(a.ncu, a.tokens)
    for r in rows:
        if r.get("unmatched"):
            print(r)
            continue
        name = r["numerics"] if r["kind"] == "op" else "copy " + r["copy"]
        print(f"{r['fmt']:>9} {name:<11} {r['us']:8.1f} us  DRAM {r['dram_tb_s']:.2f} TB/s "
              f"({r['dram_pct_of_peak']:.0f}% of peak)  issue {r['issue_slots_busy_pct']:.0f}%  "
              f"{r['warp_instructions']} warp instr  occupancy {r['occupancy_pct']:.0f}%")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"provenance": provenance(), "ncu_command": cmd, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
