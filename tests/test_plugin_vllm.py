"""The vLLM plugin against the real vLLM package (docs/vllm-plugin.md), on CPU tensors.

Skipped where vLLM is not importable; `tools/engine_env.py` makes an environment holding vLLM
0.33.0 and 0.34.0 (`.ci/run` runs this file once per version). The layers are minimally built
stand-ins (tests/support/vllm_layers.py); the classes, the plugin loader, the forward context and
the micro-batch registry are vLLM's own. Expected bytes come from our op called directly with the
same arguments (its CPU path is the PyTorch reference) and, for the V4.1 records, from FlashInfer's
pure-torch packers where that wheel is installed."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (tools/engine_env.py makes an environment)")

import attn_prologue as ap  # noqa: E402
from attn_prologue import plugins  # noqa: E402
from attn_prologue.plugins import vllm as plugin  # noqa: E402

from tests.support import vllm_layers as L  # noqa: E402

V4 = pytest.importorskip("vllm.models.deepseek_v4.attention")
V4_ATTN = V4.DeepseekV4Attention
V41 = pytest.importorskip("vllm.models.deepseek_v41.attention")
V41_ATTN, V41_INDEXER = V41.DeepseekV4Attention, V41.DeepseekV4Indexer
V41_COMPRESSOR = pytest.importorskip("vllm.models.deepseek_v41.compressor").DeepseekCompressor
SEAMS = [
    (V4_ATTN, "_fused_qnorm_rope_kv_insert"),
    (V41_ATTN, "_fused_qnorm_rope_kv_insert"),
    (V41_COMPRESSOR, "insert_cache"),
    (V41_INDEXER, "_produce_k"),
    (V4, "fused_indexer_q_rope_quant"),
    (V41, "fused_indexer_q_rope_quant"),
]
ORIGINALS = {seam: seam[0].__dict__[seam[1]] for seam in SEAMS}


def fresh_state() -> None:
    if plugin._installed is not None:
        plugin._installed.uninstall()
    plugin._installed = None
    plugin.pool.release()
    plugin._claimed.clear()
    plugin._told.clear()


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv("ATTN_PROLOGUE_ENGINE_PLUGINS", raising=False)
    fresh_state()
    assert plugin.install() is not None
    yield plugin
    fresh_state()
    assert all(s[0].__dict__[s[1]] is ORIGINALS[s] for s in SEAMS)


def test_vllms_loader_runs_our_entry_point(monkeypatch):
    import vllm.plugins

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    fresh_state()
    try:
        vllm.plugins.load_general_plugins()
        for cls, name in SEAMS:
            ours = cls.__dict__[name]
            assert ours is not ORIGINALS[(cls, name)] and ours.__wrapped__ is ORIGINALS[(cls, name)]
            assert ours.__module__ == "attn_prologue.plugins.vllm"
        assert plugin.install() is plugin._installed  # vLLM loads plugins in every process, maybe twice
    finally:
        fresh_state()


def q_and_kv(n, heads, seed):
    return L.rows(n, L.D, "cpu", seed, heads=heads), L.rows(n, L.D, "cpu", seed + 1)


@pytest.mark.parametrize("heads, padded", [(4, 8), (8, 8)])
def test_v4_profile_run_reserves_then_q_lands_in_the_pool(installed, heads, padded):
    bs, blocks, n = 16, 6, 9
    layer = L.swa_layer(heads=heads, padded=padded, record=584, block_size=bs, blocks=blocks, device="cpu")
    q, kv = q_and_kv(n, heads, 1)
    profiled = V4_ATTN._fused_qnorm_rope_kv_insert(layer, q, kv, torch.zeros(n, dtype=torch.long), None)
    assert torch.equal(profiled, F.pad(q, (0, 0, 0, padded - heads)))  # vLLM's own profile-run answer
    reserved = layer.max_num_batched_tokens * padded * L.D * 2 if padded > heads else 0
    assert plugin.pool.reserved_bytes == reserved

    slots, positions = L.slots_and_positions(n, bs * blocks, "cpu", 2)
    cache = layer.swa_cache_layer.kv_cache
    want_cache, want_q = cache.clone(), torch.full((n, padded, L.D), float("nan"), dtype=torch.bfloat16)
    ap.qnorm_rope_kv_insert(q, kv, want_q, want_cache, slots, positions, layer.rotary_emb.cos_sin_cache, L.EPS,
                            bs, "fp8_ds_mla", numerics="preset=vllm")  # fmt: skip
    q_in = q.clone()
    out = V4_ATTN._fused_qnorm_rope_kv_insert(layer, q_in, kv, positions, L.swa_metadata(layer, slots, bs))
    assert torch.equal(cache, want_cache)
    assert torch.equal(out.view(torch.int16), want_q.view(torch.int16))
    assert plugin.pool.locked and plugin.pool.reserved_bytes == reserved  # nothing allocated after lock
    if padded > heads:
        buffer = plugin.pool.buffer(padded_heads=padded, head_dim=L.D, device="cpu")
        assert out.data_ptr() == buffer.data_ptr()  # a view of the pool, not a new tensor
    else:
        assert out is q_in  # P == H: Q written in place


V41_CASES = [  # (kv_mxfp8, interleaved Q, heads, padded); interleaved Q is FlashMLA's, P in (64, 128)
    (False, False, 4, 8), (True, False, 4, 8), (True, True, 8, 64), (False, True, 64, 64), (True, False, 8, 8),
]  # fmt: skip


@pytest.mark.parametrize("mxfp8, interleaved, heads, padded", V41_CASES)
def test_v41_swa_insert_matches_our_op(installed, mxfp8, interleaved, heads, padded):
    bs, blocks, n = 32, 4, 11
    record = 528 if mxfp8 else 584
    layer = L.swa_layer(heads=heads, padded=padded, record=record, block_size=bs, blocks=blocks, device="cpu",
                        v41=True, mxfp8=mxfp8, interleaved=interleaved, seed=3)  # fmt: skip
    q, kv = q_and_kv(n, heads, 4)
    V41_ATTN._fused_qnorm_rope_kv_insert(layer, q, kv, torch.zeros(n, dtype=torch.long), None)
    slots, positions = L.slots_and_positions(n, bs * blocks, "cpu", 5, m=n - 2)  # DP padding: 2 Q-only rows
    cache = layer.swa_cache_layer.kv_cache
    fmt = "mxfp8" if mxfp8 else "fp8_ds_mla"
    want_cache = cache.clone()
    q_in = q.clone()
    out = V41_ATTN._fused_qnorm_rope_kv_insert(layer, q_in, kv, positions, L.swa_metadata(layer, slots, bs))
    cos_sin = layer.rotary_emb.cos_sin_cache
    into, block = L.written_pages(want_cache, bs, record)
    if interleaved and heads == padded:  # vLLM's pad_to = 0: q back untouched, KV only
        ap.kv_rope_insert(kv, into, slots, positions, cos_sin, block, fmt, numerics="preset=vllm")
        assert out is q_in and torch.equal(q_in, q)
    else:
        want_q = torch.full((n, padded, L.D), float("nan"), dtype=torch.bfloat16)
        ap.qnorm_rope_kv_insert(q, kv, want_q, into, slots, positions, cos_sin, L.EPS, block, fmt,
                                numerics="preset=vllm", apply_q_norm=False, apply_q_rope=not interleaved,
                                q_layout="interleaved" if interleaved else "head_major")  # fmt: skip
        assert torch.equal(out.view(torch.int16), want_q.view(torch.int16))
    assert torch.equal(cache, want_cache)


def test_dual_batch_overlap_gets_a_buffer_per_micro_batch(installed, monkeypatch):
    from types import SimpleNamespace

    import vllm.config
    import vllm.v1.worker.ubatching as ubatching

    parallel = SimpleNamespace(use_ubatching=True, num_ubatches=2)  # what enable_dbo=True gives
    monkeypatch.setattr(
        vllm.config, "get_current_vllm_config_or_none", lambda: SimpleNamespace(parallel_config=parallel)
    )
    bs, n = 16, 5
    layer = L.swa_layer(heads=4, padded=8, record=584, block_size=bs, blocks=4, device="cpu", seed=6)
    q, kv = q_and_kv(n, 4, 7)
    V4_ATTN._fused_qnorm_rope_kv_insert(layer, q, kv, torch.zeros(n, dtype=torch.long), None)
    assert plugin.pool.reserved_bytes == 2 * layer.max_num_batched_tokens * 8 * L.D * 2
    slots, positions = L.slots_and_positions(n, bs * 4, "cpu", 8)
    meta = L.swa_metadata(layer, slots, bs)
    outs = []
    for micro_batch in (0, 1):
        monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), micro_batch)
        assert ubatching.dbo_current_ubatch_id() == micro_batch
        outs.append(V4_ATTN._fused_qnorm_rope_kv_insert(layer, q, kv, positions, meta))
    buffers = [
        plugin.pool.buffer(padded_heads=8, head_dim=L.D, micro_batch=mb, device="cpu") for mb in (0, 1)
    ]
    assert [o.data_ptr() for o in outs] == [b.data_ptr() for b in buffers] and buffers[
        0
    ].data_ptr() != buffers[1].data_ptr()
    assert torch.equal(outs[0], outs[1])


class Spy:
    """Stands where vLLM's method was before install: records that the replacement handed a call back."""

    def __init__(self, monkeypatch, cls, name):
        self.calls = []
        original = cls.__dict__[name]

        def spy(self_, q, kv, positions, attn_metadata):
            self.calls.append(attn_metadata)
            return "vllm's"

        spy.__wrapped__ = original
        monkeypatch.setattr(cls, name, spy)


