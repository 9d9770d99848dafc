"""attn_prologue.compat.vllm on the GPU: vLLM's schemas running our kernels, bit for bit against the
reference on poisoned outputs (every cache byte, every q byte), the allocating form allocating
nothing per call, CUDA-graph replay and torch.compile of the registered ops."""

from __future__ import annotations

import itertools

import attn_prologue as ap
import pytest
import torch
from attn_prologue.compat import vllm
from attn_prologue.errors import InputError

from ..support.vllm_cases import (
    ALLOCATING,
    CALLER_OWNED,
    EPS,
    KV_ONLY,
    Case,
    D,
    H,
    P,
    allocating_args,
    bits,
    expected_kv,
    expected_qkv,
    make,
    poison_q_out,
)

pytestmark = pytest.mark.gpu

_names = itertools.count()


@pytest.fixture
def registered():
    made = []

    def make_registration(form="allocating", *, max_tokens=300, micro_batches=1, **kw):
        pool = None
        if form == "allocating":
            pool = ap.ScratchPool()
            pool.reserve(max_tokens=max_tokens, padded_heads=P, head_dim=D, micro_batches=micro_batches)
            pool.lock()
        r = vllm.register(f"compat_gpu_{next(_names)}", form=form, pool=pool, new_namespace=True, **kw)
        made.append(r)
        return r

    yield make_registration
    for r in made:
        r.close()


def pool_buffer(r, micro_batch=0):
    return r.pool.buffer(padded_heads=P, head_dim=D, micro_batch=micro_batch)


def caller_owned_args(form, case, x, q_out):
    common = (x["slot_mapping"], x["positions"], x["cos_sin_cache"], EPS, case.block_size)
    if form == "q_out_second":
        return (x["q"], q_out, x["kv"], x["k_cache"], *common)
    return (x["q"], x["kv"], q_out, x["k_cache"], *common)


@pytest.mark.parametrize("case", ALLOCATING, ids=str)
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_allocating_form_matches_the_reference(registered, case: Case, entry):
    r = registered("allocating")
    x = make(case, "cuda")
    buf = pool_buffer(r)
    buf.fill_(float("nan"))  # "written" mode writes every head of rows < N, pads included
    want_q, want_cache = expected_qkv(case, x, poison_q_out(case.n, "cuda", rows_past=0))
    q_padded = (r.qkv_op if entry == "torch op" else r.qkv)(*allocating_args(case, x))
    torch.cuda.synchronize()
    assert q_padded.shape == (case.n, P, D)
    assert torch.equal(bits(q_padded), bits(want_q))
    assert torch.equal(x["k_cache"], want_cache)
    assert buf[case.n :].isnan().all()  # rows >= N untouched


@pytest.mark.parametrize("case", [ALLOCATING[1], ALLOCATING[4], ALLOCATING[5]], ids=str)
def test_zero_once_writes_the_live_heads_only(registered, case: Case):
    """Pads stay the zeros of reserve() and are never written; a second call with other inputs
    overwrites every live element (rows >= N stay zero too)."""
    r = registered("allocating", pad_heads="zero_once")
    buf = pool_buffer(r)
    for seed in (case.seed, case.seed + 100):
        step = Case(**{**case.__dict__, "seed": seed})
        x = make(step, "cuda")
        want_q, want_cache = expected_qkv(step, x, poison_q_out(step.n, "cuda", rows_past=0))
        q_padded = r.qkv_op(*allocating_args(step, x))
        torch.cuda.synchronize()
        assert torch.equal(bits(q_padded), bits(want_q))
        assert torch.equal(x["k_cache"], want_cache)
    assert not buf[case.n :].view(torch.int16).any()


@pytest.mark.parametrize("case", CALLER_OWNED, ids=str)
@pytest.mark.parametrize("form", ["q_out_second", "q_out_third"])
@pytest.mark.parametrize("entry", ["torch op", "plain callable"])
def test_caller_owned_forms_match_the_reference(registered, case: Case, form, entry):
    r = registered(form, cache_format=case.fmt)
    x = make(case, "cuda")
    q_out = poison_q_out(case.n, "cuda")
    want_q, want_cache = expected_qkv(case, x, q_out)
    (r.qkv_op if entry == "torch op" else r.qkv)(*caller_owned_args(form, case, x, q_out))
    torch.cuda.synchronize()
    assert torch.equal(bits(q_out), bits(want_q))
    assert torch.equal(x["k_cache"], want_cache)


@pytest.mark.parametrize("case", KV_ONLY, ids=str)
def test_kv_only_op_and_q_head_padded_zero_match_the_reference(registered, case: Case):
    r = registered("allocating")
    for call in ("kv op", "q_head_padded=0"):
        x = make(case, "cuda")
        want = expected_kv(case, x, x["k_cache"], case.fmt)
        if call == "kv op":
            r.kv_op(x["kv"], x["k_cache"], x["slot_mapping"], x["positions"], x["cos_sin_cache"],
                    case.block_size, None, case.mxfp8)  # fmt: skip
        else:
            out = r.qkv_op(*allocating_args(case, x, q_head_padded=0))
            assert out.shape == (case.n, 0, D)
        torch.cuda.synchronize()
        assert torch.equal(x["k_cache"], want), call


