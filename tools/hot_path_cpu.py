"""Host time of the hot paths' Python on CPU: the one-call function and the bound op with the kernel
replaced by a Python no-op (tests/support/stub_kernels.py), so what is timed is our per-call code alone
(key, cheap checks, overlap check), the part that a GPU host runs before the TVM-FFI call.

    python tools/hot_path_cpu.py [--loops 15] [--calls 20000]

T=1, H=16, P=64, D=512, fp8_ds_mla, block 64; the median of interleaved loops. Absolute numbers move
with the machine and its load; compare two versions on one machine (e.g. `git stash` the runtime).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support

import torch  # noqa: E402
from attn_prologue import ops  # noqa: E402

from tests.support.stub_kernels import StubRuntime, stub_bind  # noqa: E402

N, H, P, D, R, BS = 1, 16, 64, 512, 64, 64


def noop(*_):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    q_in = torch.randn(N, H, D, generator=g).bfloat16()
    kv = torch.randn(N, D, generator=g).bfloat16()
    q_out = torch.zeros(N, P, D, dtype=torch.bfloat16)
    k_cache = torch.zeros(8, BS * 584, dtype=torch.uint8)
    slots = torch.arange(N)
    positions = torch.arange(N)
    cos_sin = torch.rand(4096, R)

    rt = StubRuntime(noop)
    ops.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, positions, cos_sin, 1e-6, BS, runtime=rt)
    op = stub_bind(runtime=StubRuntime(noop), num_heads=H, padded_heads=P, block_size=BS, max_tokens=N)
    op(q_in, kv, k_cache, slots, positions, cos_sin)

    cases = {
        "one-call function": lambda: ops.qnorm_rope_kv_insert(
            q_in, kv, q_out, k_cache, slots, positions, cos_sin, 1e-6, BS, runtime=rt
        ),
        "bound op": lambda: op(q_in, kv, k_cache, slots, positions, cos_sin),
    }
    samples = {name: [] for name in cases}
    for _ in range(args.loops):
        for name, call in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    for name, s in samples.items():
        print(f"{name:20s} {statistics.median(s):.3f} us per call (min {min(s):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