@pytest.mark.parametrize(
    "case",
    [
        "bf16 rows",
        "fp8 rows",
        "context parallel",
        "more tokens than reserved",
        "no profile run",
        "padded V4.1 pages",
    ],
)
def test_branches_we_do_not_serve_stay_vllms(monkeypatch, caplog, case):
    fresh_state()
    spy = Spy(monkeypatch, V41_ATTN, "_fused_qnorm_rope_kv_insert")
    assert plugin.install() is not None
    try:
        dtype = {"bf16 rows": torch.bfloat16, "fp8 rows": torch.float8_e4m3fn}.get(case, torch.uint8)
        padded_pages = case == "padded V4.1 pages"
        layer = L.swa_layer(heads=4, padded=8, record=528 if padded_pages else 584, block_size=16, blocks=4,
                            device="cpu", v41=True, mxfp8=padded_pages, cache_dtype=dtype, max_tokens=8,
                            page_pad=64 if padded_pages else None)  # fmt: skip
        layer.use_pcp = case == "context parallel"
        n = 12 if case == "more tokens than reserved" else 5
        q, kv = q_and_kv(n, 4, 9)
        if case != "no profile run":
            assert (
                V41_ATTN._fused_qnorm_rope_kv_insert(
                    layer, q[:8], kv[:8], torch.zeros(8, dtype=torch.long), None
                )
                == "vllm's"
            )
        slots, positions = L.slots_and_positions(n, 64, "cpu", 10)
        with caplog.at_level(logging.WARNING, logger="vllm.attn_prologue"):
            for _ in range(2):
                out = V41_ATTN._fused_qnorm_rope_kv_insert(
                    layer, q, kv, positions, L.swa_metadata(layer, slots, 16)
                )
                assert out == "vllm's"
        assert len(spy.calls) == 2 + (case != "no profile run")
        warned = [r for r in caplog.records if r.name == "vllm.attn_prologue"]
        assert len(warned) == (
            1 if case in ("more tokens than reserved", "no profile run", "padded V4.1 pages") else 0
        )
    finally:
        fresh_state()