@pytest.mark.parametrize("cache_kind", ["uint8 fp8_scale", "e4m3 fp8_scale", "bf16"])
def test_full_caches_match_the_reference(registered, cache_kind):
    r = registered("q_out_third")
    case = Case(64, m=60, negative_every=4, seed=60)
    x = make(case, "cuda")
    bs, nb = case.block_size, x["k_cache"].shape[0]
    g = torch.Generator(device="cuda").manual_seed(60)
    if cache_kind == "bf16":
        pages = torch.randint(0, 256, (nb, bs * 2 * D), generator=g, device="cuda", dtype=torch.uint8)
        cache, scale, fmt = pages.view(torch.bfloat16).view(nb, bs, D), None, "bf16"
    else:
        pages = torch.randint(0, 256, (nb, bs * D), generator=g, device="cuda", dtype=torch.uint8)
        scale, fmt = torch.tensor([0.05], device="cuda"), "fp8_tensor"
        cache = pages if cache_kind.startswith("uint8") else pages.view(torch.float8_e4m3fn).view(nb, bs, D)
    want = expected_kv(case, x, pages, fmt, kv_scale=scale)
    r.kv_op(x["kv"], cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"], bs, scale, False)
    torch.cuda.synchronize()
    assert torch.equal(pages, want)


def test_no_allocation_per_call_after_lock(registered):
    """After a warm-up per token count, calls allocate nothing on the device: q_padded is a view
    inside the reservation, and the KV-only return has no element."""
    r = registered("allocating", max_tokens=300)
    buf = pool_buffer(r)
    start, end = buf.data_ptr(), buf.data_ptr() + buf.nbytes
    sizes = (1, 7, 64, 300)
    data = {n: make(Case(n, seed=n, slots32=n % 2 == 1), "cuda") for n in sizes}
    for n in sizes:  # warm up: kernels, launch state, the views
        case = Case(n, seed=n, slots32=n % 2 == 1)
        r.qkv(*allocating_args(case, data[n]))
        r.qkv_op(*allocating_args(case, data[n], q_head_padded=0))
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    for i in range(200):
        n = sizes[i % len(sizes)]
        case = Case(n, seed=n, slots32=n % 2 == 1)
        q_padded = (r.qkv, r.qkv_op)[i % 2](*allocating_args(case, data[n]))
        assert start <= q_padded.data_ptr() and q_padded.data_ptr() + q_padded.nbytes <= end
        r.qkv_op(*allocating_args(case, data[n], q_head_padded=0))
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries"):
        assert stats1.get(key, 0) == stats0.get(key, 0), key


def test_cuda_graph_replay_of_the_allocating_op_matches_the_reference(registered):
    r = registered("allocating")
    case = Case(64, m=60, mxfp8=True, interleaved=True, negative_every=5, seed=61)
    static = make(case, "cuda")
    r.qkv_op(*allocating_args(case, static))  # eager first: validation, kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_padded = r.qkv_op(*allocating_args(case, static))
    for seed in (62, 63):
        fresh = make(Case(64, m=60, mxfp8=True, interleaved=True, negative_every=5, seed=seed), "cuda")
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        want_q, want_cache = expected_qkv(case, fresh, poison_q_out(case.n, "cuda", rows_past=0))
        torch.cuda.synchronize()
        assert torch.equal(bits(q_padded), bits(want_q))
        assert torch.equal(static["k_cache"], want_cache)


def test_registered_ops_under_torch_compile_match_eager(registered):
    r = registered("allocating")
    case = Case(7, m=6, negative_every=3, seed=64)

    def step(x, cache2):
        q_padded = r.qkv_op(*allocating_args(case, x))
        r.kv_insert(x["kv"], cache2, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 64, None, True)
        return q_padded[:, :H, :8].float() * 2

    torch._dynamo.reset()
    outs = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        x, cache2 = make(case, "cuda"), make(Case(7, mxfp8=True, seed=65), "cuda")["k_cache"]
        total = fn(x, cache2)
        torch.cuda.synchronize()
        outs.append((total, x["k_cache"], cache2, bits(pool_buffer(r)[: case.n]).clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_bad_input_on_gpu_raises_a_typed_error_and_writes_nothing(registered):
    r = registered("allocating")
    case = Case(7, seed=66)
    x = make(case, "cuda")
    before = x["k_cache"].clone()
    args = list(allocating_args(case, x))
    args[4] = x["positions"].int()
    with pytest.raises(InputError):
        r.qkv_op(*args)
    with pytest.raises(InputError):
        r.qkv(*args[:12])
    torch.cuda.synchronize()
    assert torch.equal(x["k_cache"], before)
