"""Eager host time per call as a ratio to torch's own `x.add_(1)`, all in one process.

T = 1, H = P = 64, D = 512, fp8_ds_mla, block 64. For qnorm_rope_kv_insert and kv_rope_insert:
the one-call function, the bound op (zero-once scratch from a locked pool) and the torch op (and the
same three of index_q_rope_quant, H = 64, D = 128, FP8, with no target of their own); and
the breakdown of the qkv call: the compiled kernel called alone through TVM-FFI with prebuilt
arguments (launch path + TVM-FFI's tensor conversion), and the native plan called alone (our C
checks + the launch path) and with its kernel replaced by a no-op TVM-FFI C function
(tools/noop_ffi_kernel.c, built here with cc: our C alone). Each is the median of 7 loops of 2000 calls issued back to back (a T = 1
call's device work is shorter than its host work, so the loop measures the host), interleaved with
the `x.add_(1)` baseline so drift hits both. Absolute microseconds move 1.5-2x between VMs; the
ratio is what to compare. `ATTN_PROLOGUE_NATIVE=0` measures the Python paths.

    python tools/host_ratio.py [--json out.json] [--label text] [--build-native]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attn_prologue as ap
import torch
from attn_prologue import native, ops, torch_op
from attn_prologue.formats import get_format
from attn_prologue.lab.provenance import provenance
from attn_prologue.lab.targets import EAGER_TARGETS


def loop_us(call, n: int, drains: list | None = None) -> float:
    """Microseconds per call of n calls back to back. drains gets the microseconds the device still
    ran after the host's last call returned: a few kernels' worth while the host is the bottleneck,
    the whole launch queue's worth if the device is."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    if drains is not None:
        drains.append((t2 - t1) * 1e6)
    return (t2 - t0) / n * 1e6


def graph_us(call, n: int = 100, replays: int = 20) -> float:
    """Device microseconds per call: n calls captured in one CUDA graph, replayed (no host cost per
    call; what a back-to-back loop cannot go below)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            call()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (n * replays) * 1e6


def noop_kernel():
    """tools/noop_ffi_kernel.c built with cc against tvm_ffi's headers, loaded as a TVM-FFI function."""
    import pathlib
    import subprocess
    import tempfile

    import tvm_ffi

    base = pathlib.Path(tvm_ffi.__file__).parent
    out = pathlib.Path(tempfile.mkdtemp()) / "noop.so"
    src = pathlib.Path(__file__).with_name("noop_ffi_kernel.c")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{base / 'include'}", str(src), f"-L{base / 'lib'}",
                    "-ltvm_ffi", "-o", str(out)], check=True)  # fmt: skip
    return tvm_ffi.load_module(str(out))["noop"]


