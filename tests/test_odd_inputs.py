"""Odd inputs get typed errors before anything is written, on CPU: lazily negated or conjugated views,
an empty cache or rope table, meta tensors in any argument, a bool, float or infinite scalar (also
where a cached shape's fast path would have taken it: True == 1, 16.0 == 16), bind and pool sizes that
are not positive ints, a refused bind's claims, a read-only kernel cache's miss, a bound KV op's rope
dim. Also: the CPU implementations count skipped rows where the kernels do, errors name the device in
hand, and bind's arguments are visible to help() and IDEs."""

from __future__ import annotations

import inspect
import math

import attn_prologue as ap
import pytest
import torch
from attn_prologue import api, dispatch, ops
from attn_prologue.errors import InputError, ScratchError
from attn_prologue.jit.kernel_cache import KernelCache, KernelLoadError
from attn_prologue.variants import ArchFamily, IoDtype, Op, Request, find

from .support.bad_inputs import BS, KV_ARGS, D, H, N, P, snapshot, unchanged, valid, valid_kv
from .support.stub_kernels import StubRuntime, _cuda_claimed, stub_bind, stub_bind_kv

QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format")  # fmt: skip
BOUND = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
KV = KV_ARGS[:5]
ENTRIES = {  # the CPU entry points: every call validates, then runs the reference
    "torch op": lambda a: torch.ops.attn_prologue.qnorm_rope_kv_insert(*(a[k] for k in QKV)),
    "function": lambda a: ap.qnorm_rope_kv_insert(*(a[k] for k in QKV)),
    "kv torch op": lambda a: torch.ops.attn_prologue.kv_rope_insert(*(a[k] for k in KV_ARGS), a["eps"]),
    "kv function": lambda a: ap.kv_rope_insert(*(a[k] for k in KV), a["block_size"], a["cache_format"],
                                               norm_weight=a["norm_weight"], eps=a["eps"]),
}  # fmt: skip


def args_for(entry: str) -> dict:
    return valid_kv("cpu") if entry.startswith("kv") else valid("cpu")


def cases(names) -> list:
    """(entry, argument) for each entry point and each of `names` it takes."""
    return [(e, n) for e in sorted(ENTRIES) for n in names if n in args_for(e)]


def refused(entry: str, a: dict, match: str) -> None:
    """The call raises an InputError matching `match` and no tensor changed."""
    before = snapshot(a)
    with pytest.raises(InputError, match=match):
        ENTRIES[entry](a)
    assert unchanged(before, a) == []


# ---- lazily negated and conjugated views (issue 28, item 9) ----------------------------------------
def _conj_imag(t: torch.Tensor) -> torch.Tensor:
    """A float32 t's values as the imaginary part of a conjugated complex tensor (a negated view)."""
    return torch.complex(torch.zeros_like(t), -t).conj().imag


@pytest.mark.parametrize(
    "entry, name",
    cases(["kv", "positions", "cos_sin_cache", "q_in", "slot_mapping", "norm_weight", "q_out", "k_cache"]),
)
def test_a_lazily_negated_view_is_refused_naming_it(entry, name):
    """Through the torch ops (which the functions call on CPU) as on the kernel path: refused, naming
    the argument and the fix (torch's own fallback for the bit would resolve an input by a copy, and
    fails untyped on a written argument: "Expected Tensor but got None", torch 2.13)."""
    a = args_for(entry)
    base = a[name]
    a[name] = torch._neg_view(base)
    before = snapshot({k: v for k, v in a.items() if k != name}) | {"base": base.clone()}
    with pytest.raises(InputError, match=rf"{name} is a lazily negated view.*{name}\.resolve_neg\(\)"):
        ENTRIES[entry](a)
    assert unchanged(before, a | {"base": base}) == []


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("name", ["kv", "positions", "cos_sin_cache", "q_out", "k_cache"])
def test_the_validation_of_the_kernel_path_refuses_a_lazily_negated_view(native, name):
    """The kernels read stored bits: the direct path (here with a stand-in kernel) validates a shape's
    first call, which refuses the view naming the fix, and launches nothing."""
    rt = StubRuntime(native=native)
    a = valid("cpu")
    base = a[name]
    a[name] = torch._neg_view(-base if base.dtype != torch.uint8 else base)
    with pytest.raises(InputError, match=rf"{name} is a lazily negated view.*{name}\.resolve_neg\(\)"):
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    assert rt.kernel.calls == 0


