"""The report of `simulate`: the result document (verdict and a summary of both passes) and the
end-of-run table."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def gib(b) -> str:
    return f"{b / 2**30:.2f} GiB"


def document(opts, plan, pool: dict, allocating: dict | None, seconds: float, provenance: dict) -> dict:
    """Everything a run measured, with its verdict: the pool mode ran the whole schedule without
    allocating or running out of memory, and every needle and pad head checked out."""
    pr, al = pool, allocating
    passed = bool(
        pr["oom"] is None
        and pr["no_allocation_after_lock"]
        and pr["recall"] == pr["needles"]
        and pr["q_close"] == pr["needles"]
        and pr["needle_pads_zero"] == pr["needles"]
        and pr["pool_pads_zero"]
        and pr["tokens"] == pr["tokens_scheduled"]
    )
    return {
        "provenance": provenance,
        "options": asdict(opts),
        "prompt_lens": plan.prompt_lens,
        "max_position": plan.max_pos,
        "pool": pr,
        "allocating": al,
        "seconds": seconds,
        "passed": passed,
        "summary": {
            "reserved_bytes": pr["reserved_bytes"],
            "kv_capacity_tokens": pr["kv"]["capacity_tokens"],
            "tokens_processed": pr["tokens"],
            "layer_calls": pr["layer_calls"],
            "seconds": round(pr["seconds"], 3),
            "recall": f"{pr['recall']}/{pr['needles']}",
            "q_out_close": f"{pr['q_close']}/{pr['needles']}",
            "pads_zero": pr["pool_pads_zero"] and pr["needle_pads_zero"] == pr["needles"],
            "allocations_after_lock": pr["allocations_after_lock"],
            "oom": pr["oom"],
            "allocating_outcome": None if al is None else al["outcome"],
            "allocating_oom_at": None
            if al is None or not al["oom"]
            else {k: al["oom"][k] for k in ("step", "layer", "tokens")},
            "allocating_unplanned_peak_bytes": None if al is None else al["unplanned_peak_bytes"],
            "allocating_headroom_bytes": None if al is None else al["headroom_bytes"],
            "passed": passed,
        },
    }


def write(results: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1, default=str))


def summary(results: dict) -> str:
    """The end-of-run table."""
    pr, al = results["pool"], results.get("allocating")
    o = results["options"]
    rows = [
        ("device", results["provenance"]["device"]["name"]),
        ("scratch pool reserved", f"{pr['reserved_bytes']} B ({gib(pr['reserved_bytes'])})"),
        (
            "KV cache (pool mode)",
            f"{pr['kv']['num_blocks']} blocks, {pr['kv']['capacity_tokens']} tokens/layer, "
            f"{o['layers']} layers, {gib(pr['kv']['kv_bytes'])} of {gib(pr['kv']['free_bytes'])} free",
        ),
        (
            "schedule",
            f"{pr['steps']} steps ({pr['prefill_steps']} prefill, {pr['decode_steps']} decode), "
            f"{pr['layer_calls']} layer calls",
        ),
        (
            "tokens processed",
            f"{pr['tokens']}/{pr['tokens_scheduled']} ({pr['tokens'] * o['layers']} token-layers)",
        ),
        (
            "time",
            f"{pr['seconds']:.2f}s ({pr['tokens'] * o['layers'] / max(pr['seconds'], 1e-9):,.0f} token-layers/s, "
            f"random inputs included)",
        ),
        (
            "allocations after lock",
            ", ".join(f"{k.split('.')[0]} {v:+d}" for k, v in pr["allocations_after_lock"].items())
            + (" (none)" if pr["no_allocation_after_lock"] else " (ALLOCATED)"),
        ),
        ("unplanned peak memory", f"{pr['unplanned_peak_bytes']} B"),
        ("OOM", "none" if pr["oom"] is None else f"step {pr['oom']['step']} layer {pr['oom']['layer']}"),
        (
            "needle recall (bit-exact)",
            f"{pr['recall']}/{pr['needles']}"
            + (
                f"  (e4m3 {pr['needle_parts'].get('nope_e4m3')}, rope {pr['needle_parts'].get('rope_bf16')}, "
                f"scales {pr['needle_parts'].get('scale_ue8m0')})"
                if pr["needle_parts"]
                else ""
            ),
        ),
        (
            "q_out of needles",
            f"{pr['q_close']}/{pr['needles']} within 1e-2, {pr['q_exact']}/{pr['needles']} bit-exact",
        ),
        (
            "pad heads zero",
            f"needles {pr['needle_pads_zero']}/{pr['needles']}, pool buffers "
            f"{'yes' if pr['pool_pads_zero'] else 'NO'}",
        ),
    ]
    if al is None:
        rows.append(("allocating mode", "skipped"))
    else:
        rows.append(
            (
                "KV cache (allocating)",
                f"{al['kv']['num_blocks']} blocks, {al['kv']['capacity_tokens']} tokens/layer, "
                f"{gib(al['kv']['kv_bytes'])} of {gib(al['kv']['free_bytes'])} free",
            )
        )
        if al["oom"]:
            oo = al["oom"]
            rows.append(
                (
                    "allocating mode",
                    f"torch.cuda.OutOfMemoryError at step {oo['step']}/{oo['steps']}, layer "
                    f"{oo['layer']} (N={oo['tokens']}, needed {gib(oo['requested_bytes'])}, "
                    f"headroom {gib(al['headroom_bytes'])})",
                )
            )
        else:
            rows.append(
                (
                    "allocating mode",
                    f"fit: measured peak beyond the planned memory {gib(al['unplanned_peak_bytes'])}"
                    f" (headroom {gib(al['headroom_bytes'])}; fails for kv-fraction > "
                    f"{al['max_kv_fraction_that_fits']:.3f})",
                )
            )
    rows.append(("verdict", "PASS" if results.get("passed") else "FAIL"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
