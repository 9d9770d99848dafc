"""Do two kernel caches hold the same kernels? For a change meant to speed up the build or the
tracing without changing any kernel: build into two empty caches, before and after the change, and
compare them entry by entry (target, variant, launch config): the bytes of `kernel.so` and
`kernel.ptx`, hashed here, not read from meta.json. An entry's directory name holds its source hash,
so entries are matched by what they compile, not by where they sit.

    python -m attn_prologue build --cache-dir /tmp/before    # at the old commit
    python -m attn_prologue build --cache-dir /tmp/after     # at the new one
    python tools/same_kernels.py /tmp/before /tmp/after [--json out.json]

Exit status 0 when both hold the same entries with the same bytes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from attn_prologue.lab.provenance import provenance


def entries(root: Path) -> dict[tuple[str, str, str], dict[str, str]]:
    """(target, variant, config) -> sha256 of kernel.so and kernel.ptx, for every kernel entry under
    root (the native parts' entries have no kernel.so beside their meta.json and are left out)."""
    out = {}
    for meta_path in sorted(root.rglob("meta.json")):
        so, ptx = meta_path.parent / "kernel.so", meta_path.parent / "kernel.ptx"
        if not so.exists():
            continue
        meta = json.loads(meta_path.read_text())
        key = (meta["target"], meta["variant"], meta["config"])
        if key in out:
            raise SystemExit(f"{root}: two entries for {key} (build into an empty cache)")
        out[key] = {
            "so": hashlib.sha256(so.read_bytes()).hexdigest(),
            "ptx": hashlib.sha256(ptx.read_bytes()).hexdigest() if ptx.exists() else "",
        }
    return out


def compare(before: Path, after: Path) -> dict:
    a, b = entries(before), entries(after)
    common = sorted(set(a) & set(b))
    name = ":".join
    return {
        "provenance": provenance(),
        "before": str(before),
        "after": str(after),
        "entries": [len(a), len(b)],
        "only_before": [name(k) for k in sorted(set(a) - set(b))],
        "only_after": [name(k) for k in sorted(set(b) - set(a))],
        "so_differ": [name(k) for k in common if a[k]["so"] != b[k]["so"]],
        "ptx_differ": [name(k) for k in common if a[k]["ptx"] != b[k]["ptx"]],
        "same": sum(a[k] == b[k] for k in common),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    result = compare(args.before, args.after)
    differ = result["only_before"] or result["only_after"] or result["so_differ"] or result["ptx_differ"]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['entries'][0]} and {result['entries'][1]} kernel entries; {result['same']} the same bytes; "
        f"kernel.so differs in {len(result['so_differ'])}, kernel.ptx in {len(result['ptx_differ'])}; "
        f"only in one cache: {len(result['only_before'])} / {len(result['only_after'])}"
    )
    for label in ("so_differ", "ptx_differ", "only_before", "only_after"):
        for k in result[label][:10]:
            print(f"  {label}: {k}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