def flashinfer_reference():
    """FlashInfer's pure-torch V4.1 record packer, loaded by file path (its package needs CUDA)."""
    import importlib.util
    import sys
    from pathlib import Path

    for root in sys.path:
        path = Path(root) / "flashinfer/experimental/b12x/attention/_shared/mla/compressed_reference.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("flashinfer_compressed_reference", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


@pytest.mark.parametrize("record, ratio", [(584, 1), (528, 1), (528, 2), (288, 1), (None, 2)])
def test_compressed_insert_matches_our_op_and_flashinfer(installed, record, ratio):
    bs, blocks, n = 16, 4, 24
    dtype = torch.uint8 if record else torch.bfloat16
    layer = L.compressor(
        record=record, block_size=bs, blocks=blocks, ratio=ratio, device="cpu", seed=11, dtype=dtype
    )
    latent = L.rows(n, L.D, "cpu", 12)
    slots = torch.arange(n)  # token t at slot t, as FlashInfer's packer lays them out
    positions = torch.arange(n) + 5
    rotary = type("Rope", (), {"cos_sin_cache": L.cos_sin("cpu", seed=13)})
    cache = layer._static_forward_context[layer.k_cache_prefix].kv_cache
    want = cache.clone()
    fmt = {584: "fp8_ds_mla", 528: "mxfp8", 288: "nvfp4_v41", None: "bf16"}[record]
    into, block = L.written_pages(plugin.pages(want), bs, record)
    ap.kv_rope_insert(latent, into, slots, positions, rotary.cos_sin_cache, block, fmt, numerics="preset=vllm-triton",
                      compress_ratio=ratio)  # fmt: skip
    meta = {layer.k_cache_prefix: type("M", (), {"slot_mapping": slots})}
    with L.forward_context(meta):
        V41_COMPRESSOR.insert_cache(layer, latent, positions, rotary)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    reference = flashinfer_reference()
    if reference is None or record not in (528, 288) or ratio != 1:
        return
    # FlashInfer packs already-rotated rows: with RoPE made the identity the rows are the latent itself
    identity = type("Rope", (), {"cos_sin_cache": L.cos_sin("cpu", identity=True)})
    with L.forward_context(meta):
        V41_COMPRESSOR.insert_cache(layer, latent, positions, identity)
    packed = reference.pack_deepseek_v41_cache_reference(
        latent, page_size=bs, cache_kind="swa" if record == 528 else "indexed"
    )
    assert torch.equal(cache.view(-1)[: n * record], packed.view(-1)[: n * record])  # the n records written