def test_the_imaginary_part_of_a_conjugated_tensor_is_a_negated_view_and_refused():
    """How a negated view arises without private functions: cos/sin from complex exponentials."""
    a = valid("cpu")
    cs = _conj_imag(a["cos_sin_cache"])
    assert cs.is_neg() and torch.equal(cs, a["cos_sin_cache"])
    a["cos_sin_cache"] = cs
    rt = StubRuntime()
    with pytest.raises(InputError, match=r"cos_sin_cache\.resolve_neg\(\)"):
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    assert rt.kernel.calls == 0


def test_a_conjugated_tensor_is_refused_naming_the_fix():
    a = valid("cpu")
    a["q_in"] = torch.complex(a["q_in"].float(), a["q_in"].float()).conj()
    rt = StubRuntime()
    with pytest.raises(InputError, match=r"q_in is a lazily conjugated view.*q_in\.resolve_conj\(\)"):
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)


# ---- an empty cache or rope table (item 10) --------------------------------------------------------
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("what", ["k_cache without blocks", "cos_sin_cache without rows"])
def test_an_empty_cache_or_table_is_refused_before_anything_is_written(entry, what):
    a = args_for(entry)
    name = what.split()[0]
    a[name] = a[name][:0]
    refused(entry, a, "no blocks" if name == "k_cache" else "no rows")


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("what", ["k_cache", "cos_sin_cache"])
def test_an_empty_cache_or_table_is_refused_on_a_cached_shape(native, what):
    rt = StubRuntime(native=native)
    a, k = valid("cpu"), valid_kv("cpu")
    ops.qnorm_rope_kv_insert(*(a[n] for n in QKV), runtime=rt)
    ops.kv_rope_insert(*(k[n] for n in KV_ARGS), runtime=rt)
    for args, call in (
        (a, lambda x: ops.qnorm_rope_kv_insert(*(x[n] for n in QKV), runtime=rt)),
        (k, lambda x: ops.kv_rope_insert(*(x[n] for n in KV_ARGS), runtime=rt)),
    ):
        args[what] = args[what][:0]
        before, calls = snapshot(args), rt.kernel.calls
        with pytest.raises(InputError, match="no blocks|no rows"):
            call(args)
        assert rt.kernel.calls == calls and unchanged(before, args) == []


# ---- meta tensors and device mixes (item 11) -------------------------------------------------------
@pytest.mark.parametrize(
    "entry, name", cases(["q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache"])
)
def test_a_meta_tensor_in_any_argument_is_refused_naming_it(entry, name):
    """The dispatcher picks the meta (fake) kernel for a call with any meta argument: it refuses."""
    a = args_for(entry)
    a[name] = a[name].to("meta")
    before = snapshot({k: v for k, v in a.items() if k != name})
    with pytest.raises(InputError, match=rf"{name} is (a meta tensor|on meta)"):
        ENTRIES[entry](a)
    assert unchanged(before, a) == []


def test_every_tensor_on_meta_is_refused_too():
    a = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in valid("cpu").items()}
    with pytest.raises(InputError, match="meta"):
        ENTRIES["torch op"](a)


# ---- scalars (item 14) -----------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["function", "kv function"])
@pytest.mark.parametrize("name, value", [("block_size", True), ("block_size", 16.0), ("eps", True),
                                         ("eps", math.inf), ("eps", math.nan)])  # fmt: skip
def test_bool_float_and_non_finite_scalars_are_refused(entry, name, value):
    """(Through torch.ops directly the schema converts a bool to 1 and refuses a float block_size with
    its own RuntimeError before any of our code runs.)"""
    a = args_for(entry)
    a[name] = value
    refused(entry, a, name)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("name, good, bad", [("block_size", 1, True), ("block_size", BS, float(BS)),
                                             ("eps", 1, True)])  # fmt: skip
def test_a_cached_shape_of_an_equal_int_does_not_take_a_bool_or_float(native, name, good, bad):
    """True == 1 and 16.0 == 16 in Python: a shape cached for the int must not serve the others."""
    rt = StubRuntime(native=native)
    for build in (valid, valid_kv):
        a = build("cpu")
        a[name] = good
        if build is valid:
            call = lambda x: ops.qnorm_rope_kv_insert(*(x[k] for k in QKV), runtime=rt)  # noqa: E731
        else:
            call = lambda x: ops.kv_rope_insert(*(x[k] for k in KV_ARGS), eps=x["eps"], runtime=rt)  # noqa: E731
        call(a)
        calls = rt.kernel.calls
        a[name] = bad
        before = snapshot(a)
        with pytest.raises(InputError, match=name):
            call(a)
        assert rt.kernel.calls == calls and unchanged(before, a) == []


