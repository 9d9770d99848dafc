"""The vLLM plugin's replacements on CUDA tensors, eager and captured in a CUDA graph and replayed,
byte for byte against our op called directly with the same arguments.

vLLM itself cannot be installed where the GPU tests run (its wheel alone is larger than the copy of
the tree they get), so this file builds each replacement around a stand-in for vLLM's method and
stands in for the four questions the plugin asks vLLM (the forward context's attention metadata,
micro-batches, the current micro-batch, SM100's indexer scales): the CPU tests
(tests/test_plugin_vllm.py) run the same replacements inside the real vLLM packages."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue.plugins import vllm as plugin

from ..support import vllm_layers as L

pytestmark = pytest.mark.gpu


def vllms(*args):
    raise AssertionError("the replacement handed a call it serves back to vLLM")


@pytest.fixture
def plugin_state(monkeypatch):
    plugin.pool.release()
    plugin._claimed.clear()
    plugin._told.clear()
    metadata = {}
    monkeypatch.setattr(plugin, "_attn_metadata", lambda: metadata.get("now"))
    monkeypatch.setattr(plugin, "_micro_batches", lambda: 2)
    monkeypatch.setattr(plugin, "_micro_batch", lambda: 0)
    monkeypatch.setattr(plugin, "_mx_indexer_scales", lambda: False)
    yield metadata
    plugin.pool.release()
    plugin._claimed.clear()


SWA_CASES = [  # (v41, kv_mxfp8, interleaved, heads, padded, block size)
    (False, False, False, 16, 64, 64),
    (False, False, False, 64, 64, 64),
    (True, True, False, 32, 64, 32),
    (True, True, True, 8, 64, 32),
    (True, False, True, 64, 64, 64),
]


@pytest.mark.parametrize("v41, mxfp8, interleaved, heads, padded, bs", SWA_CASES)
def test_swa_insert_eager_and_in_a_cuda_graph(plugin_state, v41, mxfp8, interleaved, heads, padded, bs):
    n, blocks = 48, 8
    layer = L.swa_layer(heads=heads, padded=padded, record=528 if mxfp8 else 584, block_size=bs, blocks=blocks,
                        device="cuda", v41=v41, mxfp8=mxfp8, interleaved=interleaved, seed=1, max_tokens=n)  # fmt: skip
    handed = []

    def profile_run(self, q, kv, positions, attn_metadata):
        handed.append(attn_metadata)
        return q

    insert = plugin._swa_insert(profile_run, v41=v41)
    q0, kv0 = L.rows(n, L.D, "cuda", 2, heads=heads), L.rows(n, L.D, "cuda", 3)
    insert(layer, q0, kv0, torch.zeros(n, dtype=torch.long, device="cuda"), None)
    assert handed == [None]  # the profile run reserved the scratch and left the call to vLLM
    insert = plugin._swa_insert(vllms, v41=v41)  # from here on, every call must be ours

    cache = layer.swa_cache_layer.kv_cache
    fmt = "mxfp8" if mxfp8 else "fp8_ds_mla"
    cos_sin = layer.rotary_emb.cos_sin_cache
    q_modes = dict(
        apply_q_norm=not v41,
        apply_q_rope=not interleaved,
        q_layout="interleaved" if interleaved else "head_major",
    )

    def expected(q, kv, slots, positions, want_cache):
        into, block = L.written_pages(want_cache, bs, 528 if mxfp8 else 584)
        if interleaved and heads == padded:
            ap.kv_rope_insert(kv, into, slots, positions, cos_sin, block, fmt, numerics="preset=vllm")
            return q.clone()
        want_q = torch.zeros(n, padded, L.D, dtype=torch.bfloat16, device="cuda")
        ap.qnorm_rope_kv_insert(q.clone(), kv, want_q, into, slots, positions, cos_sin, L.EPS, block, fmt,
                                numerics="preset=vllm", **q_modes)  # fmt: skip
        return want_q

    # eager, twice (the second call finds its views and claims made): nothing allocated after the first
    slots, positions = L.slots_and_positions(n, bs * blocks, "cuda", 4, m=n - 3)
    plugin_state["now"] = meta = L.swa_metadata(layer, slots, bs)
    for seed in (5, 6):
        q, kv = L.rows(n, L.D, "cuda", seed, heads=heads), L.rows(n, L.D, "cuda", seed + 10)
        want_cache = cache.clone()
        want_q = expected(q, kv, slots, positions, want_cache)
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]  # every allocation so far
        out = insert(layer, q, kv, positions, meta)
        torch.cuda.synchronize()
        if seed == 6:
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
        assert torch.equal(cache, want_cache)
        assert torch.equal(out.view(torch.int16), want_q.view(torch.int16))

    # captured once, replayed on new inputs copied into the captured buffers
    static_q, static_kv = L.rows(n, L.D, "cuda", 7, heads=heads), L.rows(n, L.D, "cuda", 8)
    static_q_in = static_q.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = insert(layer, static_q_in, static_kv, positions, meta)
    for seed in (9, 10):
        q, kv = L.rows(n, L.D, "cuda", seed, heads=heads), L.rows(n, L.D, "cuda", seed + 10)
        want_cache = cache.clone()
        want_q = expected(q, kv, slots, positions, want_cache)
        static_q_in.copy_(q)
        static_kv.copy_(kv)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, want_cache)
        assert torch.equal(static_out.view(torch.int16), want_q.view(torch.int16))
    if padded > heads and not (interleaved and heads == padded):
        buffer = plugin.pool.buffer(padded_heads=padded, head_dim=L.D)
        assert static_out.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("record, ratio", [(584, 1), (528, 2), (288, 1), (None, 2)])
def test_compressed_insert_eager_and_in_a_cuda_graph(plugin_state, record, ratio):
    bs, blocks, n = 64, 4, 200
    dtype = torch.uint8 if record else torch.bfloat16
    layer = L.compressor(
        record=record, block_size=bs, blocks=blocks, ratio=ratio, device="cuda", seed=11, dtype=dtype
    )
    insert = plugin._compressed_insert(vllms)
    cache = layer._static_forward_context[layer.k_cache_prefix].kv_cache
    slots, positions = L.slots_and_positions(n, bs * blocks, "cuda", 12)
    plugin_state["now"] = {layer.k_cache_prefix: type("M", (), {"slot_mapping": slots})}
    rotary = type("Rope", (), {"cos_sin_cache": L.cos_sin("cuda", seed=13)})
    fmt = {584: "fp8_ds_mla", 528: "mxfp8", 288: "nvfp4_v41", None: "bf16"}[record]
    static = L.rows(n, L.D, "cuda", 14)
    graph = None
    for seed in (15, 16, 17):
        latent = L.rows(n, L.D, "cuda", seed)
        want = cache.clone()
        into, block = L.written_pages(plugin.pages(want), bs, record)
        ap.kv_rope_insert(latent, into, slots, positions, rotary.cos_sin_cache, block, fmt,
                          numerics="preset=vllm-triton", compress_ratio=ratio)  # fmt: skip
        if seed < 17:
            insert(layer, latent, positions, rotary)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                insert(layer, static, positions, rotary)
            static.copy_(latent)
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fp4, ratio", [(True, 1), (False, 4)])
def test_indexer_keys_eager_and_in_a_cuda_graph(plugin_state, fp4, ratio):
    bs, blocks, n = 64, 4, 200
    layer = L.indexer(fp4=fp4, block_size=bs, blocks=blocks, ratio=ratio, device="cuda", seed=21)
    produce = plugin._indexer_keys(vllms)
    cache = layer.k_cache.kv_cache
    slots, positions = L.slots_and_positions(n, bs * blocks, "cuda", 22)
    plugin_state["now"] = {layer.k_cache.prefix: type("M", (), {"slot_mapping": slots})}
    rotary = type("Rope", (), {"cos_sin_cache": L.cos_sin("cuda", seed=23)})
    static = L.rows(n, 128, "cuda", 24)
    for seed in (25, 26, 27):
        latent = L.rows(n, 128, "cuda", seed)
        want = cache.clone()
        ap.kv_rope_insert(latent, plugin.pages(want), slots, positions, rotary.cos_sin_cache, bs,
                          "mxfp4" if fp4 else "fp8_token", norm_weight=layer.k_norm.weight, eps=L.EPS,
                          numerics="preset=vllm-triton", compress_ratio=ratio)  # fmt: skip
        if seed < 27:
            produce(layer, latent, positions, rotary)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                produce(layer, static, positions, rotary)
            static.copy_(latent)
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, want)
