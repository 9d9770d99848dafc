"""SASS instructions of the index_q kernels per preset and format (CPU: compiled here, no GPU): a warp's unit
of work (the arch default config, one pass of 32 / lanes rows) has no loop, so its instruction count is what
one warp issues for those rows, and the most frequent opcodes say where they go (docs/index-q.md,
Performance). Each row is compiled twice: rows on the module's 8 lanes (4 rows a unit) and on 4
(LaunchConfig.q_lanes=4: 8 rows a unit); `per_4_rows` puts the two on one scale.

    python tools/index_q_sass.py [--target sm_90a] [--json results/index-q-sass-cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json

from attn_prologue.index_q import FORMATS, PRESETS, numerics_bits
from attn_prologue.lab.provenance import provenance
from attn_prologue.lab.sass_reader import disassemble, line_info_cubin
from attn_prologue.variants import TARGETS, ArchFamily, parse_name


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def count(target: str, preset: str, fmt: str, lanes: int) -> dict:
    family = next(f for f in ArchFamily if target in f.targets)
    v = parse_name(f"index_q_d128r64_{fmt}_bf16_{family.value}")
    config = dataclasses.replace(v.arch.default_config, q_lanes=0 if lanes == 8 else lanes)
    config = config.folded_to(numerics_bits(preset, "bf16", fmt), v.default_numerics)
    instrs, _ = disassemble(line_info_cubin(v.name, config, target))
    ops = collections.Counter(opcode(i.text) for i in instrs)
    return {"variant": v.name, "config": config.key, "preset": preset, "format": fmt, "lanes": lanes,
            "instructions": len(instrs), "per_4_rows": len(instrs) * lanes / 8,
            "top_opcodes": dict(ops.most_common(8))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="sm_90a", choices=TARGETS)
    parser.add_argument("--json", help="write the counts here, with the provenance")
    args = parser.parse_args()
    rows = [
        count(args.target, preset, fmt, lanes)
        for fmt in FORMATS
        for preset, (_, dtypes, _) in PRESETS.items()
        if "bf16" in dtypes
        for lanes in (8, 4)
    ]
    for r in rows:
        print(f"{r['format']:>9} {r['preset']:<11} {r['lanes']} lanes: {r['instructions']:4d} instructions "
              f"({r['per_4_rows']:g} per 4 rows)  {r['top_opcodes']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "target": args.target, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