@pytest.mark.parametrize("fp4, ratio", [(True, 1), (False, 2)])
def test_indexer_keys_match_our_op(installed, monkeypatch, fp4, ratio):
    monkeypatch.setattr(plugin, "_mx_indexer_scales", lambda: False)  # the SM90 / SM120 record (no GPU here)
    bs, blocks, n = 16, 4, 20
    layer = L.indexer(fp4=fp4, block_size=bs, blocks=blocks, ratio=ratio, device="cpu", seed=14)
    latent = L.rows(n, 128, "cpu", 15)
    slots, positions = L.slots_and_positions(n, bs * blocks, "cpu", 16, m=n - 3)
    rotary = type("Rope", (), {"cos_sin_cache": L.cos_sin("cpu", seed=17)})
    cache = layer.k_cache.kv_cache
    want = cache.clone()
    ap.kv_rope_insert(latent, plugin.pages(want), slots, positions, rotary.cos_sin_cache, bs,
                      "mxfp4" if fp4 else "fp8_token", norm_weight=layer.k_norm.weight, eps=L.EPS,
                      numerics="preset=vllm-triton", compress_ratio=ratio)  # fmt: skip
    with L.forward_context({layer.k_cache.prefix: type("M", (), {"slot_mapping": slots})}):
        V41_INDEXER._produce_k(layer, latent, positions, rotary)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("module", [V4, V41], ids=["v4", "v41"])
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_the_indexers_q_runs_ours_where_vllm_calls_it(installed, monkeypatch, module, fp4):
    """vLLM's attention modules call the function by the name they imported: the plugin's replacement
    there returns vLLM's types holding our op's bytes (CPU tensors stand in for the GPU's here)."""
    from attn_prologue.index_q import index_q_reference

    monkeypatch.setattr(plugin, "_on_gpu", lambda t: True)
    g = torch.Generator().manual_seed(21)
    t, h = 7, 64
    q = torch.randn(t, h, 128, generator=g).bfloat16()
    weights = torch.randn(t, h, generator=g).bfloat16()
    positions, table = torch.randint(0, 64, (t,), generator=g), L.cos_sin("cpu", seed=22)
    w_dtype = torch.bfloat16 if fp4 else torch.float32
    out, w = module.fused_indexer_q_rope_quant(positions, q, table, weights, 0.088, 0.125, use_fp4=fp4,
                                               weights_out_dtype=w_dtype)  # fmt: skip
    want = index_q_reference(
        q, positions, table, weights, 0.088, 0.125, "mxfp4" if fp4 else "fp8_token", "vllm", w_dtype
    )
    if fp4:
        (packed, scale_words) = out
        assert scale_words.dtype == torch.int32 and scale_words.shape == (t, h)
        assert torch.equal(packed, want[0]) and torch.equal(
            scale_words.view(torch.uint8).view(t, h, 4), want[1]
        )
    else:
        assert out.dtype == torch.float8_e4m3fn and torch.equal(out.view(torch.uint8), want[0])
    assert torch.equal(w, want[2])


