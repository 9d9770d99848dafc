"""The report of `simulate`: the result document (verdict and a summary of both passes) and the
end-of-run table; for a run across ranks, every rank's document under one with the topology, and a
table with a row per rank."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def gib(b) -> str:
    return f"{b / 2**30:.2f} GiB"


def size(b) -> str:
    """Bytes in GiB, or MiB below one GiB (small runs' pools)."""
    return gib(b) if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def checks(pr: dict) -> dict:
    """The pool pass's verdicts by name (a check a run did not make, e.g. across ranks alone, is absent)."""
    out = {
        "ran_without_oom": pr["oom"] is None and not pr["stopped_by_another_rank"],
        "no_allocation_after_lock": pr["no_allocation_after_lock"],
        "recall": pr["recall"] == pr["needles"],
        "q_out_close": pr["q_close"] == pr["needles"],
        "pads_zero": pr["needle_pads_zero"] == pr["needles"] and pr["pool_pads_zero"],
        "all_tokens": pr["tokens"] == pr["tokens_scheduled"],
        "padding_agreed": pr["padding_agreed"],
        "blocks_outside_tables_zero": pr["blocks_outside_tables_zero"],
    }
    tc, fh = pr.get("tp_cache"), pr.get("full_head")
    if tc is not None:
        out["tp_cache_equal"] = tc["tables_equal"] and tc["mismatched_bytes"] == 0
    if fh is not None:
        out["full_head_equal"] = fh["q_equal"] == fh["records_equal"] == fh["needles"]
    return out


def document(opts, plan, pool: dict, allocating: dict | None, seconds: float, provenance: dict) -> dict:
    """Everything a run measured, with its verdict: the pool mode ran the whole schedule without
    allocating or running out of memory, and every needle and pad head checked out (across ranks:
    the agreed padding, the TP group's cache bytes and the full-head run too)."""
    pr, al = pool, allocating
    verdicts = checks(pr)
    passed = all(verdicts.values())
    return {
        "provenance": provenance,
        "options": asdict(opts),
        "checks": verdicts,
        "prompt_lens": plan.prompt_lens,
        "seq_ids": list(plan.seq_ids),
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
            "allocating_oom_at": allocating_failure(al),
            "allocating_unplanned_peak_bytes": None if al is None else al["unplanned_peak_bytes"],
            "allocating_headroom_bytes": None if al is None else al["headroom_bytes"],
            "passed": passed,
        },
    }


def allocating_failure(al: dict | None) -> dict | None:
    """Where the allocating mode ran out of memory (step, layer, tokens of the padded step), if it did."""
    if al is None or not al["oom"]:
        return None
    return {k: al["oom"][k] for k in ("step", "layer", "tokens")}


def write(results: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1, default=str))


def allocations_text(pr: dict) -> str:
    """The allocator's counters over the schedule (CUDA), and what the pool handed out."""
    counters = pr["allocations_after_lock"]
    views = pr.get("pool_views", {})
    parts = [] if counters is None else [f"{k.split('.')[0]} {v:+d}" for k, v in counters.items()]
    if views:
        parts.append(f"q_out outside the pool {views['outside_reservation']}/{views['calls']}")
    if counters is None:
        parts.append("no CUDA allocator on the CPU")
    return ", ".join(parts) + (" (none)" if pr["no_allocation_after_lock"] else " (ALLOCATED)")


