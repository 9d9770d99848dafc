"""Every entry point against random calls (fixed seed, CPU): each refusal is a typed error raised before
anything is written, each valid call is accepted, and an accepted call's bytes are the reference's.

Calls: tests/support/fuzz_calls.py (a valid call of a random shape, or one with an edit that makes it
invalid), rebuilt from their seed for each entry point, so each gets fresh tensors. Entry points:
- the CPU implementations, which validate every call and run the PyTorch reference: the torch ops, the
  package functions on CPU tensors, the compat.vllm ops (torch op and plain callable). Every edit
  applies (bar the Python scalar types the torch ops' schema converts before our code runs); a valid
  call's q_out and k_cache must be the reference's bytes (both poisoned with random bytes first), and
  the CPU counters must grow by the rows the kernels would skip;
- the kernel paths with a stand-in kernel (tests/support/stub_kernels.py), in Python and through the C
  plans: the one-call functions and the bound ops. A valid call of the same shape comes first (so the
  edited one meets a cached shape's fast path, or a bound op's last accepted k_cache and table), then
  the call, with the edits the host code must refuse on every call (EDITS' kind True; the others are
  the compiled kernel's own argument checks on CUDA, which the stand-in does not do). A valid call must
  launch the kernel once (none for zero rows), a refused one never.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import torch
from attn_prologue import api, dispatch, ops, reference
from attn_prologue.compat import vllm
from attn_prologue.errors import AttnPrologueError

from .support.fuzz_calls import EDITS, Call, counts, make_call
from .support.stub_kernels import StubRuntime, _CpuPool, _cuda_claimed
from .support.vllm_cases import namespace

SEED, TRIALS = 2028, 480
QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format", "kv_scale", "q_scale")  # fmt: skip
KV = ("kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "block_size", "cache_format", "norm_weight",
      "eps", "kv_scale")  # fmt: skip
BOUND = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.device.type == "meta" else t.resolve_neg().contiguous().view(torch.uint8).clone()


def snapshot(c: Call) -> dict:
    return {k: _bits(v) for k, v in c.args.items() if isinstance(v, torch.Tensor)}


def changed(before: dict, c: Call) -> list[str]:
    return [k for k, b in before.items() if b is not None and not torch.equal(_bits(c.args[k]), b)]


def expected(c: Call) -> tuple:
    """(q_out, k_cache) bytes after the valid call c, from the reference on clones."""
    a = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.args.items()}
    if c.op == "kv":
        reference.kv_rope_insert(*(a[k] for k in KV[:7]), norm_weight=a["norm_weight"], eps=a["eps"],
                                 kv_scale=a["kv_scale"], compress_ratio=a["compress_ratio"])  # fmt: skip
        return None, _bits(a["k_cache"])
    if c.in_place:
        a["q_out"] = a["q_in"]
    reference.qnorm_rope_kv_insert(*(a[k] for k in QKV[:10]), kv_scale=a["kv_scale"], q_scale=a["q_scale"])
    return _bits(a["q_out"]), _bits(a["k_cache"])


# ---- the CPU implementations -------------------------------------------------------------------------
class Compat:
    """compat.vllm registrations: the caller-owned form per format it writes, made on first use."""

    def __init__(self):
        self.made: dict[str, vllm.VllmOps] = {}

    def __getitem__(self, fmt: str) -> vllm.VllmOps:
        if fmt not in self.made:
            self.made[fmt] = vllm.register(
                namespace(), form="q_out_third", cache_format=fmt, new_namespace=True
            )
        return self.made[fmt]


def reference_entries(c: Call, compat: Compat) -> dict:
    """name -> (what calls the CPU implementation on an argument dict, the arguments it passes: None for
    all) for the CPU implementations that take c's arguments."""
    out = {}
    if c.op == "qkv":
        out["torch op"] = (lambda a: torch.ops.attn_prologue.qnorm_rope_kv_insert(*(a[k] for k in QKV)), None)
        out["function"] = (lambda a: ops.qnorm_rope_kv_insert(*(a[k] for k in QKV)), None)
        if c.args["kv_scale"] is None and c.args["q_scale"] is None:  # the vLLM schemas take no scales
            r, passed = compat[c.fmt], set(QKV[:9])
            out["compat op"] = (lambda a: r.qkv_op(*(a[k] for k in QKV[:9])), passed)
            out["compat callable"] = (lambda a: r.qkv(*(a[k] for k in QKV[:9])), passed)
        return out
    ratio = c.args["compress_ratio"]
    out["torch op"] = (lambda a: torch.ops.attn_prologue.kv_rope_insert(*(a[k] for k in KV), "", ratio), None)
    out["function"] = (lambda a: ops.kv_rope_insert(*(a[k] for k in KV), compress_ratio=ratio), None)
    mxfp8 = {"fp8_ds_mla": False, "mxfp8": True, "fp8_tensor": False}.get(c.fmt)
    if c.args["norm_weight"] is None and ratio == 1 and mxfp8 is not None:  # what vLLM's KV-only op writes
        # (its format follows fp8_scale and kv_mxfp8: a scale given or dropped is another valid call)
        r, passed = compat["fp8_ds_mla"], set(KV[:6])
        out["compat op"] = (lambda a: r.kv_op(*(a[k] for k in KV[:6]), a["kv_scale"], mxfp8), passed)
        out["compat callable"] = (
            lambda a: r.kv_insert(*(a[k] for k in KV[:6]), a["kv_scale"], mxfp8),
            passed,
        )
    return out