def untouched_with_one_warning(caplog, needle: str) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.attn_prologue"):
        assert plugin.install() is None
    records = [r for r in caplog.records if r.name == "vllm.attn_prologue"]
    assert len(records) == 1 and needle in records[0].getMessage(), [r.getMessage() for r in records]
    assert all(
        s[0].__dict__[s[1]] is ORIGINALS[s] or s[0].__dict__[s[1]].__module__ != plugin.__name__
        for s in SEAMS
    )


def test_an_unknown_version_leaves_vllm_untouched(monkeypatch, caplog):
    fresh_state()
    monkeypatch.setattr(plugin, "engine_version", lambda name: "0.32.0")
    untouched_with_one_warning(caplog, "0.32.0 is not a version this plugin was checked against")


def test_a_changed_signature_leaves_vllm_untouched(monkeypatch, caplog):
    fresh_state()

    def insert_cache(self, latent, positions, rotary_emb, extra=None):
        return None

    monkeypatch.setattr(V41_COMPRESSOR, "insert_cache", insert_cache)
    untouched_with_one_warning(
        caplog, "DeepseekCompressor.insert_cache takes (self, latent, positions, rotary_emb, extra)"
    )
    assert (
        V41_ATTN.__dict__["_fused_qnorm_rope_kv_insert"]
        is ORIGINALS[(V41_ATTN, "_fused_qnorm_rope_kv_insert")]
    )


def test_the_switch_turns_it_off(monkeypatch, caplog):
    fresh_state()
    monkeypatch.setenv("ATTN_PROLOGUE_ENGINE_PLUGINS", "0")
    untouched_with_one_warning(caplog, "ATTN_PROLOGUE_ENGINE_PLUGINS is off")


def test_the_version_table_names_the_installed_vllm():
    assert plugins.engine_version("vllm") in plugin.VERSIONS


# vLLM's CUDA extension defines its _C ops where it loads (a GPU machine); here the schema is defined
# as vLLM's library defines it (the string read from vllm/_C_stable_libtorch.abi3.so, 0.33.0 and
# 0.34.0), with a kernel that only records the call.
VLLM_KV_OP = (
    "fused_deepseek_v4_kv_rope_insert(Tensor kv, Tensor! k_cache, Tensor slot_mapping, Tensor position_ids, "
    "Tensor cos_sin_cache, int cache_block_size, Tensor? fp8_scale=None, bool kv_mxfp8=False) -> ()"
)


@pytest.mark.parametrize("mxfp8", [False, True])
def test_vllms_kv_only_op_runs_our_kernels(monkeypatch, caplog, mxfp8):
    fresh_state()
    library = torch.library.Library("_C", "FRAGMENT")
    vllms_calls = []
    library.define(VLLM_KV_OP)
    library.impl("fused_deepseek_v4_kv_rope_insert", lambda *args: vllms_calls.append(args), "CPU")
    try:
        with caplog.at_level(logging.INFO, logger="vllm.attn_prologue"):
            assert plugin.install() is not None
        assert "torch.ops._C.fused_deepseek_v4_kv_rope_insert" in caplog.records[-1].getMessage()
        bs, blocks, n = 16, 4, 10
        kv = L.rows(n, L.D, "cpu", 31)
        cache = L.random_bytes((blocks, bs * (528 if mxfp8 else 584)), "cpu", 32)
        slots, positions = L.slots_and_positions(n, bs * blocks, "cpu", 33)
        cos_sin = L.cos_sin("cpu", seed=34)
        want = cache.clone()
        ap.kv_rope_insert(kv, want, slots, positions, cos_sin, bs, "mxfp8" if mxfp8 else "fp8_ds_mla",
                          numerics="preset=vllm")  # fmt: skip
        torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, cache, slots, positions, cos_sin, bs, None, mxfp8)
        assert torch.equal(cache, want) and vllms_calls == []
        fresh_state()  # uninstall: vLLM's kernel is back
        torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, cache, slots, positions, cos_sin, bs, None, mxfp8)
        assert len(vllms_calls) == 1
    finally:
        fresh_state()
        library._destroy()


def test_without_vllms_extension_the_op_is_left_and_said_so(installed, caplog):
    assert "torch.ops._C.fused_deepseek_v4_kv_rope_insert" not in plugin._installed.seams
