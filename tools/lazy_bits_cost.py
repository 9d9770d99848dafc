"""What refusing lazily negated views costs the C fast path when it reads tensors through torch's DLPack
exchange API (no C++ torch-op library loaded): a one-call qkv plan with a no-op TVM-FFI kernel
(tools/noop_ffi_kernel.c), the working tree's fast-path module against one built from another git
revision's sources, interleaved in one process, with CPU `x.add_(1)` as the yardstick. Where the C++
library's reader is loaded the check is a flag test inside it and costs nothing new.

    python tools/lazy_bits_cost.py --against REV [--loops 15] [--calls 20000] [--json out.json]

T=1, H=P=64, D=512 CPU tensors; median of interleaved loops. Absolute numbers move with the machine
and its load; compare the pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from attn_prologue import native
from attn_prologue.lab.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_ratio import noop_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def module_at(rev: str):
    """The fast-path module built from `rev`'s sources (into a temporary directory), initialised."""
    out = Path(tempfile.mkdtemp(prefix="attn-prologue-fastpath-"))
    for name in native.PARTS["fastpath"][1]:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:runtime/native/{name}"], check=True,
                             capture_output=True).stdout  # fmt: skip
        (out / name).write_bytes(src)
    lib = out / native.PARTS["fastpath"][0]
    command = [
        str(out / "fastpath.c") if c.endswith("fastpath.c") else c for c in native._fastpath_command(lib)
    ]
    subprocess.run(command, check=True)
    module = native._extension_module(str(lib))
    module.init(torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)
    return module


def loop_ns(call, n: int) -> float:
    import time

    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--loops", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--json")
    args = parser.parse_args()
    new, old = native.fastpath(), module_at(args.against)
    if new is None:
        sys.exit("the native fast path is not available here (ATTN_PROLOGUE_NATIVE=0, or no compiler)")
    h = p = 64
    d, need = 512, 64 * 656
    q_in, kv = torch.randn(1, h, d).bfloat16(), torch.randn(1, d).bfloat16()
    q_out, k_cache = torch.zeros(1, p, d).bfloat16(), torch.zeros(4, need, dtype=torch.uint8)
    slots, pos, cs = torch.tensor([5]), torch.tensor([3]), torch.rand(64, 64)
    x = torch.zeros(64)
    kernel = noop_kernel()
    entries = {"x.add_(1)": lambda: x.add_(1)}
    for tag, fp in ((f"exchange API, {args.against}", old), ("exchange API, working tree", new)):
        fp.set_unpacker(0)
        plan = fp.one_call_qkv_plan([(kernel, (1, 2.0))] * fp.buckets(), need, False, False)
        entries[tag] = lambda plan=plan: plan.qkv(q_in, kv, q_out, k_cache, slots, pos, cs, None, None)
        assert entries[tag]() is True
    assert new.one_call_qkv_plan([(kernel, (1, 2.0))] * new.buckets(), need, False, False).qkv(
        q_in, kv, q_out, torch._neg_view(k_cache), slots, pos, cs, None, None) is False  # fmt: skip
    runs = {name: [] for name in entries}
    for i in range(args.loops):
        for name in entries if i % 2 == 0 else reversed(list(entries)):
            runs[name].append(loop_ns(entries[name], args.calls))
    ns = {name: statistics.median(v) for name, v in runs.items()}
    for name, v in ns.items():
        print(f"{name:40} {v:7.0f} ns  ({v / ns['x.add_(1)']:.3f}x x.add_(1))")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "ns": ns, "runs_ns": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
