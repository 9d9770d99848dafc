"""Odd inputs on the GPU (tests/test_odd_inputs.py, test_lazy_views.py are the CPU side): a lazily negated
view is refused on a shape's first call and on its later calls (read through the C++ torch-op library's
reader or torch's DLPack exchange API), by the torch op and by both bound ops on every call; an
empty cache or table on a cached shape and on a bound op; a bound KV op's rope dim; and the CPU
implementation counts skipped rows as the kernels do."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue import dispatch, ops
from attn_prologue.errors import InputError

from ..support.bad_inputs import BS, KV_ARGS, snapshot, unchanged, valid, valid_kv

pytestmark = pytest.mark.gpu
QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format")  # fmt: skip


@pytest.mark.parametrize("cached", [False, True], ids=["first call", "cached shape"])
@pytest.mark.parametrize("name", ["kv", "positions", "cos_sin_cache"])
def test_a_lazily_negated_view_is_refused_and_never_read_as_its_bits(cached, name):
    rt = dispatch.Runtime()
    if cached:
        a = valid("cuda")
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    a = valid("cuda")
    a[name] = torch._neg_view(-a[name])
    before = snapshot({k: v for k, v in a.items() if k != name})
    with pytest.raises(InputError, match=rf"{name} is a lazily negated view"):
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    torch.cuda.synchronize()
    assert unchanged(before, a) == []


@pytest.mark.parametrize("reader", ["as loaded", "exchange API"])
@pytest.mark.parametrize("entry", ["function", "torch op", "bound op", "bound kv op"])
def test_a_lazily_negated_view_is_refused_on_every_call_of_a_cached_shape(entry, reader):
    """Issue 51, item 3: the later calls of a shape (the C plan, the Python hot paths, both bound ops)."""
    from attn_prologue import native

    fp = native.fastpath()
    if reader == "exchange API" and fp is not None:
        fp.set_unpacker(0)
    try:
        a = valid_kv("cuda") if entry == "bound kv op" else valid("cuda")
        if entry == "bound op":
            op = ap.bind(num_heads=4, head_dim=512, block_size=BS)  # Q in place
            a["q_in"] = a["q_in"][:, :4].contiguous()
            names = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
            call = lambda x: op(*(x[k] for k in names))  # noqa: E731
        elif entry == "bound kv op":
            op = ap.bind_kv(block_size=BS)
            call = lambda x: op(*(x[k] for k in KV_ARGS[:5]))  # noqa: E731
        elif entry == "torch op":
            call = lambda x: torch.ops.attn_prologue.qnorm_rope_kv_insert(*(x[k] for k in QKV))  # noqa: E731
        else:
            call = lambda x: ap.qnorm_rope_kv_insert(*(x[k] for k in QKV))  # noqa: E731
        for _ in range(3):  # the first call validates and caches; later ones take the hot paths
            call(a)
        a["kv"] = torch._neg_view(-a["kv"])
        before = snapshot({k: v for k, v in a.items() if k != "kv"})
        with pytest.raises(InputError, match="kv is a lazily negated view"):
            call(a)
        torch.cuda.synchronize()
        assert unchanged(before, a) == []
    finally:
        if fp is not None:
            fp.set_unpacker(native._tensor_reader)


@pytest.mark.parametrize("what", ["k_cache", "cos_sin_cache"])
def test_an_empty_cache_or_table_is_refused_by_a_bound_op(what):
    op = ap.bind(num_heads=4, head_dim=512, block_size=BS)  # Q in place
    a = valid("cuda")
    a["q_in"] = a["q_in"][:, :4].contiguous()
    args = ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
    op(*(a[k] for k in args))
    a[what] = a[what][:0]
    before = snapshot(a)
    with pytest.raises(InputError, match="no blocks|no rows"):
        op(*(a[k] for k in args))
    torch.cuda.synchronize()
    assert unchanged(before, a) == []


def test_the_bound_kv_op_refuses_a_table_of_another_rope_dim_or_without_rows():
    op = ap.bind_kv(block_size=BS)
    a = valid_kv("cuda")
    op(*(a[k] for k in KV_ARGS[:5]))
    for table in (a["cos_sin_cache"][:, :32].contiguous(), a["cos_sin_cache"][:0]):
        before = snapshot(a)
        with pytest.raises(InputError, match="cos_sin_cache"):
            op(*(a[k] for k in KV_ARGS[:4]), table)
        torch.cuda.synchronize()
        assert unchanged(before, a) == []


def test_the_cpu_implementation_counts_as_the_kernels_count():
    """The same call with out-of-range slots and positions on CUDA tensors (the kernel's counters) and
    on CPU tensors (the CPU implementation's): the same counts, and the same bytes."""
    outs = {}
    base = valid("cpu")  # one draw for both devices (their generators differ), moved to each
    for device in ("cuda", "cpu"):
        a = {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in base.items()}
        capacity = a["k_cache"].shape[0] * BS
        a["slot_mapping"][[1, 3]] = torch.tensor([capacity, 2**36], device=device)
        a["positions"][[2, 5]] = torch.tensor([-1, a["cos_sin_cache"].shape[0]], device=device)
        errors = dispatch.default_runtime().errors_buffer(torch.device(device))
        before = errors.clone()
        ap.qnorm_rope_kv_insert(*(a[k] for k in QKV))
        torch.cuda.synchronize()
        outs[device] = ((errors - before).tolist(), a["k_cache"].cpu(), a["q_out"].cpu().view(torch.int16))
    assert outs["cuda"][0] == outs["cpu"][0] and outs["cpu"][0][1] == 2
    assert torch.equal(outs["cuda"][1], outs["cpu"][1]) and torch.equal(outs["cuda"][2], outs["cpu"][2])
