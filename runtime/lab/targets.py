"""The performance targets as data, checked against a bench result document (`bench --json`, or the
document bench builds before it prints). H200, bf16, D=512, block size 64: fp8_ds_mla (TARGETS), and
the V4.1 / NVFP4 records (FORMAT_TARGETS, the `records` shape set)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .bench import FULL_Q, Shape


@dataclass(frozen=True)
class Target:
    name: str
    bound: float
    side: str  # "min": the measured value must be >= bound; "max": <= bound
    # "kernel": device time, portable across machines with the GPU; "host": depends on the host
    kind: str = field(default="kernel", kw_only=True)

    def met(self, measured: float) -> bool:
        return measured >= self.bound if self.side == "min" else measured <= self.bound


@dataclass(frozen=True)
class ShapeTarget(Target):
    """A target checked on every result whose shape (as a dict) it applies to."""

    metric: str  # "us", "of_copy" or "vs_compile"
    applies: Callable[[dict], bool]


def _main(s: dict) -> bool:
    return (s["head_dim"], s["cache_format"], s["block_size"], s["dtype"], s["op"]) == (
        512,
        "fp8_ds_mla",
        64,
        "bf16",
        "qkv",
    ) and _modes_of(s) == FULL_Q


TARGETS = [
    ShapeTarget(
        "T >= 2048, (64,64) and (16,16): of copy",
        0.95,
        "min",
        "of_copy",
        lambda s: _main(s) and s["n"] >= 2048 and (s["h"], s["p"]) in ((64, 64), (16, 16)),
    ),
    ShapeTarget(
        "T = 512, (64,64): of copy",
        0.85,
        "min",
        "of_copy",
        lambda s: _main(s) and s["n"] == 512 and (s["h"], s["p"]) == (64, 64),
    ),
    ShapeTarget(
        "T in {1, 8}, (64,64) (32,32) (16,16): us per call",
        2.5,
        "max",
        "us",
        lambda s: _main(s) and s["n"] in (1, 8) and s["h"] == s["p"] in (64, 32, 16),
    ),
    ShapeTarget(
        "T = 64, (64,64): us per call",
        4.0,
        "max",
        "us",
        lambda s: _main(s) and s["n"] == 64 and (s["h"], s["p"]) == (64, 64),
    ),
    ShapeTarget("every shape: speedup over torch.compile", 2.0, "min", "vs_compile", lambda s: True),
]


def _is_mode(s: dict) -> bool:
    """A shape of the `modes` set: a Q mode other than the full op, a compressed writer, or a
    KV-only call of the sliding-window caches."""
    return (
        _modes_of(s) != FULL_Q
        or s.get("compress_ratio", 1) != 1
        or (s["op"] == "kv" and s["cache_format"] in ("fp8_ds_mla", "mxfp8"))
    )


def _modes_of(s: dict) -> tuple:
    """A result's modes (.get: documents written before the modes existed have none)."""
    return (s.get("apply_q_norm", True), s.get("apply_q_rope", True), s.get("q_layout", "head_major"))


MODE_TARGETS = [
    ShapeTarget(
        "every mode, T >= 2048: of copy (bytes the mode moves)",
        0.95,
        "min",
        "of_copy",
        lambda s: _is_mode(s) and s["n"] >= 2048,
    ),
    ShapeTarget(
        "KV-only and compressed writers, T = 1: us per call",
        1.6,
        "max",
        "us",
        lambda s: _is_mode(s) and s["op"] in ("kv", "kv_norm") and s["n"] == 1,
    ),
]
# pairs at the same shape: a skipped Q step is never slower; the interleaved layout within 3%
NO_SLOWER = Target("Q step skipped vs the full op: time ratio", 1.02, "max")  # 2%: replay-median noise
INTERLEAVED_COST = Target("interleaved vs head-major Q, T >= 2048: time ratio", 1.03, "max")


def _record(s: dict, op: str) -> bool:
    return (
        (s["head_dim"], s["block_size"], s["dtype"], s["op"]) == (512, 64, "bf16", op)
        and s["cache_format"] in RECORDS[op]
        and not _is_mode(s)
    )


RECORDS = {"qkv": ("nvfp4_dsv4",), "kv": ("nvfp4_dsv4", "nvfp4_v41", "mxfp8")}
FORMAT_TARGETS = [
    ShapeTarget(
        "V4.1/NVFP4 records, T >= 2048 (qkv: 64 heads): of copy",
        0.95,
        "min",
        "of_copy",
        lambda s: (_record(s, "qkv") and (s["h"], s["p"]) == (64, 64) or _record(s, "kv")) and s["n"] >= 2048,
    ),
    ShapeTarget(
        "V4.1/NVFP4 records, qkv T = 1: us per call",
        2.0,
        "max",
        "us",
        lambda s: _record(s, "qkv") and s["n"] == 1,
    ),
    ShapeTarget(
        "V4.1/NVFP4 records, kv-only T = 1: us per call",
        1.6,
        "max",
        "us",
        lambda s: _record(s, "kv") and s["n"] == 1,
    ),
]
# one measurement from a pair of results (same T), and one from the run's host-overhead metadata
ZERO_ONCE_SPEEDUP = Target("(8,64) zero-once vs write-pads: speedup", 3.0, "min")
# absolute host time moves 1.5-2x between machines with the same GPU: a host-dependent target
# Eager host time per T = 1 call as a ratio to torch's `x.add_(1)` in the same process (tools/host_ratio.py):
# the torch op as cheap as a C++ op, the Python entry points cheaper than one.
EAGER_TARGETS = {
    "torch op": 1.0, "one-call function": 0.8, "bound op": 0.6,
    "torch kv op": 1.0, "one-call kv function": 0.8, "bound kv op": 0.6,
}  # fmt: skip
HOST_OVERHEAD_US = Target("eager host overhead, T=1: us", 8.0, "max", kind="host")