# ---- bind and the pool (item 14) -------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(num_heads=0), dict(num_heads=-4), dict(padded_heads=0), dict(block_size=0),
                                dict(block_size=-16), dict(block_size=True), dict(head_dim=0), dict(micro_batches=0),
                                dict(eps=math.inf), dict(eps=True)], ids=str)  # fmt: skip
def test_bind_refuses_sizes_that_are_not_positive_ints(kw):
    args = dict(num_heads=H, block_size=BS) | kw
    with pytest.raises(InputError, match=next(iter(kw))):
        stub_bind(runtime=StubRuntime(), **args)


@pytest.mark.parametrize(
    "kw", [dict(block_size=0), dict(head_dim=-1), dict(rope_dim=0), dict(eps=math.nan)], ids=str
)
def test_bind_kv_refuses_sizes_that_are_not_positive_ints(kw):
    with pytest.raises(InputError, match=next(iter(kw))):
        stub_bind_kv(runtime=StubRuntime(), **(dict(block_size=BS) | kw))


class _Owner:
    def invalidate(self, reason):
        pass


def test_a_refused_claim_of_several_micro_batches_leaves_no_claim_behind():
    """Two micro-batches on a pool reserved for one: refused (no buffer for the second), and the first
    buffer is left as it was: not zero-once for this H (another H can claim it), this owner not told."""
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1, device="cpu")
    owner = _Owner()
    with pytest.raises(ScratchError, match="micro_batch=1"):
        pool.claim_micro_batches(H, 2, owner=owner, padded_heads=P, head_dim=D, device="cpu")
    pool.claim(H + 1, padded_heads=P, head_dim=D, device="cpu")
    assert owner not in pool._buffers[pool._key("cpu", 0, torch.bfloat16, P, D)].claimants


def test_a_refused_bind_leaves_no_claim_behind():
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1, device="cpu")

    class CpuPool:  # bind's claims, on the CPU pool
        def claim_micro_batches(self, live_heads, micro_batches, **key):
            return pool.claim_micro_batches(live_heads, micro_batches, **dict(key, device="cpu"))

    with _cuda_claimed(), pytest.raises(ScratchError, match="micro_batch=1"):
        api.bind(num_heads=H, padded_heads=P, block_size=BS, pool=CpuPool(), micro_batches=2, device="cuda:0",
                 runtime=StubRuntime())  # fmt: skip
    pool.claim(H + 1, padded_heads=P, head_dim=D, device="cpu")  # the first buffer is free for another H


@pytest.mark.parametrize("live_heads", [P + 1, 100, 0, -1, True, 2.0])
def test_claim_refuses_a_head_count_outside_the_buffer(live_heads):
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1, device="cpu")
    with pytest.raises(ScratchError, match="live_heads"):
        pool.claim(live_heads, padded_heads=P, head_dim=D, device="cpu")


@pytest.mark.parametrize("kw", [dict(max_tokens=2.5), dict(max_tokens=True), dict(padded_heads=8.0),
                                dict(micro_batches=0), dict(head_dim=-1)], ids=str)  # fmt: skip
def test_reserve_refuses_sizes_that_are_not_positive_ints(kw):
    args = dict(max_tokens=N, padded_heads=P, head_dim=D, micro_batches=1, device="cpu") | kw
    with pytest.raises(ScratchError, match=next(iter(kw))):
        ap.ScratchPool().reserve(**args)


def test_a_miss_in_a_read_only_cache_is_a_typed_error(tmp_path):
    """A shared (read-only) cache that lacks a kernel: the dispatcher's load raises KernelLoadError,
    not the cache's FileNotFoundError."""
    facts = dispatch.DeviceFacts(0, "NVIDIA H200", (9, 0), ArchFamily.SM90, "sm_90a", 132, "h200")
    rt = dispatch.Runtime(cache=KernelCache(tmp_path, trust="shared", prebuilt=[]), device_facts=lambda i: facts,
                          tuning_db=tmp_path / "none.json")  # fmt: skip
    v = find(Request(Op.QKV, D, 64, "fp8_ds_mla", IoDtype.BF16), ArchFamily.SM90)
    with pytest.raises(KernelLoadError, match="shared cache"):
        rt.launcher(v, v.arch.default_config, 0)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_the_bound_kv_op_pins_the_rope_dim_and_refuses_an_empty_table(native):
    rt = StubRuntime(native=native)
    op = stub_bind_kv(runtime=rt, block_size=BS)
    a = valid_kv("cpu")
    op(*(a[k] for k in KV))
    for table in (
        a["cos_sin_cache"][:, :32].contiguous(),
        a["cos_sin_cache"][:0],
    ):
        before, calls = snapshot(a), rt.kernel.calls
        with pytest.raises(InputError, match="cos_sin_cache"):
            op(*(a[k] for k in KV[:4]), table)
        assert rt.kernel.calls == calls and unchanged(before, a) == []


