"""Lazily negated or conjugated views are refused on every call (issue 51, item 3), not only on a shape's
first: a cached shape's hot path (Python, and C through torch's DLPack exchange API, which hands the
view over as its stored bits) and both bound ops' hot paths, before anything is written. The stand-in
kernels (tests/support/stub_kernels.py) count their calls and write a byte of each written buffer."""

from __future__ import annotations

import pytest
import torch
from attn_prologue import native, ops
from attn_prologue.errors import InputError

from .support.bad_inputs import BS, KV_ARGS, H, snapshot, unchanged, valid, valid_kv
from .support.stub_kernels import StubRuntime, stub_bind, stub_bind_kv

pytestmark = pytest.mark.tvm_ffi  # CI runs this file under every pinned TVM-FFI (.ci/run)

QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format")  # fmt: skip
BOUND = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
NATIVE = pytest.mark.parametrize("native", [False, True], ids=["python", "native"])


@pytest.fixture(params=["exchange API", "as_is"])
def reader(request):
    """The C module's tensor reader: torch's DLPack exchange API alone (what it uses without the C++
    torch-op library), or as this process has it."""
    fp = native.fastpath()
    if request.param == "exchange API" and fp is not None:
        fp.set_unpacker(0)
        yield request.param
        fp.set_unpacker(native._tensor_reader)
    else:
        yield request.param


def negated(t: torch.Tensor) -> torch.Tensor:
    """A lazily negated view with the values of t (its stored bits are -t's)."""
    return torch._neg_view(-t if t.dtype != torch.uint8 else t)


def _refused(call, args: dict, name: str, rt) -> None:
    calls = rt.kernel.calls
    before = snapshot({k: v for k, v in args.items() if k != name})
    with pytest.raises(InputError, match=rf"{name} is a lazily negated view.*resolve_neg"):
        call(args)
    assert rt.kernel.calls == calls and unchanged(before, args) == []


@NATIVE
@pytest.mark.parametrize(
    "name", ["q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache"]
)
def test_a_cached_shapes_call_refuses_a_lazily_negated_view(native, name, reader):
    rt = StubRuntime(native=native)
    a = valid("cpu")
    ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)  # the shape is cached now
    a = valid("cpu")
    a[name] = negated(a[name])
    _refused(lambda x: ops.qnorm_rope_kv_insert(*(x[k] for k in QKV), runtime=rt), a, name, rt)


@NATIVE
@pytest.mark.parametrize(
    "name", ["kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "norm_weight"]
)
def test_a_cached_kv_shapes_call_refuses_a_lazily_negated_view(native, name, reader):
    rt = StubRuntime(native=native)
    a = valid_kv("cpu")
    ops.kv_rope_insert(*(a[k] for k in KV_ARGS), runtime=rt)
    a = valid_kv("cpu")
    a[name] = negated(a[name])
    _refused(lambda x: ops.kv_rope_insert(*(x[k] for k in KV_ARGS), runtime=rt), a, name, rt)


@NATIVE
@pytest.mark.parametrize("name", ["q_in", "kv", "slot_mapping", "positions"])
def test_a_bound_op_refuses_a_lazily_negated_view_on_every_call(native, name, reader):
    """k_cache and cos_sin_cache: another object than the last call's takes the full check anyway."""
    rt = StubRuntime(native=native)
    op = stub_bind(runtime=rt, num_heads=H, block_size=BS)  # Q in place
    a = valid("cpu")
    a["q_in"] = a["q_in"][:, :H].contiguous()
    op(*(a[k] for k in BOUND))
    op(*(a[k] for k in BOUND))  # (the native plan is made on the first call, used from the second)
    a[name] = negated(a[name])
    _refused(lambda x: op(*(x[k] for k in BOUND)), a, name, rt)


@NATIVE
@pytest.mark.parametrize("name", ["kv", "slot_mapping", "positions", "cos_sin_cache"])
def test_a_bound_kv_op_refuses_a_lazily_negated_view_on_every_call(native, name, reader):
    rt = StubRuntime(native=native)
    op = stub_bind_kv(runtime=rt, block_size=BS)
    a = valid_kv("cpu")
    op(*(a[k] for k in KV_ARGS[:5]))
    op(*(a[k] for k in KV_ARGS[:5]))
    a[name] = negated(a[name])
    _refused(lambda x: op(*(x[k] for k in KV_ARGS[:5])), a, name, rt)


def test_the_c_module_refuses_a_complex_tensor_where_a_conjugation_bit_can_live(reader):
    """Read through the exchange API a conjugated view is its stored bits too; a conjugation bit exists
    only on complex tensors, which no kernel takes: the plan refuses them, the Python path names it."""
    rt = StubRuntime(native=True)
    a = valid("cpu")
    ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    a = valid("cpu")
    a["positions"] = torch.complex(a["positions"].double(), a["positions"].double()).conj()
    calls = rt.kernel.calls
    with pytest.raises(InputError, match=r"positions is a lazily conjugated view.*resolve_conj"):
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    assert rt.kernel.calls == calls
