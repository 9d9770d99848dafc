"""The SGLang plugin (attn_prologue.plugins.sglang, docs/sglang-plugin.md) against the real sglang
0.5.23 package, on CPU tensors (the replacements then run our op's CPU implementation; SGLang's own
kernels are CUDA JIT modules and never run here: where a test needs "SGLang's function ran", the
seam's original is a recorder with its signature, installed before the plugin).

Skipped where sglang is not installed. The environment these need (sglang installed with --no-deps
plus the pure-Python packages its imports need) is listed in docs/sglang-plugin.md.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from .support.sglang_env import import_sglang

import_sglang()

import attn_prologue as ap  # noqa: E402
import sglang.kernels.ops.attention.dsv4 as dsv4  # noqa: E402
import sglang.srt.layers.attention.dsv4.indexer as indexer  # noqa: E402
import sglang.srt.mem_cache.deepseek_v4_memory_pool as pool  # noqa: E402
import sglang.srt.models.deepseek_v4 as model  # noqa: E402
import sglang.srt.plugins as sgl_plugins  # noqa: E402
from attn_prologue import index_q_hadamard as hq  # noqa: E402
from attn_prologue.plugins import sglang as plugin  # noqa: E402
from sglang.kernels.ops.attention.dsv4 import norm_rope  # noqa: E402
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

Q, KV = "fused_q_norm_rope", "fused_k_norm_rope_flashmla"
IQ8, IQ4 = "fused_q_indexer_rope_hadamard_quant", "fused_q_indexer_rope_hadamard_fp4_quant"
TARGET = {name: f"{plugin.NORM_ROPE}.{name}" for name in (Q, KV, IQ8, IQ4)}
# SGLang's functions as imported, in a dict: SGLang's propagation rewrites every *module attribute*
# that holds the original when a hook is applied, this test module's included
ORIGINAL = {name: getattr(norm_rope, name) for name in TARGET}
# every place the real package holds each function: where it is defined and its re-exports
HOLDERS = {Q: (norm_rope, dsv4, model), KV: (norm_rope, dsv4, pool), IQ8: (norm_rope, dsv4, indexer),
           IQ4: (norm_rope, dsv4, indexer)}  # fmt: skip
POISON = 0xA5


@pytest.fixture(autouse=True)
def clean_sglang(monkeypatch):
    """No hooks, plugins not loaded, no plugin filter; afterwards our seams uninstalled (every
    original back, re-exports included) and SGLang's registry empty again."""
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv("ATTN_PROLOGUE_ENGINE_PLUGINS", raising=False)
    HookRegistry.reset()
    sgl_plugins._plugins_loaded = False
    yield
    if plugin._installed is not None:
        plugin._installed.uninstall()
    plugin._installed = None
    HookRegistry.reset()
    sgl_plugins._plugins_loaded = False
    plugin._refused.clear()


def untouched() -> bool:
    return all(getattr(m, name) is ORIGINAL[name] for name in ORIGINAL for m in HOLDERS[name])


def our_records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name == plugin.log.name and r.levelno >= level]


def recorder(name: str, calls: list):
    """A stand-in for SGLang's function with its parameters: records each call, writes nothing."""
    if name == Q:

        def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions):
            calls.append((q_input, q_output, eps, freqs_cis, positions))

        return fused_q_norm_rope

    def fused_k_norm_rope_flashmla(
        kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout=KVLayout.V4, q=None
    ):
        calls.append((kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout, q))

    return fused_k_norm_rope_flashmla


def freqs(max_pos: int, gen) -> torch.Tensor:
    """SGLang's table: complex64 [max_pos, 32], cos + i sin of each GPT-J pair's angle."""
    return torch.polar(torch.ones(max_pos, 32), torch.rand(max_pos, 32, generator=gen) * 6.3)


def cos_sin(f: torch.Tensor) -> torch.Tensor:
    """Our [max_pos, 64] table of the same angles: the 32 cos columns, then the 32 sin columns."""
    return torch.cat((f.real, f.imag), dim=1).contiguous()


