"""`bench --shapes index_q`: the indexer's Q prologue against a copy of its bytes, in one run per size
(issue targets: >= 0.95 of the copy at T >= 2048, within 1.15x of it at T <= 64; H = 64, D = 128)."""

from __future__ import annotations

import functools
import json

import torch

from .. import index_q_ops
from .bench import sets_for_bytes
from .provenance import provenance
from .timing import copy_time_us, graph_time_us, l2_bytes

TOKENS = (1, 64, 2048, 8192, 32768)
HEADS, D, R, MAX_POS = 64, 128, 64, 8192
TARGET_LARGE, TARGET_SMALL = 0.95, 1 / 1.15  # copy time / op time


def min_bytes(t: int, fmt: str, h: int = HEADS) -> int:
    """What a call must move: q and weights in; codes, scales and weights_out (float32) out; per token its
    position and its cos/sin row."""
    codes = h * (D // 2 + D // 32) if fmt == "mxfp4" else h * D
    return t * (h * D * 2 + h * 2 + codes + h * 4 + 8 + R * 4)


PRESETS = (
    "vllm",
    "sglang",
    "tokenspeed",
)  # (the engines' default kernels; sglang and tokenspeed add the transform)


def input_sets(
    t: int, fmt: str, sets: int, numerics: str = "vllm", heads: int = HEADS, dtype=torch.bfloat16
) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1234)
    theta = torch.rand(MAX_POS, R // 2, device="cuda", generator=g) * 6.28
    cos_sin = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    out = []
    for _ in range(sets):
        mx = fmt == "mxfp4"
        out.append(dict(
            q=torch.randn(t, heads, D, device="cuda", generator=g).to(dtype),
            positions=torch.randint(0, MAX_POS, (t,), device="cuda", generator=g),
            cos_sin_cache=cos_sin,
            weights=torch.randn(t, heads, device="cuda", generator=g).to(dtype),
            softmax_scale=D**-0.5, head_scale=heads**-0.5,
            q_out=torch.empty(t, heads, D // 2 if mx else D, dtype=torch.uint8, device="cuda"),
            weights_out=torch.empty(t, heads, device="cuda"),
            q_scales=torch.empty(t, heads, D // 32, dtype=torch.uint8, device="cuda") if mx else None,
            fmt=fmt, numerics=numerics,
        ))  # fmt: skip
    return out


def run_one(t: int, fmt: str, replays: int, numerics: str = "vllm") -> dict:
    nbytes = min_bytes(t, fmt)
    nsets = sets_for_bytes(nbytes)
    sets = input_sets(t, fmt, nsets, numerics)
    calls = max(nsets, 20)
    fns = [functools.partial(index_q_ops.index_q_rope_quant, **s) for s in sets]
    op = graph_time_us(fns, replays=replays, calls_per_graph=calls)
    copy = copy_time_us(nbytes, nsets, replays, calls)
    ratio = copy["median_us"] / op["median_us"]
    target = TARGET_LARGE if t >= 2048 else TARGET_SMALL if t <= 64 else None
    return {"tokens": t, "heads": HEADS, "fmt": fmt, "numerics": numerics, "bytes": nbytes, "op": op, "copy": copy,
            "of_copy": ratio, "target": target, "met": None if target is None else ratio >= target}  # fmt: skip


def time_config(
    fmt: str, dtype, config, t: int, heads: int, replays: int, numerics: str | None = None
) -> float:
    """Median microseconds of one call of T = t under `config` with these numerics (a preset; None: the
    defaults', vLLM's), cold L2: the tuner's timing."""
    nbytes = min_bytes(t, fmt, heads)
    nsets = sets_for_bytes(nbytes)
    sets = input_sets(t, fmt, nsets, numerics=numerics, heads=heads, dtype=dtype)
    est_us = max(2.0, nbytes / 4e6)  # ~30 ms of GPU time per measurement, as tune.time_config
    calls = max(nsets, min(20, int(3000 / est_us) + 1))
    reps = max(3, min(replays, int(30000 / (est_us * calls)) + 1))
    fns = [functools.partial(index_q_ops.index_q_rope_quant, **s, config=config) for s in sets]
    return graph_time_us(fns, replays=reps, calls_per_graph=calls)["median_us"]


def run(args) -> int:
    origin = provenance()
    rows = []
    for numerics, fmt in ((n, f) for n in PRESETS for f in ("fp8_token", "mxfp4")):
        for t in TOKENS:
            r = run_one(t, fmt, args.replays, numerics)
            rows.append(r)
            print(f"index_q {numerics} {fmt} T={t} H={HEADS}: {r['op']['median_us']:.2f} us, copy {r['copy']['median_us']:.2f} us,"
                  f" {r['of_copy']:.1%} of copy" + ("" if r["target"] is None else f" (target {r['target']:.0%}:"
                  f" {'met' if r['met'] else 'MISSED'})"), flush=True)  # fmt: skip
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"provenance": origin, "rows": rows, "l2_bytes": l2_bytes()}, f, indent=1)
    met = [r["met"] for r in rows if r["met"] is not None]
    print(f"\nindex_q targets: {sum(met)} of {len(met)} met")
    return 0