def test_a_bound_op_pins_its_head_dim_and_dtype_in_place():
    rt = StubRuntime()
    op = stub_bind(runtime=rt, num_heads=H, block_size=BS)  # in place: q_out is q_in
    a = valid("cpu")
    op(*(a[k] for k in BOUND))
    # fp16 tensors and a new cache object (the full check runs: the compiled function checks the dtypes
    # of a call that does not take it, which the stand-in does not)
    a["q_in"], a["kv"], a["k_cache"] = a["q_in"].half(), a["kv"].half(), a["k_cache"].clone()
    with pytest.raises(InputError, match="q_in must be"):
        op(*(a[k] for k in BOUND))
    assert rt.kernel.calls == 1


# ---- the CPU counters of skipped rows (issue 29, item 5) --------------------------------------------
@pytest.mark.parametrize("entry", ["torch op", "function"])
def test_the_cpu_path_counts_skipped_rows_as_the_kernels_do(entry):
    """docs/op.md's table: a KV row with slot >= 0 past the cache or a position outside the table counts
    in errors[0]; a Q token with a position outside the table in errors[1]; a negative slot never."""
    a = valid("cpu")
    capacity = a["k_cache"].shape[0] * BS
    a["slot_mapping"] = torch.tensor([3, capacity, 17, 2**36, 5, 63, -1, 7, 9, 11, 13, 15])
    a["positions"][2] = -1  # KV row 2 (slot 17) and Q token 2
    a["positions"][4] = a["cos_sin_cache"].shape[0]  # KV row 4 (slot 5) and Q token 4
    a["positions"][6] = -5  # Q token 6 only: its slot is negative
    counters = ap.default_runtime().errors_buffer("cpu")
    before = counters.clone()
    ENTRIES[entry](a)
    assert (counters - before).tolist() == [4, 3]  # KV rows 1, 2, 3, 4; Q tokens 2, 4, 6
    assert dispatch.Runtime().errors_buffer(torch.device("cpu")) is counters  # one pair per process


def test_the_kv_only_cpu_path_counts_skipped_rows():
    a = valid_kv("cpu")
    a["slot_mapping"] = a["slot_mapping"].clone()
    a["slot_mapping"][0] = a["k_cache"].shape[0] * BS
    a["positions"][1] = -1
    counters = ap.default_runtime().errors_buffer("cpu")
    before = counters.clone()
    ENTRIES["kv torch op"](a)
    assert (counters - before).tolist() == [2, 0]


# ---- error wording for the device in hand, and help() ----------------------------------------------
def test_a_cpu_call_s_errors_do_not_speak_of_cuda():
    a = valid("cpu")
    a["cache_format"] = "fp8_tensor"
    a["k_cache"] = torch.zeros(4, BS * D, dtype=torch.uint8)
    with pytest.raises(InputError) as info:
        ENTRIES["torch op"](a)
    assert "kv_scale" in str(info.value) and "CUDA" not in str(info.value) and "cpu" in str(info.value)


@pytest.mark.parametrize("fn, impl", [(ap.bind, api.BoundOp), (ap.bind_kv, api.BoundKvOp)])
def test_bind_shows_its_arguments_to_help_and_ides(fn, impl):
    """Explicit keyword-only parameters, the same as the bound op's constructor (so neither drifts), each
    named in the docstring."""
    params = inspect.signature(fn).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert list(params) == [n for n in inspect.signature(impl).parameters]
    assert [p.default for p in params.values()] == [
        p.default for p in inspect.signature(impl).parameters.values()
    ]
    missing = [n for n in params if n not in fn.__doc__ and not (fn is ap.bind_kv and n in ap.bind.__doc__)]
    assert missing == []