def poisoned(shape, dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` whose every byte is POISON."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), POISON, dtype=torch.uint8).view(dtype)


# ---- installing ------------------------------------------------------------------------------
def test_load_plugins_runs_our_entry_point_and_every_seam_and_re_export_is_ours(caplog):
    caplog.set_level(logging.INFO)
    sgl_plugins.load_plugins()  # the real discovery: entry point group sglang.srt.plugins
    assert plugin._installed is not None and plugin._installed.seams == list(TARGET.values())
    for name, target in TARGET.items():
        ((kind, hook, source),) = HookRegistry._hooks[target]
        assert kind is HookType.REPLACE and hook.__module__ == plugin.__name__
        assert source.plugin_name == "attn_prologue" and target in HookRegistry._patched
        applied = getattr(norm_rope, name)
        assert applied is not ORIGINAL[name] and applied.__wrapped__ is ORIGINAL[name]
        assert all(getattr(m, name) is applied for m in HOLDERS[name])  # propagated
    (line,) = our_records(caplog, logging.INFO)
    assert line.getMessage() == f"attn_prologue: replaced in SGLang 0.5.23: {', '.join(TARGET.values())}"
    plugin._installed.uninstall()
    assert untouched() and not HookRegistry._hooks and not HookRegistry._patched


def test_sglang_plugins_naming_another_plugin_leaves_sglang_untouched(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    sgl_plugins.load_plugins()
    assert plugin._installed is None and untouched()


def test_engine_plugins_off_leaves_sglang_untouched(monkeypatch, caplog):
    monkeypatch.setenv("ATTN_PROLOGUE_ENGINE_PLUGINS", "0")
    sgl_plugins.load_plugins()
    assert plugin._installed is None and untouched() and not HookRegistry._hooks
    assert not our_records(caplog)


def test_an_unknown_version_leaves_sglang_untouched_with_one_warning(caplog):
    assert plugin.install(version="0.5.22") is None
    HookRegistry.apply_hooks()
    (warning,) = our_records(caplog)
    assert "0.5.22" in warning.getMessage() and "0.5.23" in warning.getMessage()
    assert untouched() and not HookRegistry._hooks


@pytest.mark.parametrize("change", ["extra parameter", "missing"])
def test_a_changed_seam_leaves_every_seam_untouched_with_one_warning(change, monkeypatch, caplog):
    if change == "missing":
        monkeypatch.delattr(norm_rope, KV)
    else:

        def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache,
                                       page_size, layout=KVLayout.V4, q=None, extra=None): ...  # fmt: skip

        monkeypatch.setattr(norm_rope, KV, fused_k_norm_rope_flashmla)
    assert plugin.install() is None
    HookRegistry.apply_hooks()
    (warning,) = our_records(caplog)
    assert TARGET[KV] in warning.getMessage()
    assert not HookRegistry._hooks and norm_rope.fused_q_norm_rope is ORIGINAL[Q]  # the Q seam too


# ---- fused_q_norm_rope -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_q_rope_only_writes_the_bytes_of_our_op(dtype, pos_dtype):
    sgl_plugins.load_plugins()
    gen = torch.Generator().manual_seed(1)
    n, h = 5, 8
    q = torch.randn(n, h, 512, generator=gen).to(dtype)
    f = freqs(64, gen)
    positions = torch.randint(0, 64, (n,), generator=gen)
    q_out = poisoned((n, h, 512), dtype)
    model.fused_q_norm_rope(q, q_out, None, f, positions.to(pos_dtype))  # the model's own binding
    expected = poisoned((n, h, 512), dtype)
    page, no_slots = torch.zeros(1, 584, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    ap.qnorm_rope_kv_insert(q, q[:, 0], expected, page, no_slots, positions, cos_sin(f), 0.0, 1,
                            apply_q_norm=False)  # fmt: skip
    assert torch.equal(q_out.view(torch.uint8), expected.view(torch.uint8))
    # an FP8 q_output: SGLang's route, the bf16 result then copy_ (torch's conversion)
    if dtype == torch.bfloat16:
        q_fp8 = poisoned((n, h, 512), torch.float8_e4m3fn)
        model.fused_q_norm_rope(q, q_fp8, None, f, positions.to(pos_dtype))
        assert torch.equal(q_fp8.view(torch.uint8), expected.to(torch.float8_e4m3fn).view(torch.uint8))


def test_q_rope_follows_sglangs_table_and_pairs():
    """SGLang's Q kernel rotates pair i = dims (448 + 2i, 449 + 2i) by freqs_cis[pos, i] = re + i im:
    (x_re * re - x_im * im, x_re * im + x_im * re), and copies dims 0..447 (no norm, eps None). With
    re = 0, im = 1 both fused and unfused forms are exact: (-x_im, x_re); with re = 1, im = 0 the row
    is copied. So the bytes below are SGLang's, derived from its source, whatever rounds them."""
    sgl_plugins.load_plugins()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 512, generator=gen).bfloat16()
    f = torch.zeros(3, 32, dtype=torch.complex64)
    f[1], f[2] = 1j, 1  # token 0 at position 1 (a quarter turn), token 1 at position 2 (none)
    q_out = poisoned(q.shape, torch.bfloat16)
    norm_rope.fused_q_norm_rope(q, q_out, None, f, torch.tensor([1, 2]))
    turned = q[0].clone()
    turned[:, 448::2], turned[:, 449::2] = -q[0, :, 449::2], q[0, :, 448::2]
    assert torch.equal(q_out[0].view(torch.int16), turned.view(torch.int16))
    assert torch.equal(q_out[1].view(torch.int16), q[1].view(torch.int16))


def test_what_our_q_call_does_not_do_exactly_runs_sglangs_function(monkeypatch):
    calls: list = []
    monkeypatch.setattr(norm_rope, Q, recorder(Q, calls))
    plugin.install()
    HookRegistry.apply_hooks()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 512, generator=gen).bfloat16()
    f, pos = freqs(8, gen), torch.tensor([0, 1, 2])
    cases = [
        (q, torch.empty_like(q), 1e-6, f, pos),  # the norm path: SGLang rounds the normed row first
        (q.half(), torch.empty(3, 4, 512, dtype=torch.float8_e4m3fn), None, f, pos),  # SGLang asserts
        (q, torch.empty(3, 8, 512, dtype=torch.bfloat16), None, f, pos),  # padded heads: SGLang refuses
        (q, q, None, f, pos),  # in place
        (q, torch.empty_like(q), None, cos_sin(f), pos),  # a real table: SGLang's view_as_real refuses
        (q, torch.empty_like(q), None, f, pos.float()),  # float positions
        (q[..., :128].contiguous(), torch.empty(3, 4, 128, dtype=torch.bfloat16), None, f, pos),  # D=128
    ]
    for args in cases:
        norm_rope.fused_q_norm_rope(*args)
        assert all(a is b for a, b in zip(calls.pop(), args)) and not calls


# ---- fused_k_norm_rope_flashmla --------------------------------------------------------------
def swa_call(page_size: int, pages: int, dtype, gen, pos_dtype=torch.int64) -> dict:
    """A store as DeepSeekV4TokenToKVPool makes it: kv a slice of qkv_a (row stride 1536 + 512),
    out_loc int32 with a skipped row (-1) and slots on several pages, a poisoned page-padded cache."""
    n = 6
    qkv_a = torch.randn(n, 1536 + 512, generator=gen).to(dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:n].to(torch.int32)
    slots[2] = -1
    cache = torch.randint(
        0, 256, (pages, KVLayout.V41.page_bytes(page_size)), generator=gen, dtype=torch.uint8
    )
    return dict(
        kv=qkv_a[:, 1536:], kv_weight=(torch.rand(512, generator=gen) + 0.5).to(dtype), eps=1e-6,
        freqs_cis=freqs(32, gen), positions=torch.randint(0, 32, (n,), generator=gen).to(pos_dtype),
        out_loc=slots, kvcache=cache, page_size=page_size, layout=KVLayout.V41,
    )  # fmt: skip


def our_v41_bytes(call: dict) -> torch.Tensor:
    expected = call["kvcache"].clone()
    ap.kv_rope_insert(
        call["kv"], expected, call["out_loc"], call["positions"].long(), cos_sin(call["freqs_cis"]),
        call["page_size"], "mxfp8", norm_weight=call["kv_weight"], eps=call["eps"], numerics="preset=sglang",
    )  # fmt: skip
    return expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_the_v41_swa_store_writes_the_bytes_of_our_op(dtype, pos_dtype):
    sgl_plugins.load_plugins()
    gen = torch.Generator().manual_seed(4)
    call = swa_call(4, 3, dtype, gen, pos_dtype)  # 4 x 528 = 2112 B, padded to 2560 (5 x 512)
    expected = our_v41_bytes(call)
    norm_rope.fused_k_norm_rope_flashmla(**call)
    assert torch.equal(call["kvcache"], expected)


def test_the_pool_method_reaches_our_store_through_its_own_binding():
    """DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope (SGLang's code, unchanged)
    calls `fused_k_norm_rope_flashmla` as its module imported it: ours after propagation."""
    sgl_plugins.load_plugins()
    call = swa_call(64, 2, torch.bfloat16, torch.Generator().manual_seed(5))
    expected = our_v41_bytes(call)
    fake_pool = types.SimpleNamespace(
        uniform_fp8=False,
        swa_page_size=64,
        kv_layout=KVLayout.V41,
        get_swa_raw_buffer=lambda _: call["kvcache"],
    )
    pool.DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope(
        fake_pool, layer_id=0, swa_loc=call["out_loc"], kv=call["kv"], kv_weight=call["kv_weight"],
        eps=call["eps"], freqs_cis=call["freqs_cis"], positions=call["positions"],
    )  # fmt: skip
    assert torch.equal(call["kvcache"], expected)


def test_a_v41_row_gets_the_bytes_sglangs_writer_gives_it():
    """Derived from SGLang 0.5.23's source (main_norm_rope.cuh, fused_k_norm_rope_flashmla, V41 branch;
    kv_layout.cuh PagedKV and store_row_fp8), not from our op:
    * kv = 2 in every dim, eps = 1e-6: sum of squares 2048 in any order, rsqrt(4 + 1e-6) = 0.5 within
      2^-21 (approximate or not), so x * norm * w = w within 2^-20, far from any bf16 rounding boundary:
      the bf16 row is w = 3, -1, then 1 in dims 2..511.
    * RoPE with freqs_cis = i (cos 0, sin 1): v41_rope_pair(1, 1) = (fma(1, 0, -1), fma(1, 1, 0)) =
      (-1, 1) for every pair of dims 448..511.
    * store_row_fp8, tiles of 32: the exponent from amax's bits, 127 + e - 8, +1 when the mantissa
      exceeds 0x600000 (1.75): amax 3 (1.5 * 2^1) -> 120, x * 2^7: 3 -> 384 = 0x7C, -1 -> -128 = 0xF0,
      1 -> 128 = 0x70; amax 1 -> 119, x * 2^8: 1 -> 256 = 0x78, -1 -> 0xF8.
    * Page: token o of a page at o * 512, its 16 scale bytes at page_size * 512 + o * 16."""
    sgl_plugins.load_plugins()
    page_size, slot = 4, 6  # page 1, token 2
    cache = poisoned((2, KVLayout.V41.page_bytes(page_size)), torch.uint8)
    w = torch.ones(512, dtype=torch.bfloat16)
    w[0], w[1] = 3, -1
    f = torch.full((1, 32), 1j, dtype=torch.complex64)
    norm_rope.fused_k_norm_rope_flashmla(
        torch.full((1, 512), 2.0, dtype=torch.bfloat16), w, 1e-6, f, torch.tensor([0]),
        torch.tensor([slot], dtype=torch.int32), cache, page_size, KVLayout.V41,
    )  # fmt: skip
    data = [0x7C, 0xF0] + [0x70] * 30 + [0x78] * (448 - 32) + [0xF8, 0x78] * 32
    o = slot % page_size
    page = cache[slot // page_size].tolist()
    assert page[o * 512 : (o + 1) * 512] == data
    assert page[page_size * 512 + o * 16 : page_size * 512 + (o + 1) * 16] == [120] + [119] * 15
    written = set(range(o * 512, (o + 1) * 512)) | set(
        range(page_size * 512 + o * 16, page_size * 512 + o * 16 + 16)
    )
    assert all(b == POISON for i, b in enumerate(page) if i not in written)
    assert all(b == POISON for b in cache[0].tolist())


def test_what_our_store_does_not_do_exactly_runs_sglangs_function(monkeypatch):
    calls: list = []
    monkeypatch.setattr(norm_rope, KV, recorder(KV, calls))
    plugin.install()
    HookRegistry.apply_hooks()
    gen = torch.Generator().manual_seed(6)

    def case(**change):
        call = swa_call(4, 3, torch.bfloat16, gen)
        if "pages_of" in change:  # the cache laid out for another layout's page stride
            layout = change.pop("pages_of")
            call["kvcache"] = torch.zeros(3, layout.page_bytes(4), dtype=torch.uint8)
        return {**call, **change}

    cases = [
        case(layout=KVLayout.V4, pages_of=KVLayout.V4),  # quantizes the float32 normed row
        case(layout=KVLayout.V41_FP4, pages_of=KVLayout.V41_FP4),  # no kv_norm kernel for nvfp4_v41
        case(layout=KVLayout.V41_NEW, pages_of=KVLayout.V41_NEW),  # per-token scales: not our page
        case(layout=KVLayout.V41_FP4_NEW, pages_of=KVLayout.V41_FP4_NEW),
        case(q=torch.zeros(6, 4, 512, dtype=torch.bfloat16)),  # the ROCm query RoPE
        case(out_loc=torch.arange(6)),  # int64 slots: SGLang's kernel refuses them
        case(page_size=3, pages_of=KVLayout.V41),  # not a power of two: SGLang's kernel refuses it
        case(kvcache=torch.zeros(3, 2560 + 16, dtype=torch.uint8)[:, :2560]),  # another page stride
        case(kv_weight=torch.ones(512, dtype=torch.float16)),  # weight dtype unlike kv's
    ]
    for call in cases:
        before = call["kvcache"].clone()
        norm_rope.fused_k_norm_rope_flashmla(**call)
        got = dict(zip(plugin.KV_PARAMETERS, calls.pop()))
        assert all(got[k] is v for k, v in call.items()) and not calls
        assert torch.equal(call["kvcache"], before)


def test_a_call_our_op_refuses_runs_sglangs_function_and_says_so_once(monkeypatch, caplog):
    calls: list = []
    monkeypatch.setattr(norm_rope, KV, recorder(KV, calls))
    plugin.install()
    HookRegistry.apply_hooks()
    call = swa_call(4, 3, torch.bfloat16, torch.Generator().manual_seed(7))
    call["kv"] = torch.zeros(6, 1024, dtype=torch.bfloat16)[:, 4:516]  # 8 B aligned: ours needs 16
    for _ in range(2):
        norm_rope.fused_k_norm_rope_flashmla(**call)
    assert len(calls) == 2
    (warning,) = our_records(caplog)
    assert "fused_k_norm_rope_flashmla" in warning.getMessage() and "aligned" in warning.getMessage()


# ---- the indexer's Q: fused_q_indexer_rope_hadamard_quant / _fp4_quant --------------------------------
@pytest.mark.parametrize("name", [IQ8, IQ4])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_the_indexer_q_seams_give_sglangs_bytes_and_outputs(name, pos_dtype):
    """Through the indexer module's own binding: outputs of SGLang's types and shapes (FP8 [T, H, 128] and
    weights [T, H, 1]; FP4 ((int8 [T, H, 64], int32 [T, H]), weights)), bytes of the SGLang reference
    (index_q_hadamard.sglang_index_q, each rule cited to SGLang's CUDA source) on rows with Inf, NaN, -0."""
    sgl_plugins.load_plugins()
    gen = torch.Generator().manual_seed(3)
    n, h = 6, 16
    q = torch.randn(n, h, 128, generator=gen)
    q[0, 0, 3], q[1, 2, 100], q[2, 3], q[3, 4, 7] = float("inf"), float("nan"), -0.0, -1e-30
    q = q.bfloat16()
    w = torch.randn(n, h, generator=gen).bfloat16()
    f = freqs(64, gen)
    positions = torch.randint(0, 64, (n,), generator=gen)
    scale = 128**-0.5 * h**-0.5
    got = getattr(indexer, name)(q, w, scale, f, positions.to(pos_dtype))
    fp4 = name == IQ4
    codes, scales, weights = hq.sglang_index_q(
        q, positions, cos_sin(f), w, scale, 1.0, "fp4" if fp4 else "fp8"
    )
    (q_out, q_sf), w_out = got if fp4 else ((got[0], None), got[1])
    assert q_out.dtype == (torch.int8 if fp4 else torch.float8_e4m3fn) and q_out.shape == codes.shape
    assert torch.equal(q_out.view(torch.uint8), codes)
    assert w_out.shape == (n, h, 1) and torch.equal(
        w_out.view(torch.int32), weights.view(torch.int32).view(n, h, 1)
    )
    if fp4:
        assert q_sf.dtype == torch.int32 and q_sf.shape == (n, h)
        assert torch.equal(q_sf.view(torch.uint8).view(n, h, 4), scales)


def test_indexer_rows_sglangs_kernels_take_but_ours_does_not_run_sglangs_function(monkeypatch):
    """fp16 rows (SGLang's kernels are instantiated for the input dtype; the preset is bf16 only)."""
    calls: list = []

    def stand_in(q_input, weight, weight_scale, freqs_cis, positions):
        calls.append(q_input)
        return "sglang's"

    monkeypatch.setattr(norm_rope, IQ8, stand_in)
    sgl_plugins.load_plugins()
    q = torch.randn(2, 4, 128).half()
    got = norm_rope.fused_q_indexer_rope_hadamard_quant(
        q, q[..., 0], 0.1, freqs(8, None), torch.tensor([1, 2])
    )
    assert got == "sglang's"
    assert len(calls) == 1
