"""SASS instructions per value of every writer of issue 26 (and the qkv op), with the lean_quant knob off,
on, and on with defaults_only (the parity choices folded away), for sm_90a and sm_120f, and what they mean on the H200: a row's issue time (instructions at
4 warp instructions per SM clock) against its DRAM time (bytes at the H200's bandwidth per SM).
Compiles on the CPU (no GPU); writes results/sass-instructions-cpu.json with the provenance.

    python tools/sass_census.py [--json results/sass-instructions-cpu.json]
    python tools/sass_census.py --render-docs     # rewrite docs/performance.md's census table from the file

docs/performance.md's census table is `census_table(json)` of the committed file (a test compares them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from attn_prologue.codegen.archs import ARCH_SPECS
from attn_prologue.formats import get_format
from attn_prologue.lab import sass
from attn_prologue.lab.provenance import provenance
from attn_prologue.variants import parse_name

# (variant without its arch suffix, row kind, compress ratio): the writers of issue 26's tables
WRITERS = [
    ("kv_d512r64_fp8_ds_mla_bf16", "kv", 1),
    ("kv_d512r64_fp8_ds_mla_bf16", "kv", 4),
    ("kv_d512r64_mxfp8_bf16", "kv", 1),
    ("kv_d512r64_nvfp4_v41_bf16", "kv", 1),
    ("kv_d512r64_nvfp4_v41_bf16", "kv", 2),
    ("kv_d512r64_nvfp4_dsv4_bf16", "kv", 1),
    ("kv_d512r64_nvfp4_dsv4_bf16", "kv", 2),
    ("kv_norm_d512r64_mxfp8_bf16", "kv", 1),
    ("kv_d128r64_fp8_token_bf16", "kv", 1),
    ("kv_norm_d128r64_fp8_token_bf16", "kv", 4),
    ("kv_d128r64_mxfp4_bf16", "kv", 1),
    ("kv_norm_d128r64_mxfp4_bf16", "kv", 4),
    ("qkv_d512r64_fp8_ds_mla_bf16", "q", 1),
    ("qkv_d512r64_fp8_ds_mla_bf16", "kv", 1),
    ("qkv_d512r64_nvfp4_dsv4_bf16", "kv", 1),
]
ARCHS = (("sm90", "sm_90a"), ("sm120", "sm_120f"))
H200 = next(p for p in ARCH_SPECS["sm90"].parts if p.name == "H200")
# (lean_quant, defaults_only) of each count: the default config, with lean_quant, and with both
KNOBS = ((False, False), (True, False), (True, True))
ISSUE_PER_CLOCK = 4  # warp instructions per SM clock: 4 schedulers, 1 each (NVIDIA H100 whitepaper, SM)


def row_bytes(variant: str, row: str) -> int:
    """DRAM bytes of one row: a KV row (its bf16 row, record, cos/sin, slot and position) or a Q row
    (read and written; its token's cos/sin are shared by the heads, and not counted)."""
    v = parse_name(variant)
    d, r = v.head_dim, v.rope_dim
    if row == "q":
        return 2 * d * 2
    return d * 2 + get_format(v.cache_format).bytes_per_token(d) + r * 4 + 16


def roofline(c: dict) -> dict:
    """On the H200: the row's issue clocks per SM (warp instructions / 4 per clock) against its DRAM
    clocks per SM (bytes / bytes per clock per SM), and the instructions per value at which they meet."""
    v = parse_name(c["variant"])
    rows_per_warp = 32 * c["values_per_lane"] // v.head_dim
    nbytes = row_bytes(c["variant"], c["row"])
    issue = c["instructions"] / rows_per_warp / ISSUE_PER_CLOCK
    dram = nbytes / H200.bytes_per_clock_per_sm
    return {
        "row_bytes": nbytes,
        "bytes_per_value": round(nbytes / v.head_dim, 3),
        "issue_clocks_per_row": round(issue, 1),
        "dram_clocks_per_row": round(dram, 1),
        "issue_over_dram": round(issue / dram, 2),
        "per_value_at_bandwidth": round(c["per_value"] * dram / issue, 1),
    }


def census() -> list[dict]:
    out = []
    for base, row, ratio in WRITERS:
        for family, target in ARCHS:
            variant = f"{base}_{family}"
            default = parse_name(variant).arch.default_config
            for lean, only in KNOBS:
                config = dataclasses.replace(default, lean_quant=lean, defaults_only=only)
                c = sass.count(variant, config, target, row=row, compress=ratio != 1)
                entry = {**c, "compress_ratio": ratio, "lean_quant": lean, "defaults_only": only}
                if target == "sm_90a":
                    entry["h200"] = roofline(c)
                out.append(entry)
                print(
                    f"{variant:36} {target} {row:2} r={ratio} lean={int(lean)} d={int(only)}: {c['instructions']:4} per lane and "
                    f"pass, {c['per_value']:6.2f} per value",
                    flush=True,
                )
    return out


DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN = (
    "<!-- census: rendered by tools/sass_census.py --render-docs from results/sass-instructions-cpu.json -->"
)
END = "<!-- end census -->"


def _label(variant: str, row: str, ratio: int, qkv_row: bool) -> str:
    v = parse_name(variant)
    text = f"{v.op.value} `{v.cache_format}`"
    text += " (D = 128)" if v.head_dim == 128 and ratio == 1 else ""
    text += f", r = {ratio}" if ratio != 1 else ""
    if qkv_row:
        text += ": a Q row" if row == "q" else ": its KV row"
    return text


def _chain(values, digits: int) -> str:
    """ "a -> b -> c", or one value where all are equal ("(unchanged)" after counts)."""
    texts = [f"{x:.{digits}f}" for x in values]
    if len(set(texts)) == 1:
        return f"{texts[0]} (unchanged)" if digits == 2 else texts[0]
    return " -> ".join(texts)


def census_table(doc: dict) -> str:
    """The census table and the sm_120f line of docs/performance.md, from a census file."""
    by = {
        (
            w["variant"],
            w["target"],
            w["row"],
            w["compress_ratio"],
            w["lean_quant"],
            w.get("defaults_only", False),
        ): w
        for w in doc["writers"]
    }
    lines = [
        "| writer | instructions per value | issue / DRAM time per row | allowed at DRAM speed |",
        "|---|---|---|---|",
    ]
    for base, row, ratio in WRITERS:
        counts = [by[(f"{base}_sm90", "sm_90a", row, ratio, *knobs)] for knobs in KNOBS]
        lines.append(
            f"| {_label(counts[0]['variant'], row, ratio, base.startswith('qkv'))} "
            f"| {_chain([c['per_value'] for c in counts], 2)} "
            f"| {_chain([c['h200']['issue_over_dram'] for c in counts], 2).replace(' (unchanged)', '')} "
            f"| {counts[0]['h200']['per_value_at_bandwidth']:.1f} |"
        )
    sm120 = [
        f"`{parse_name(base + '_sm120').cache_format}` "
        + _chain([by[(f"{base}_sm120", "sm_120f", row, ratio, *knobs)]["per_value"] for knobs in KNOBS], 2)
        for base, row, ratio in WRITERS
        if base.startswith("kv_d")
        and ratio == 1
        and "bf16" in base
        and parse_name(base + "_sm120").cache_format in ("nvfp4_v41", "nvfp4_dsv4", "mxfp4", "fp8_ds_mla")
    ]
    lines += [
        "",
        "On sm_120f, where E2M1 and UE8M0 convert in hardware (kv, per value): " + ", ".join(sm120) + ".",
    ]
    return "\n".join(lines)


def render_docs(census_file: Path) -> str:
    """docs/performance.md with its census block rendered from `census_file`."""
    text = DOCS.read_text()
    head, rest = text.split(BEGIN + "\n", 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{census_table(json.loads(census_file.read_text()))}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="results/sass-instructions-cpu.json")
    parser.add_argument("--render-docs", action="store_true", help="only rewrite docs/performance.md's table")
    args = parser.parse_args(argv)
    if args.render_docs:
        DOCS.write_text(render_docs(Path(args.json)))
        print(f"rendered {DOCS} from {args.json}")
        return 0
    origin = provenance(argv=[sys.executable, *sys.argv], device="cpu")
    doc = {
        "provenance": origin,
        "tools": sass.tool_versions(),
        "method": sass.__doc__,
        "h200": {
            "sms": H200.sms,
            "dram_gbs": H200.dram_gbs,
            "clock_ghz": H200.clock_ghz,
            "bytes_per_clock_per_sm": round(H200.bytes_per_clock_per_sm, 2),
            "issue_per_clock_per_sm": ISSUE_PER_CLOCK,
        },
        "writers": census(),
    }
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