def check_reference_paths(seed: int, op: str, edit_seed, compat: Compat, tally: Counter) -> None:
    c = make_call(seed, op, edit_seed)
    want = None if c.edits else expected(c)
    for name, (call, passed) in reference_entries(c, compat).items():
        if name == "compat op" and any(EDITS[e].kind == "scalar" for e in c.edits):
            continue  # vLLM's schema converts these before our code runs (ours refuse them first)
        if passed is not None and any(not set(EDITS[e].touches) <= passed for e in c.edits):
            continue  # the edit changed an argument this entry does not take
        x = make_call(seed, op, edit_seed)  # fresh tensors
        before, errors = snapshot(x), dispatch.CPU_ERRORS.clone()
        where = f"seed {seed}, {op} {name}, edits {x.edits}"
        try:
            call(x.args)
        except AttnPrologueError as exc:
            assert x.edits, f"{where}: a valid call was refused: {exc}"
            assert changed(before, x) == [], f"{where}: refused after writing {changed(before, x)}"
            assert torch.equal(dispatch.CPU_ERRORS, errors), f"{where}: a refused call counted rows"
            tally["reference refused"] += 1
            continue
        assert not x.edits, f"{where}: an invalid call was accepted"
        q_out, k_cache = want
        assert torch.equal(_bits(x.args["k_cache"]), k_cache), f"{where}: k_cache is not the reference's"
        if q_out is not None:
            assert torch.equal(_bits(x.args["q_out"]), q_out), f"{where}: q_out is not the reference's"
        written = {"k_cache", "q_out"} | ({"q_in"} if x.in_place else set())
        assert set(changed(before, x)) <= written, f"{where}: inputs changed"
        assert (dispatch.CPU_ERRORS - errors).tolist() == counts(x), f"{where}: skipped rows miscounted"
        tally["reference accepted"] += 1


# ---- the kernel paths with a stand-in kernel --------------------------------------------------------
def one_call(op: str, rt):
    if op == "qkv":
        return lambda a: ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    return lambda a: ops.kv_rope_insert(*(a[k] for k in KV), compress_ratio=a["compress_ratio"], runtime=rt)


def bound(twin: Call, rt):
    """A bound op for the twin's shape on CPU, as a call on an argument dict; None where bind cannot
    take it (a pool of FP8 scratch and Q in place are exclusive)."""
    a = twin.args
    d, dtype, bs = a["kv"].shape[1], a["kv"].dtype, a["block_size"]
    with _cuda_claimed():
        if twin.op == "kv":
            op = api.bind_kv(head_dim=d, cache_format=twin.fmt, dtype=dtype, block_size=bs,
                             norm_weight=a["norm_weight"], eps=a["eps"], kv_scale=a["kv_scale"],
                             compress_ratio=a["compress_ratio"], device="cuda:0", runtime=rt)  # fmt: skip
            return lambda x: op(*(x[k] for k in KV[:5]))
        h, p, q8 = a["q_in"].shape[1], a["q_out"].shape[1], a["q_scale"] is not None
        if twin.in_place != (p == h):
            return None  # P == H with a caller-owned q_out: the bound op would write in place instead
        pool = None
        if not twin.in_place:
            pool = _CpuPool(max(twin.n, 1), p, d, 1, dtype=torch.float8_e4m3fn if q8 else dtype)
        op = api.bind(num_heads=h, padded_heads=p, head_dim=d, cache_format=twin.fmt, dtype=dtype, block_size=bs,
                      pool=pool, eps=a["eps"], kv_scale=a["kv_scale"], q_scale=a["q_scale"], device="cuda:0",
                      runtime=rt)  # fmt: skip
    return lambda x: op(*(x[k] for k in BOUND))


def check_stub_paths(seed: int, op: str, edit_seed, runtimes: dict, tally: Counter) -> None:
    for native, rt in runtimes.items():
        twin = make_call(seed, op)
        for name, entry, passed in (
            ("one-call", one_call(op, rt), None),
            ("bound", bound(twin, rt), set(BOUND) if op == "qkv" else set(KV[:5])),
        ):
            if entry is None:
                continue
            twin = make_call(seed, op)
            entry(twin.args)  # a valid call of the shape: cached, or the bound op's state
            share = {k: twin.args[k] for k in ("k_cache", "cos_sin_cache")} if name == "bound" else None
            x = make_call(seed, op, edit_seed, allowed=(True,), passed=passed, share=share)
            before, launched = snapshot(x), rt.kernel.calls
            where = f"seed {seed}, {op} {name} {'native' if native else 'python'}, edits {x.edits}"
            try:
                entry(x.args)
            except AttnPrologueError as exc:
                assert x.edits, f"{where}: a valid call was refused: {exc}"
                assert rt.kernel.calls == launched, f"{where}: refused after launching"
                assert changed(before, x) == [], f"{where}: refused after writing {changed(before, x)}"
                tally["stub refused"] += 1
                continue
            assert not x.edits, f"{where}: an invalid call was accepted"
            rows = x.n if op == "qkv" else x.args["slot_mapping"].shape[0]
            assert rt.kernel.calls == launched + (rows > 0), f"{where}: not launched once"
            tally["stub accepted"] += 1


