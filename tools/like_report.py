"""How another GPU's tuning choices fared on this one: from a `tune --like --json` file (and, for a
file without a `like` record, the database it followed), per shape (module, bucket, heads, heads written, compress ratio) the time of
the source's choice and of the arch default, each over the fastest config timed there.

  python tools/like_report.py results/tune-like-h100.json.gz results/tune-like-h100-source.json.gz --source-gpu "NVIDIA H200"
  python tools/like_report.py NEW_RUN.json   # a run that kept its `like` record

(docs/tuning.md quotes its output for the shipped H100 entries.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from attn_prologue.tuning import entry_shape


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def report(sweep: dict, database: dict | None = None, source_gpu: str | None = None) -> dict:
    """The counts and ratio summaries docs/tuning.md states (each ratio: a time over the fastest).
    The source's choices come from the sweep's `like` record, or, in a file written before --like
    kept one, from `database` (as it was when --like ran) and `source_gpu`."""
    if "like" in sweep:
        database = {"entries": [{**c, "gpu": sweep["like"]["gpu"]} for c in sweep["like"]["choices"]]}
        source_gpu = sweep["like"]["gpu"]
    elif database is None or source_gpu is None:
        raise SystemExit("this sweep has no `like` record: give the database it followed and --source-gpu")
    times: dict = defaultdict(dict)
    for t in sweep["timings"]:
        times[(t["variant"], t["bucket"], t["heads"], t["padded_heads"], t["compress_ratio"])][
            t["config"]
        ] = t["us"]
    chose = {
        (e["variant"], e["bucket"], *entry_shape(e)): e["config"]
        for e in database["entries"]
        if e["gpu"] == source_gpu
    }
    default = sweep["default"]
    source, arch_default, against = [], [], []
    for shape, us in times.items():
        best = min(us.values())
        source.append(us[chose[shape]] / best)
        arch_default.append(us[default] / best)
        against.append(us[chose[shape]] / us[default])

    def summary(ratios: list[float]) -> dict:
        ranked = sorted(ratios)
        return {
            "median": round(statistics.median(ranked), 3),
            "p90": round(ranked[int(0.9 * len(ranked))], 2),
            "geomean": round(math.exp(statistics.fmean(map(math.log, ranked))), 2),
        }

    return {
        "shapes": len(times),
        "source_choice_fastest": sum(r == 1.0 for r in source),
        "source_choice": summary(source),
        "arch_default": summary(arch_default),
        "source_over_default": {
            "geomean": round(math.exp(statistics.fmean(map(math.log, against))), 2),
            "slower": sum(r > 1.0 for r in against),
            "slower_by_5pct": sum(r > 1.05 for r in against),
            "worst": round(max(against), 2),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="a `tune --like --json` file (.json or .json.gz)")
    ap.add_argument(
        "database", type=Path, nargs="?",
        help="for a sweep without a `like` record: the database --like followed, as it was then",
    )  # fmt: skip
    ap.add_argument("--source-gpu", help="with the database: whose entries --like followed")
    a = ap.parse_args()
    database = _load(a.database) if a.database else None
    print(json.dumps(report(_load(a.sweep), database, a.source_gpu), indent=1))


if __name__ == "__main__":
    main()