def _measures(r: dict) -> dict:
    out = {"us": r["op"]["median_us"], "of_copy": r["copy"]["median_us"] / r["op"]["median_us"]}
    if r.get("compiled"):
        out["vs_compile"] = r["compiled"]["median_us"] / r["op"]["median_us"]
    return out


def _row(target: Target, shape: str, measured: float) -> dict:
    return {
        "target": target.name,
        "shape": shape,
        "measured": measured,
        "bound": target.bound,
        "side": target.side,
        "met": target.met(measured),
        "kind": target.kind,
    }


def check_file(path: Path) -> list[dict]:
    """check_targets on a result file; InputError (one line) for a file that cannot be read, is not
    JSON, or is not a bench result document."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not JSON ({exc}); give a file written by `bench --json`") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise InputError(
            f"{path} is JSON but not a bench result (no `results` list); give a file written by `bench --json`"
        )
    try:
        return check_targets(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path} is not a bench result this version reads (at {exc!r})") from None


FORCED_KNOBS = ("lean_quant", "defaults_only", "row_split")  # bench.Shape fields of `bench --also`


def check_targets(data: dict) -> list[dict]:
    """One row per (target, shape) plus the zero-once and host-overhead targets, each with met: bool."""
    rows = []
    # a shape timed with a launch knob forced (`bench --also lean_quant`, ...) is an A/B row, not a call
    # as the dispatcher makes it: the targets are of the latter
    results = [r for r in data["results"] if not any(r["shape"].get(k) for k in FORCED_KNOBS)]
    for target in TARGETS + FORMAT_TARGETS + MODE_TARGETS:
        for r in results:
            m = _measures(r).get(target.metric)
            if target.applies(r["shape"]) and m is not None:
                rows.append(_row(target, Shape(**r["shape"]).label, m))
    pads = {
        (r["shape"]["n"], r["shape"]["zero_once"]): r
        for r in results
        if _main(r["shape"]) and (r["shape"]["h"], r["shape"]["p"]) == (8, 64)
    }
    for n in sorted({n for n, _ in pads}):
        if (n, True) in pads and (n, False) in pads:
            m = pads[(n, False)]["op"]["median_us"] / pads[(n, True)]["op"]["median_us"]
            rows.append(_row(ZERO_ONCE_SPEEDUP, f"T={n}", m))
    rows += _mode_pairs(results)
    meta = data.get("meta", {})
    for when, host in (
        ("", meta.get("host_overhead")),
        (", after the shapes", meta.get("host_overhead_end")),
    ):
        if host:
            for key, path in (("bound_op_us", "bound op"), ("median_us", "one-call function")):
                rows.append(_row(HOST_OVERHEAD_US, path + when, host[key]))
    return rows


def print_targets(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        fmt = f"{r['measured']:.1%}" if r["bound"] < 1 else f"{r['measured']:.2f}"
        lines.append(
            f"{'met   ' if r['met'] else 'MISSED'}  {r['target']:52} {r['shape']:48} {fmt:>8} (bound {r['bound']:g})"
            + ("  [host-dependent]" if r.get("kind") == "host" else "")
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Met / missed per kind: kernel targets hold on any machine with the GPU; host targets depend on
    the host's launch path (compare host time as a ratio to x.add_(1): tools/host_ratio.py)."""
    parts = []
    for kind in ("kernel", "host"):
        mine = [r for r in rows if r.get("kind", "kernel") == kind]
        missed = sum(not r["met"] for r in mine)
        parts.append(f"{kind} {len(mine) - missed} met, {missed} missed")
    return "; ".join(parts)


def _mode_pairs(results: list[dict]) -> list[dict]:
    """NO_SLOWER and INTERLEAVED_COST rows: each qkv mode result against the full op (head-major,
    both Q steps) of the same format and T: the mean of the full op timed just before and after it
    (bench.full_op, `extra.full_op_us`), or in documents written before that existed, the full op's row."""
    rows = []
    full = {}
    for r in results:
        s = r["shape"]
        if s["op"] == "qkv" and _modes_of(s) == FULL_Q:
            full[(s["cache_format"], s["n"], s["h"], s["p"])] = r["op"]["median_us"]
    for r in results:
        s = r["shape"]
        paired = r.get("extra", {}).get("full_op_us")
        base = sum(paired) / len(paired) if paired else full.get((s["cache_format"], s["n"], s["h"], s["p"]))
        norm, rope, layout = _modes_of(s)
        if s["op"] != "qkv" or base is None or (norm, rope, layout) == FULL_Q:
            continue
        ratio = r["op"]["median_us"] / base
        if layout == "interleaved" and norm and rope and s["n"] >= 2048:
            rows.append(_row(INTERLEAVED_COST, Shape(**s).label, ratio))
        elif layout == "head_major":
            rows.append(_row(NO_SLOWER, Shape(**s).label, ratio))
    return rows