# ---- the fuzz ----------------------------------------------------------------------------------------
def test_every_entry_point_refuses_typed_before_writing_and_matches_the_reference_when_it_accepts():
    rng = random.Random(SEED)
    compat = Compat()
    runtimes = {False: StubRuntime(native=False), True: StubRuntime(native=True)}
    tally: Counter = Counter()
    start = time.perf_counter()
    try:
        for _ in range(TRIALS):
            seed, op = rng.randrange(2**31), rng.choice(("qkv", "kv"))
            edit_seed = rng.randrange(2**31) if rng.random() < 0.6 else None
            check_reference_paths(seed, op, edit_seed, compat, tally)
            check_stub_paths(seed, op, edit_seed, runtimes, tally)
    finally:
        for r in compat.made.values():
            r.close()
    seconds = time.perf_counter() - start
    assert all(shape.native is not None for shape in runtimes[True].calls.values()), "the C plans did not run"
    assert sum(tally.values()) >= 2800, tally
    for outcome in ("accepted", "refused"):  # both outcomes, on both kinds of path
        assert tally[f"reference {outcome}"] >= 200 and tally[f"stub {outcome}"] >= 200, tally
    assert seconds < 120, f"{seconds:.0f} s: keep the fuzz well under a minute on 2 cores"


# ---- the scratch pool ----------------------------------------------------------------------------------
POOL_VALUES = {  # the first value of each is valid; the others mostly not
    "max_tokens": (3, 1, 0, -1, 2.0, True, "4", None, 2**40),
    "padded_heads": (8, 4, 0, 8.0, True, None),
    "head_dim": (64, 32, 0, "64", 64.5),
    "micro_batches": (2, 1, 0, 2.5, "2"),
    "micro_batch": (0, 1, -1, "0", 1.0),
    "n_tokens": (2, 0, 3, -1, 1.5, True, 2**40),
    "live_heads": (4, 1, 0, 9, 2.0),
    "dtype": (torch.bfloat16, torch.float16, "bfloat16", None, torch.float32),
    "device": ("cpu", "cpu", "meta", "bogus", 7, None),
}
POOL_METHODS = {  # method -> its arguments (the first one positional where the method takes it so)
    "reserve": ("max_tokens", "padded_heads", "head_dim", "dtype", "micro_batches", "device"),
    "capacity": ("padded_heads", "head_dim", "dtype", "micro_batch", "device"),
    "buffer": ("padded_heads", "head_dim", "dtype", "micro_batch", "device"),
    "view": ("n_tokens", "padded_heads", "head_dim", "dtype", "micro_batch", "device"),
    "claim": ("live_heads", "padded_heads", "head_dim", "dtype", "micro_batch", "device"),
    "claim_micro_batches": ("live_heads", "micro_batches", "padded_heads", "head_dim", "dtype", "device"),
    "lock": (),
}
POSITIONAL = {"view": 1, "claim": 1, "claim_micro_batches": 2}


def _pool_state(pool) -> list:
    return sorted(
        ((str(k), id(b.tensor), b.tensor.shape[0], b.live_heads, b.q_layout, b.pads_written, b.tensor.sum().item())
         for k, b in pool._buffers.items()), key=str,
    ) + [pool.locked]  # fmt: skip


def test_the_scratch_pool_refuses_typed_and_changes_nothing_when_it_refuses():
    """Random calls of every ScratchPool method with valid and invalid sizes, dtypes, devices and
    micro-batches (CPU buffers): each returns or raises the package's typed error, and a refused call
    leaves every buffer, its claim and the lock as they were."""
    rng = random.Random(SEED + 1)
    tally: Counter = Counter()
    pool = api.ScratchPool()
    for trial in range(600):
        if trial % 60 == 0:
            pool.release()
        method = rng.choice(list(POOL_METHODS))
        names = POOL_METHODS[method]
        values = {
            n: POOL_VALUES[n][0 if rng.random() < 0.6 else rng.randrange(len(POOL_VALUES[n]))] for n in names
        }
        k = POSITIONAL.get(method, 0)
        args, kwargs = [values[n] for n in names[:k]], {n: values[n] for n in names[k:]}
        before = _pool_state(pool)
        try:
            getattr(pool, method)(*args, **kwargs)
        except AttnPrologueError:
            assert _pool_state(pool) == before, f"trial {trial}: {method}({values}) refused after a change"
            tally["refused"] += 1
            continue
        tally["accepted"] += 1
    assert tally["refused"] >= 100 and tally["accepted"] >= 100, tally
