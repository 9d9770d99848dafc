"""Eager host time per call as a ratio to torch's own `x.add_(1)`, all in one process.

T = 1, H = P = 64, D = 512, fp8_ds_mla, block 64: the one-call function, the bound op (zero-once
scratch from a locked pool) and the torch op, each timed as the median of 7 loops of 2000 calls
issued back to back (a T = 1 call's device work is shorter than its host work, so the loop measures
the host), interleaved with the `x.add_(1)` baseline so drift hits both. Absolute microseconds move
1.5-2x between VMs; the ratio is what to compare. Uses only the public API, so the same script
measures any version of the package.

    python tools/host_ratio.py [--json out.json] [--label text]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attn_prologue as ap
import torch


def loop_us(call, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--label", default="", help="a label stored with the numbers (e.g. the version)")
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import attn_prologue.torch_op  # noqa: F401  (older versions register torch.ops lazily)

    h = p = 64
    d, bs = 512, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    q_in = torch.randn(1, h, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    q_out = torch.zeros(1, p, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(4, bs * 584, device="cuda", dtype=torch.uint8)
    slots = torch.tensor([5], device="cuda")
    pos = torch.tensor([3], device="cuda")
    theta = torch.rand(64, 32, device="cuda", generator=g)
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=16, padded_heads=p, head_dim=d, micro_batches=1)
    pool.lock()
    bound = ap.bind(num_heads=h, padded_heads=p, head_dim=d, rope_dim=64, block_size=bs, pool=pool)
    x = torch.zeros(16, device="cuda")
    op = torch.ops.attn_prologue.qnorm_rope_kv_insert
    calls = {
        "x.add_(1)": lambda: x.add_(1),
        "one-call function": lambda: ap.qnorm_rope_kv_insert(
            q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs
        ),
        "bound op": lambda: bound(q_in, kv, k_cache, slots, pos, cs),
        "torch op": lambda: op(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs),
    }
    for call in calls.values():
        loop_us(call, 200)  # warm up: bind, load, first launch
    runs = {name: [] for name in calls}
    for i in range(args.loops):
        for name in calls if i % 2 == 0 else reversed(list(calls)):
            runs[name].append(loop_us(calls[name], args.calls))
    us = {name: statistics.median(v) for name, v in runs.items()}
    base = us["x.add_(1)"]
    out = {
        "label": args.label,
        "package": ap.__file__,  # which installed version ran
        "argv": sys.argv,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "us": us,
        "ratio_to_add": {name: v / base for name, v in us.items()},
        "runs_us": runs,
    }
    for name, v in us.items():
        print(f"{name:20} {v:7.2f} us  {v / base:5.2f}x x.add_(1)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
