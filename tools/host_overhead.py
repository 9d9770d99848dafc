"""Where the host time of one eager T=1 call goes, on a GPU machine.

  python tools/host_overhead.py [--json out.json]

Timed back to back (the device work of a T=1 call is ~2 us, so the host is the bottleneck), each
case twice in alternating order, median of 5 x 2000 calls:
- the one-call function and the bound op (what `bench` reports as host overhead);
- the compiled TVM-FFI function called directly with prebuilt arguments (the launch path alone);
- the two Python paths with the kernel replaced by a no-op Python function (our code alone).
With --after-bench, the same again after the `bench` target shapes ran in this process.
`tools/launch_floor.cu` measures the CUDA launch itself without Python (build it with nvcc).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument(
        "--after-bench",
        action="store_true",
        help="measure again after timing the bench's target shapes with baselines (what `bench` does "
        "before its host measurement), then after gc.freeze()",
    )
    a = ap.parse_args()

    import dataclasses

    from attn_prologue import api, dispatch, ops
    from attn_prologue.lab import bench, shape_sets
    from attn_prologue.lab.provenance import provenance
    from attn_prologue.lab.timing import host_time_us

    origin = provenance()

    def timed(call) -> float:
        return host_time_us(call, warmup=200)

    shape = bench.Shape(n=1)
    host = bench.host_calls(shape)
    args, bound, bargs = host.args, host.bound, host.bound_args

    def noop(*_):
        pass

    stub = api.bind(
        num_heads=shape.h,
        padded_heads=shape.p,
        head_dim=shape.head_dim,
        rope_dim=shape.rope_dim,
        cache_format=shape.cache_format,
        block_size=shape.block_size,
        pool=bound.pool,
    )
    stub._calls = [(noop, tail) for _, tail in stub._calls]
    stub(*bargs)
    # the same one-call path on a runtime of its own whose shape's calls are no-ops
    stub_runtime = dispatch.Runtime()
    ops.qnorm_rope_kv_insert(*args, runtime=stub_runtime)
    for key, calls in stub_runtime.calls.items():
        stub_runtime.calls[key] = dataclasses.replace(
            calls, calls=tuple((noop, tail) for _, tail in calls.calls)
        )

    def one_call_stub():
        return timed(lambda: ops.qnorm_rope_kv_insert(*args, runtime=stub_runtime))

    cases = {
        "one-call function": lambda: timed(lambda: ops.qnorm_rope_kv_insert(*args)),
        "bound op": lambda: timed(lambda: bound(*bargs)),
        "bare TVM-FFI call (13 arguments)": lambda: timed(lambda: host.fn(*host.raw)),
        "one-call function, kernel call replaced by a no-op": one_call_stub,
        "bound op, kernel call replaced by a no-op": lambda: timed(lambda: stub(*bargs)),
        "no-op Python call (13 arguments)": lambda: timed(lambda: noop(*host.raw)),
    }

    def measure(label: str) -> dict:
        runs = {name: [] for name in cases}
        for order in (list(cases), list(reversed(cases))):
            for name in order:
                runs[name].append(cases[name]())
        print(f"-- {label}")
        for name, v in runs.items():
            print(f"{name:55} {min(v):7.2f} us   (runs: {', '.join(f'{x:.2f}' for x in v)})")
        return {"us": {name: round(min(v), 3) for name, v in runs.items()}, "runs": runs}

    out = {"provenance": origin, **measure("fresh process")}
    if a.after_bench:
        import gc

        t0 = time.perf_counter()
        for sh in shape_sets.default_shapes("targets"):
            bench.run_shape(sh, replays=5)
        out["bench_seconds"] = round(time.perf_counter() - t0, 1)
        out["python_objects_after_bench"] = len(gc.get_objects())
        out["after_bench"] = measure(
            f"after the target shapes with baselines ({out['bench_seconds']} s, "
            f"{out['python_objects_after_bench']} Python objects)"
        )
        gc.collect()
        gc.freeze()
        out["after_bench_gc_frozen"] = measure("after gc.collect(); gc.freeze()")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
