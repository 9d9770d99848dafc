"""Two per-call costs of the native parts, on CPU (no GPU needed), each an A/B in one process:

- reader: a one-call plan with a no-op TVM-FFI kernel (tools/noop_ffi_kernel.c), its tensors read by
  the C++ torch-op library's in-place reader or by torch's DLPack exchange API (what the C module
  uses without that library);
- dispatch: the torch op's schema with an empty C++ CPU kernel and the Autograd fallthroughs, the
  kernel unboxed (16 C++ parameters) or boxed (the arguments read off the dispatcher's stack).

T=1, H=P=64, D=512 CPU tensors; median of interleaved loops. Absolute numbers move with the machine;
compare the pairs.

    python tools/native_cpu_cost.py [--loops 9] [--calls 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from attn_prologue import native, torch_op
from attn_prologue.lab.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_ratio import noop_kernel  # noqa: E402

SIGNATURE = (
    "const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,"
    " const at::Tensor&, double, int64_t, c10::string_view, const std::optional<at::Tensor>&,"
    " const std::optional<at::Tensor>&, c10::string_view, bool, bool, c10::string_view"
)


def empty_ops():
    """The schema twice (namespaces attn_prologue_unboxed / _boxed), each with an empty CPU kernel."""
    from torch.utils import cpp_extension

    schema = json.dumps(torch_op.QKV_SCHEMA)
    source = [
        "#include <torch/library.h>",
        "#include <ATen/core/Tensor.h>",
        "#include <ATen/core/stack.h>",
        f"void unboxed({SIGNATURE}) {{}}",
        "void boxed(const c10::OperatorHandle&, torch::jit::Stack* stack) { torch::jit::drop(*stack, 16); }",
    ]
    for ns, kernel in (
        ("unboxed", "&unboxed"),
        ("boxed", "torch::CppFunction::makeFromBoxedFunction<&boxed>()"),
    ):
        source += [
            f"TORCH_LIBRARY(attn_prologue_{ns}, m) {{ m.def({schema}); }}",
            f'TORCH_LIBRARY_IMPL(attn_prologue_{ns}, CPU, m) {{ m.impl("qnorm_rope_kv_insert", {kernel}); }}',
            f"TORCH_LIBRARY_IMPL(attn_prologue_{ns}, Autograd, m) {{"
            ' m.impl("qnorm_rope_kv_insert", torch::CppFunction::makeFallthrough()); }',
        ]
    cpp_extension.load_inline("attn_prologue_empty_ops", "\n".join(source), is_python_module=False,
                              extra_cflags=["-O2"])  # fmt: skip
    return (
        torch.ops.attn_prologue_unboxed.qnorm_rope_kv_insert,
        torch.ops.attn_prologue_boxed.qnorm_rope_kv_insert,
    )


def loop_ns(call, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    torch_op.load_native_kernels(build=True)  # (a no-op where import loaded them)
    if torch_op.cuda_kernels() != "C++" or native.fastpath() is None:
        sys.exit("the native parts are not available here (ATTN_PROLOGUE_NATIVE=0, or no compiler)")
    fp = native.fastpath()
    reader = native._tensor_reader
    h = p = 64
    d, bs, need = 512, 64, 64 * 656
    q_in, kv = torch.randn(1, h, d).bfloat16(), torch.randn(1, d).bfloat16()
    q_out, k_cache = torch.zeros(1, p, d).bfloat16(), torch.zeros(4, need, dtype=torch.uint8)
    slots, pos, cs = torch.tensor([5]), torch.tensor([3]), torch.rand(64, 64)
    plan = fp.one_call_qkv_plan([(noop_kernel(), (1, 2.0))] * fp.buckets(), need, False, False)
    unboxed, boxed = empty_ops()

    def with_reader():
        fp.set_unpacker(reader)

    def without_reader():
        fp.set_unpacker(0)

    def plan_call():
        return plan.qkv(q_in, kv, q_out, k_cache, slots, pos, cs, None, None)

    entries = {  # name -> (setup before each loop, call)
        "no-op plan, in-place reader": (with_reader, plan_call),
        "no-op plan, DLPack exchange API": (without_reader, plan_call),
        "empty torch op, unboxed kernel": (with_reader, lambda: unboxed(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs)),
        "empty torch op, boxed kernel": (with_reader, lambda: boxed(q_in, kv, q_out, k_cache, slots, pos, cs, 1e-6, bs)),
    }  # fmt: skip
    for setup, call in entries.values():
        setup()
        assert call() in (True, None)  # the plan launched (its no-op kernel); the ops returned ()
        loop_ns(call, 2000)
    runs = {name: [] for name in entries}
    for i in range(args.loops):
        for name in entries if i % 2 == 0 else reversed(list(entries)):
            setup, call = entries[name]
            setup()
            runs[name].append(loop_ns(call, args.calls))
    with_reader()
    ns = {name: statistics.median(v) for name, v in runs.items()}
    for name, v in ns.items():
        print(f"{name:34} {v:7.0f} ns")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": provenance(), "ns": ns, "runs_ns": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
