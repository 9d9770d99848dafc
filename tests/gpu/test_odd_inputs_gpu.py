"""Odd inputs on the GPU (tests/test_odd_inputs.py is the CPU side): a lazily negated view is refused
on a shape's first call and, where the C++ torch-op library's reader is loaded, on its later calls; an
empty cache or table on a cached shape and on a bound op; a bound KV op's rope dim; and the CPU
implementation counts skipped rows as the kernels do."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue import dispatch, ops, torch_op
from attn_prologue.errors import InputError

from ..support.bad_inputs import BS, KV_ARGS, snapshot, unchanged, valid, valid_kv

pytestmark = pytest.mark.gpu
QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format")  # fmt: skip


@pytest.mark.parametrize("cached", [False, True], ids=["first call", "cached shape"])
@pytest.mark.parametrize("name", ["kv", "positions", "cos_sin_cache"])
def test_a_lazily_negated_view_is_refused_and_never_read_as_its_bits(cached, name):
    if cached and torch_op.cuda_kernels() != "C++":
        pytest.skip("without the C++ torch-op library's reader a cached shape's call reads tensors through "
                    "torch's DLPack exchange API, which does not report the negation bit (docs/op.md)")  # fmt: skip
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
