"""Host time of the hot paths' own Python on CPU: the one-call function and the bound op with the kernel
replaced by a Python no-op (tests/support/stub_kernels.py), so what is timed is our per-call code alone
(key, cheap checks, overlap check), the part a GPU host runs before the TVM-FFI call.

    python tools/hot_path_cpu.py [--against REV] [--tokens 1] [--loops 15] [--calls 5000] [--json out.json]

T=1, H=16, P=64, D=512, fp8_ds_mla, block 64 (and index_q_rope_quant's function and bound op, H=64,
D=128, FP8, as ratios to `x.add_(1)` on a CPU tensor timed with them); min and median over interleaved loops, on the same
tensors every call (what a benchmark loop does) and on fresh q_in, kv, slot_mapping and positions
every call (what eager serving does: the inputs come from the layer before). With --against, ops.py
and api.py of that git revision are loaded beside the working tree's and timed interleaved with them,
and the difference is printed. Absolute numbers move with the machine and its load; the difference in
one process is what to compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

import torch  # noqa: E402
from attn_prologue import api, index_q_ops, ops  # noqa: E402
from attn_prologue.dispatch import MAX_BUCKET_LOG2  # noqa: E402
from attn_prologue.lab.provenance import provenance  # noqa: E402

from tests.support import stub_kernels  # noqa: E402

H, P, D, R, BS = 16, 64, 512, 64, 64


def noop(*_):
    pass


def load_revision(rev: str, name: str):
    """runtime/<name>.py at git revision rev, as a module of the installed package."""
    src = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{rev}:runtime/{name}.py"], text=True)
    spec = importlib.util.spec_from_loader(f"attn_prologue._{name}_at_{rev}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "attn_prologue"
    sys.modules[spec.name] = mod
    exec(compile(src, f"{rev}:runtime/{name}.py", "exec"), mod.__dict__)
    return mod


def inputs(n: int, g: torch.Generator) -> tuple:
    q_in = torch.randn(n, H, D, generator=g).bfloat16()
    kv = torch.randn(n, 2 * D, generator=g).bfloat16()[:, :D]  # a column slice, as from a fused projection
    return q_in, kv, torch.arange(n), torch.arange(n)


def cases(ops_mod, api_mod, tag: str, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    same = inputs(n, g)
    fresh = [inputs(n, g) for _ in range(64)]  # cycled: new tensor objects at other addresses
    q_out = torch.zeros(n, P, D, dtype=torch.bfloat16)
    k_cache = torch.zeros(8, BS * 584, dtype=torch.uint8)
    cos_sin = torch.rand(4096, R)
    rt = stub_kernels.StubRuntime(noop)
    real, stub_kernels.api = stub_kernels.api, api_mod
    try:
        op = stub_kernels.stub_bind(
            runtime=stub_kernels.StubRuntime(noop), num_heads=H, padded_heads=P, block_size=BS, max_tokens=n
        )
    finally:
        stub_kernels.api = real

    def one_call(t):
        ops_mod.qnorm_rope_kv_insert(t[0], t[1], q_out, k_cache, t[2], t[3], cos_sin, 1e-6, BS, runtime=rt)

    def bound(t):
        op(t[0], t[1], k_cache, t[2], t[3], cos_sin)

    it = iter(range(1 << 62))
    return {
        f"one-call function, same inputs {tag}": lambda: one_call(same),
        f"one-call function, fresh inputs {tag}": lambda: one_call(fresh[next(it) % 64]),
        f"bound op, same inputs {tag}": lambda: bound(same),
        f"bound op, fresh inputs {tag}": lambda: bound(fresh[next(it) % 64]),
    }


def index_q_cases(n: int) -> dict:
    """index_q_rope_quant's one-call function and bound op (H = 64, D = 128, FP8) with the kernel replaced by
    the no-op, and torch's `x.add_(1)` on a CPU tensor as the yardstick."""
    from attn_prologue import bound_index_q
    from attn_prologue.launcher import Launcher
    from attn_prologue.variants import parse_name

    class NoopRuntime(stub_kernels.StubRuntime):
        def launchers(self, request, device=None, **_):
            v = parse_name(f"index_q_d128r64_{request.cache_format}_{request.io_dtype.value}_sm90")
            return (Launcher(v, v.arch.default_config, "sm_90a", 0, noop, 1),) * (MAX_BUCKET_LOG2 + 1)

    g, h, rt = torch.Generator().manual_seed(1), 64, NoopRuntime(noop)

    def tensors():
        return (
            torch.randn(n, h, 128, generator=g).bfloat16(),
            torch.arange(n),
            torch.randn(n, h, generator=g).bfloat16(),
        )

    same, fresh = tensors(), [tensors() for _ in range(64)]
    cos_sin, codes, w_out = torch.rand(4096, R), torch.zeros(n, h, 128, dtype=torch.uint8), torch.zeros(n, h)
    real = bound_index_q.bind_device
    bound_index_q.bind_device = lambda device, what: torch.device("cpu")  # the stand-in runs on CPU tensors
    try:
        op = bound_index_q.bind_index_q(num_heads=h, softmax_scale=0.088, head_scale=0.125, runtime=rt)
    finally:
        bound_index_q.bind_device = real
    x, it = torch.zeros(16), iter(range(1 << 62))

    def one_call(t):
        index_q_ops.index_q_rope_quant(t[0], t[1], cos_sin, t[2], 0.088, 0.125, codes, w_out, runtime=rt)

    return {
        "x.add_(1)": lambda: x.add_(1),
        "index_q function, same inputs": lambda: one_call(same),
        "index_q function, fresh inputs": lambda: one_call(fresh[next(it) % 64]),
        "index_q bound op, same inputs": lambda: op(same[0], same[1], cos_sin, same[2], codes, w_out),
        "index_q bound op, fresh inputs": lambda: (t := fresh[next(it) % 64]) and op(t[0], t[1], cos_sin, t[2], codes, w_out),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision to time interleaved with the working tree")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--loops", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--json", help="write the samples, the machine and the provenance here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    timed = cases(ops, api, "(working tree)", args.tokens) | index_q_cases(args.tokens)
    if args.against:
        timed |= cases(load_revision(args.against, "ops"), load_revision(args.against, "api"),
                       f"({args.against})", args.tokens)  # fmt: skip
    for call in timed.values():
        call()  # validates and caches
    samples = {name: [] for name in timed}
    for _ in range(args.loops):
        for name, call in timed.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            samples[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    base = statistics.median(samples["x.add_(1)"])
    for name, s in samples.items():
        print(f"{name:58s} min {min(s):6.3f} us  median {statistics.median(s):6.3f} us"
              f"  ({statistics.median(s) / base:.2f}x x.add_(1))")  # fmt: skip
    added = {}
    if args.against:
        print(f"\nworking tree minus {args.against}:")
        for name in [n for n in samples if n.endswith("(working tree)")]:
            base = samples[name.replace("(working tree)", f"({args.against})")]
            new = samples[name]
            what = name.replace(" (working tree)", "")
            added[what] = {
                "min": min(new) - min(base),
                "median": statistics.median(new) - statistics.median(base),
            }
            print(f"  {what:45s} min {added[what]['min']:+6.3f} us  median {added[what]['median']:+6.3f} us")
    if args.json:
        record = {
            "provenance": provenance(),
            "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "system": platform.platform(),
                        "load_average_before_after": [load_before, os.getloadavg()]},
            "setup": {"tokens": args.tokens, "heads": H, "padded_heads": P, "head_dim": D, "loops": args.loops,
                      "calls_per_loop": args.calls, "against": args.against},
            "us_per_call": {k: {"min": min(v), "median": statistics.median(v), "samples": v} for k, v in samples.items()},
            "added_us": added,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