def summary(results: dict) -> str:
    """The end-of-run table."""
    pr, al = results["pool"], results.get("allocating")
    o = results["options"]
    rows = [
        ("device", results["provenance"]["device"]["name"]),
        ("scratch pool reserved", f"{pr['reserved_bytes']} B ({size(pr['reserved_bytes'])})"),
        (
            "KV cache (pool mode)",
            f"{pr['kv']['num_blocks']} blocks, {pr['kv']['capacity_tokens']} tokens/layer, "
            f"{o['layers']} layers, {size(pr['kv']['kv_bytes'])}"
            + (
                " (twice the schedule's blocks: no device memory on the CPU)"
                if o["device"] == "cpu"
                else f" of {gib(pr['kv']['free_bytes'])} free"
            ),
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
        ("allocations after lock", allocations_text(pr)),
        (
            "unplanned peak memory",
            "n/a on the CPU" if pr["unplanned_peak_bytes"] is None else f"{pr['unplanned_peak_bytes']} B",
        ),
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
    rows.append(("cache outside the block tables", "zero" if pr["blocks_outside_tables_zero"] else "WRITTEN"))
    if al is None:
        why = (
            "needs a CUDA device: a memory cap makes its failure real"
            if o["allocating"]
            else "--no-allocating"
        )
        rows.append(("allocating mode", f"skipped ({why})"))
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


def ranks_document(docs: list[dict], topology: dict, provenance: dict, seconds: float) -> dict:
    """One document for a run across ranks: the topology, and each rank's document (report.document)
    without the options they share, in rank order. It passes when every rank's does."""
    ranks = []
    for r, doc in enumerate(docs):
        entry = {k: v for k, v in doc.items() if k not in ("options", "provenance")}
        entry.update(
            rank=r, tp_rank=r % topology["tp"], dp_rank=r // topology["tp"], device=doc["provenance"]
        )
        ranks.append(entry)
    passed = all(d["passed"] for d in docs)
    return {
        "provenance": provenance,
        "topology": topology,
        "options": docs[0]["options"],
        "ranks": ranks,
        "seconds": seconds,
        "passed": passed,
        "summary": {
            "ranks": [
                {
                    "rank": e["rank"],
                    "reserved_bytes": e["pool"]["reserved_bytes"],
                    "kv_blocks": e["pool"]["kv"]["num_blocks"],
                    "recall": e["summary"]["recall"],
                    "allocating_oom_at": e["summary"]["allocating_oom_at"],
                    "passed": e["passed"],
                }
                for e in ranks
            ],
            "passed": passed,
        },
    }


def ranks_summary(results: dict) -> str:
    """The end-of-run table across ranks: a header, then one row per rank."""
    t, o = results["topology"], results["options"]
    first = results["ranks"][0]["pool"]
    head = [
        (
            "ranks",
            f"TP {t['tp']} x DP {t['dp']} = {t['world']} ({t['launcher']}, {t['backend']} backend, devices "
            f"{', '.join(sorted(set(t['devices'])))})",
        ),
        (
            "heads",
            f"{o['query_heads']} query heads / TP {t['tp']} = H={o['heads']} live per rank, P={o['padded_heads']}"
            + (" (unpadded)" if o["padded_heads"] == o["heads"] else ""),
        ),
        (
            "schedule",
            f"{len(first['padded_tokens'])} steps of agreed (padded) token counts {first['padded_tokens'][:8]}"
            + (" ..." if len(first["padded_tokens"]) > 8 else "")
            + f", {o['layers']} layers",
        ),
        ("time", f"{results['seconds']:.2f}s"),
    ]
    cols = ("rank", "tp/dp", "seqs", "pool", "KV blocks", "tokens (+pad)", "alloc after lock", "recall",
            "q full-head", "TP cache", "pads", "allocating mode", "verdict")  # fmt: skip
    table = [cols]
    for e in results["ranks"]:
        pr, al = e["pool"], e["allocating"]
        fh, tc = pr.get("full_head"), pr.get("tp_cache")
        if al is None:
            alloc = "skipped"
        elif al["oom"]:
            alloc = f"OOM step {al['oom']['step']} layer {al['oom']['layer']} (N={al['oom']['tokens']})"
        else:
            alloc = al["outcome"]
        table.append(
            (
                str(e["rank"]),
                f"{e['tp_rank']}/{e['dp_rank']}",
                ",".join(map(str, e["seq_ids"])) or "-",
                size(pr["reserved_bytes"]),
                str(pr["kv"]["num_blocks"]),
                f"{pr['tokens']} (+{pr['padded_rows']})",
                "none" if pr["no_allocation_after_lock"] else "ALLOCATED",
                f"{pr['recall']}/{pr['needles']}",
                "-" if fh is None else f"{min(fh['q_equal'], fh['records_equal'])}/{fh['needles']}",
                "-"
                if tc is None
                else ("equal" if tc["mismatched_bytes"] == 0 and tc["tables_equal"] else "DIFFER"),
                "zero" if e["checks"]["pads_zero"] else "NONZERO",
                alloc,
                "PASS" if e["passed"] else "FAIL: " + ", ".join(k for k, v in e["checks"].items() if not v),
            )
        )
    w = max(len(k) for k, _ in head)
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [f"{k.ljust(w)}  {v}" for k, v in head] + [""]
    lines += ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in table]
    lines.append(f"\nverdict  {'PASS' if results['passed'] else 'FAIL'}")
    return "\n".join(lines)
