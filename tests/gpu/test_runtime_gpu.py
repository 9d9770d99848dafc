"""Runtime on the GPU: bound ops in CUDA graphs, no allocation after the pool is locked, zero-once
pads, two micro-batches on two streams, the torch op under torch.compile."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue import reference

pytestmark = pytest.mark.gpu

D, R, BS = 512, 64, 64


def inputs(n, h, seed, num_blocks=64, max_pos=4096):
    g = torch.Generator(device="cuda").manual_seed(seed)
    theta = torch.rand(max_pos, R // 2, generator=g, device="cuda") * 6.28
    return dict(
        q_in=torch.randn(n, h, D, generator=g, device="cuda").bfloat16(),
        kv=torch.randn(n, D, generator=g, device="cuda").bfloat16(),
        slot_mapping=torch.randperm(num_blocks * BS, generator=g, device="cuda")[:n].contiguous(),
        positions=torch.randint(0, max_pos, (n,), generator=g, device="cuda"),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
    )


def new_cache(num_blocks=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, BS * 584), generator=g, device="cuda", dtype=torch.uint8)


def expected(x, k_cache, h, p):
    q_out = torch.zeros(x["q_in"].shape[0], p, D, dtype=torch.bfloat16, device="cuda")
    kc = k_cache.clone()
    reference.qnorm_rope_kv_insert(
        x["q_in"], x["kv"], q_out, kc, x["slot_mapping"], x["positions"], x["cos_sin_cache"], 1e-6, BS
    )
    return q_out, kc


def test_bound_op_graph_replay_with_new_inputs_matches_reference():
    h, p, n = 16, 64, 200
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=1024, padded_heads=p, head_dim=D, micro_batches=1)
    pool.lock()
    op = ap.bind(num_heads=h, padded_heads=p, block_size=BS, pool=pool)
    static = inputs(n, h, seed=1)
    k_cache = new_cache()
    op(
        static["q_in"],
        static["kv"],
        k_cache,
        static["slot_mapping"],
        static["positions"],
        static["cos_sin_cache"],
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = op(
            static["q_in"],
            static["kv"],
            k_cache,
            static["slot_mapping"],
            static["positions"],
            static["cos_sin_cache"],
        )
    for seed in (2, 3, 4):
        fresh = inputs(n, h, seed)
        for k, v in fresh.items():
            static[k].copy_(v)
        before = new_cache(seed=seed)
        k_cache.copy_(before)
        graph.replay()
        want_q, want_cache = expected(fresh, before, h, p)
        torch.cuda.synchronize()
        assert torch.equal(q_out.view(torch.int16), want_q.view(torch.int16))
        assert torch.equal(k_cache, want_cache)


def test_no_allocation_after_lock_across_token_counts():
    h, p = 8, 64
    pool = ap.ScratchPool()
    reserved = pool.reserve(max_tokens=4096, padded_heads=p, head_dim=D, micro_batches=2)
    assert reserved == pool.reserved_bytes == 2 * 4096 * p * D * 2
    pool.lock()
    ops = [ap.bind(num_heads=h, padded_heads=p, block_size=BS, pool=pool, micro_batches=2) for _ in range(3)]
    k_cache = new_cache(num_blocks=80)
    sizes = [1, 3, 8, 64, 100, 512, 1000, 4096]
    data = {n: inputs(n, h, seed=n, num_blocks=80) for n in sizes}
    for n in sizes:  # warm up: binds, views, TVM-FFI state
        for mb in (0, 1):
            x = data[n]
            ops[0](
                x["q_in"],
                x["kv"],
                k_cache,
                x["slot_mapping"],
                x["positions"],
                x["cos_sin_cache"],
                micro_batch=mb,
            )
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    for i in range(1000):
        n = sizes[i % len(sizes)]
        x = data[n]
        ops[i % 3](
            x["q_in"],
            x["kv"],
            k_cache,
            x["slot_mapping"],
            x["positions"],
            x["cos_sin_cache"],
            micro_batch=i % 2,
        )
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries"):
        assert stats1.get(key, 0) == stats0.get(key, 0), key
    with pytest.raises(ap.ScratchError):
        x = inputs(4097, h, seed=9, num_blocks=80)
        ops[0](x["q_in"], x["kv"], k_cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"])


def test_zero_once_pads_stay_zero_across_layers_and_steps():
    h, p = 16, 64
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=512, padded_heads=p, head_dim=D, micro_batches=1)
    pool.lock()
    buffer = pool.buffer(padded_heads=p, head_dim=D)
    layers = [ap.bind(num_heads=h, padded_heads=p, block_size=BS, pool=pool) for _ in range(4)]
    k_cache = new_cache()
    for step, n in enumerate((512, 7, 300, 1, 64)):
        x = inputs(n, h, seed=100 + step)
        for op in layers:
            q_out = op(x["q_in"], x["kv"], k_cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"])
        want_q, _ = expected(x, k_cache, h, p)
        torch.cuda.synchronize()
        assert torch.equal(q_out[:, :h].view(torch.int16), want_q[:, :h].view(torch.int16))
        assert not buffer[:, h:].view(torch.int16).any(), f"pad heads written at step {step}"


def test_two_micro_batches_on_two_streams_do_not_interfere():
    h, p, n = 32, 64, 1024
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=n, padded_heads=p, head_dim=D, micro_batches=2)
    pool.lock()
    op = ap.bind(num_heads=h, padded_heads=p, block_size=BS, pool=pool, micro_batches=2)
    xs = [inputs(n, h, seed=s, num_blocks=40) for s in (7, 8)]
    caches = [new_cache(40, seed=1), new_cache(40, seed=2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    torch.cuda.synchronize()
    for _ in range(20):
        outs = []
        for mb in (0, 1):
            with torch.cuda.stream(streams[mb]):
                x = xs[mb]
                outs.append(
                    op(
                        x["q_in"],
                        x["kv"],
                        caches[mb],
                        x["slot_mapping"],
                        x["positions"],
                        x["cos_sin_cache"],
                        micro_batch=mb,
                    )
                )
    torch.cuda.synchronize()
    assert outs[0].data_ptr() != outs[1].data_ptr()
    for mb in (0, 1):
        want_q, _ = expected(xs[mb], caches[mb], h, p)
        assert torch.equal(outs[mb].view(torch.int16), want_q.view(torch.int16))


def test_torch_op_under_torch_compile_matches_eager():
    h, p, n = 16, 16, 96
    x = inputs(n, h, seed=5)

    def step(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache):
        ap.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, 1e-6, BS)
        return q_out[:, 0, :8].float() * 2  # a consumer of the mutated output inside the graph

    compiled = torch.compile(step, fullgraph=True)
    outs = []
    for fn in (step, compiled):
        q_out = torch.full((n, p, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        k_cache = new_cache(seed=3)
        total = fn(x["q_in"], x["kv"], q_out, k_cache, x["slot_mapping"], x["positions"], x["cos_sin_cache"])
        outs.append((q_out, k_cache, total))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
    assert torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][2], outs[1][2])