def empty_torch_op():
    """The torch op's schema with an empty C++ CUDA kernel and, as torch_op.py registers them, the
    Autograd keys as fallthroughs (namespace attn_prologue_probe): the floor of torch's binding and
    dispatch of these 16 arguments, under any kernel."""
    from torch.utils import cpp_extension

    source = (
        "#include <torch/library.h>\n#include <ATen/core/Tensor.h>\n"
        "void empty(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,"
        " const at::Tensor&, const at::Tensor&, double, int64_t, c10::string_view,"
        " const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, c10::string_view, bool, bool,"
        " c10::string_view) {}\n"
        f"TORCH_LIBRARY(attn_prologue_probe, m) {{ m.def({json.dumps(torch_op.QKV_SCHEMA)}); }}\n"
        'TORCH_LIBRARY_IMPL(attn_prologue_probe, CUDA, m) { m.impl("qnorm_rope_kv_insert", &empty); }\n'
        "TORCH_LIBRARY_IMPL(attn_prologue_probe, Autograd, m) {"
        ' m.impl("qnorm_rope_kv_insert", torch::CppFunction::makeFallthrough()); }\n'
    )
    cpp_extension.load_inline("attn_prologue_probe", source, is_python_module=False)
    return torch.ops.attn_prologue_probe.qnorm_rope_kv_insert


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--label", default="", help="a label stored with the numbers (e.g. the version)")
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--build-native", action="store_true", help="build the C++ torch-op kernels first")
    parser.add_argument(
        "--dispatch-floor",
        action="store_true",
        help="also time the torch op's schema with an empty C++ kernel",
    )
    args = parser.parse_args()
    if args.build_native:
        torch_op.load_native_kernels(build=True)

    h = p = 64
    d, bs, fmt = 512, 64, "fp8_ds_mla"
    g = torch.Generator(device="cuda").manual_seed(7)
    q_in = torch.randn(1, h, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, d, device="cuda", generator=g).bfloat16()
    q_out = torch.zeros(1, p, d, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(4, bs * get_format(fmt).bytes_per_token(d), device="cuda", dtype=torch.uint8)
    slots = torch.tensor([5], device="cuda")
    pos = torch.tensor([3], device="cuda")
    theta = torch.rand(64, 32, device="cuda", generator=g)
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=16, padded_heads=p, head_dim=d, micro_batches=1)
    pool.lock()
    bound = ap.bind(num_heads=h, padded_heads=p, head_dim=d, rope_dim=64, block_size=bs, pool=pool)
    bound_kv = ap.bind_kv(head_dim=d, rope_dim=64, block_size=bs)
    # the indexer's Q (H = 64, D = 128, FP8): no targets of its own; here for the bound op's gain
    iq = torch.randn(1, h, 128, device="cuda", generator=g).bfloat16()
    iw, icodes = iq[:, :, 0].contiguous(), torch.zeros(1, h, 128, device="cuda", dtype=torch.uint8)
    iw_out = torch.zeros(1, h, device="cuda")
    bound_iq = ap.bind_index_q(num_heads=h, softmax_scale=0.088, head_scale=0.125)
    x = torch.zeros(16, device="cuda")
    qkv_op, kv_op = torch.ops.attn_prologue.qnorm_rope_kv_insert, torch.ops.attn_prologue.kv_rope_insert
    qkv_default = qkv_op.default  # the overload itself: no overload resolution per call
    shape = ops.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs)
    fn, tail = shape.calls[0]
    calls = {
        "x.add_(1)": lambda: x.add_(1),
        "one-call function": lambda: ap.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs),
        "bound op": lambda: bound(q_in, kv, k_cache, slots, pos, cs),
        "torch op": lambda: qkv_op(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs),
        "torch op, .default overload": lambda: qkv_default(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs),
        "one-call kv function": lambda: ap.kv_rope_insert(kv, k_cache, slots, pos, cs, bs),
        "bound kv op": lambda: bound_kv(kv, k_cache, slots, pos, cs),
        "torch kv op": lambda: kv_op(kv, k_cache, slots, pos, cs, bs),
        "one-call index_q function": lambda: ap.index_q_rope_quant(iq, pos, cs, iw, 0.088, 0.125, icodes, iw_out),
        "bound index_q op": lambda: bound_iq(iq, pos, cs, iw, icodes, iw_out),
        "index_q torch op": lambda: torch.ops.attn_prologue.index_q_rope_quant(iq, pos, cs, iw, 0.088, 0.125, icodes, iw_out),
        "kernel alone (TVM-FFI, prebuilt arguments)": lambda: fn(q_in, kv, q_out, k_cache, slots, pos, cs, *tail),
    }  # fmt: skip
    if shape.native is not None:
        plan = shape.native
        calls["native plan alone (C checks + launch)"] = lambda: plan.qkv(
            q_in, kv, q_out, k_cache, slots, pos, cs, None, None
        )
        noop = noop_kernel()
        idle = native.fastpath().one_call_qkv_plan(
            [(noop, t) for _, t in shape.calls], bs * get_format(fmt).bytes_per_token(d), False, False
        )
        calls["native plan, no-op kernel (our C alone)"] = lambda: idle.qkv(
            q_in, kv, q_out, k_cache, slots, pos, cs, None, None
        )
    if args.dispatch_floor:
        empty_op = empty_torch_op()
        calls["torch op schema, empty C++ kernel (dispatch floor)"] = lambda: empty_op(
            q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs
        )
    for call in calls.values():
        loop_us(call, 200)  # warm up: bind, load, first launch, plans
    runs = {name: [] for name in calls}
    drains = {name: [] for name in calls}
    for i in range(args.loops):
        for name in calls if i % 2 == 0 else reversed(list(calls)):
            runs[name].append(loop_us(calls[name], args.calls, drains[name]))
    us = {name: statistics.median(v) for name, v in runs.items()}
    device_us = {name: graph_us(calls[name]) for name in ("x.add_(1)", "bound op", "bound kv op")}
    base = us["x.add_(1)"]
    ratios = {name: v / base for name, v in us.items()}
    targets = {
        name: {"ratio": ratios[name], "bound": bound_, "met": ratios[name] <= bound_}
        for name, bound_ in EAGER_TARGETS.items()
    }
    breakdown = {}
    if "native plan, no-op kernel (our C alone)" in us:
        plan_us, ours = (
            us["native plan alone (C checks + launch)"],
            us["native plan, no-op kernel (our C alone)"],
        )
        breakdown = {
            "our C and the Python call into it": ours,
            "the kernel's host code and the launch": plan_us - ours,
            "one-call function's Python": us["one-call function"] - plan_us,
            "torch op's binding, dispatch and C++ kernel body, beyond the plan": us["torch op"] - plan_us,
        }
    out = {
        "provenance": provenance(),
        "label": args.label,
        "native": {
            "fastpath": native.fastpath() is not None,
            "torch_op_cuda_kernels": torch_op.cuda_kernels(),
        },
        "us": us,
        "ratio_to_add": ratios,
        "targets": targets,
        "breakdown_us": breakdown,
        "device_us_per_call_in_a_graph": device_us,
        "drain_us_after_the_last_call": {name: statistics.median(v) for name, v in drains.items()},
        "runs_us": runs,
    }
    print(f"native fast path: {out['native']}")
    for name, v in us.items():
        t = targets.get(name)
        verdict = "" if t is None else f"  target <= {t['bound']:.1f}x: {'met' if t['met'] else 'MISSED'}"
        print(f"{name:44} {v:7.2f} us  {v / base:5.2f}x x.add_(1){verdict}")
    for name, v in breakdown.items():
        print(f"  {name:70} {v:6.2f} us")
    for name, v in device_us.items():
        print(f"  device time per call in a graph, {name:40} {v:6.2f} us")
    for name, v in out["drain_us_after_the_last_call"].items():
        print(f"  device ran on after the loop's last call, {name:40} {v:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
