"""PNG plots (matplotlib, optional extra `plot`): bench GB/s against token count, tuning sweeps."""

from __future__ import annotations

import collections
import math
from pathlib import Path

from .tune import shape_for


def _pyplot():
    # matplotlib is an optional extra and slow to import: only the commands that draw load it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_plot(results, path: str, device: str) -> None:
    """GB/s of the op against token count per shape family, with the copy ceiling of each point."""
    plt = _pyplot()
    series = collections.defaultdict(list)
    for r in results:
        s = r.shape
        key = f"{s['cache_format']} D={s['head_dim']} H={s['h']} P={s['p']}" + (
            " zero-once" if s["zero_once"] else ""
        )
        series[key].append((s["n"], r.gbs, r.copy_gbs))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (key, pts) in enumerate(sorted(series.items())):
        pts.sort()
        color = f"C{i % 10}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=key)
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ":", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call (T)")
    ax.set_ylabel("GB/s (op's minimum bytes / time)")
    ax.set_title(f"attn_prologue on {device} (dotted: device copy of the same bytes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune_plot(sweep, variant: str, buckets: list[int], h: int, p: int, path) -> None:
    """GB/s of every config across buckets for one variant; the best per bucket is marked."""
    plt = _pyplot()
    keys = sorted({k for (v, _, k) in sweep.timings if v == variant})
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, key in enumerate(keys):
        xs, ys = [], []
        for b in buckets:
            us = sweep.timings.get((variant, b, key), math.inf)
            if math.isfinite(us):
                xs.append(b)
                ys.append(shape_for(variant, b, h, p).min_bytes() / us / 1e3)
        ax.plot(xs, ys, "-", lw=1, alpha=0.6, color=f"C{i % 10}", label=key if len(keys) <= 12 else None)
    for b in buckets:
        key, us = sweep.best(variant, b)
        if math.isfinite(us):
            ax.plot([b], [shape_for(variant, b, h, p).min_bytes() / us / 1e3], "k*", ms=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call (T)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"tune {variant} (H={h}, P={p}); * = best per bucket")
    ax.grid(True, which="both", alpha=0.3)
    if len(keys) <= 12:
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
