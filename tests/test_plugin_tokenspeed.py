"""The TokenSpeed plugin (attn_prologue.plugins.tokenspeed, docs/tokenspeed-plugin.md) against the
real tokenspeed_kernel 0.1.4 package, on CPU tensors: TokenSpeed's own `discover_plugins()` finds
and runs our entry point, its registry holds our kernel at Priority.PLUGIN, its `select_kernel`
picks ours over the in-tree kernels for bf16 and keeps theirs for fp16, and its op
`dsv4_swa_cache_insert` called on CPU tensors writes the bytes our op writes when called directly
(our kernel then runs our op's CPU implementation).

Only TokenSpeed's device detection is stubbed (tests/support/tokenspeed_env.py): an NVIDIA Hopper
platform for selection. TokenSpeed's own kernels are GPU kernels and never run here: where a test
needs "TokenSpeed's kernel ran", the in-tree kernel's registry entry is a recorder. Skipped where
tokenspeed_kernel (or tokenspeed-triton, which its import needs) is not installed; the environment
is listed in docs/tokenspeed-plugin.md.
"""

from __future__ import annotations

import logging

import pytest
import torch

from .support.tokenspeed_env import import_tokenspeed_kernel, nvidia_hopper, stub_platform

import_tokenspeed_kernel()

import attn_prologue as ap  # noqa: E402
import tokenspeed_kernel.platform as ts_platform  # noqa: E402
import tokenspeed_kernel.plugins as ts_plugins  # noqa: E402
from attn_prologue.plugins import tokenspeed as plugin  # noqa: E402
from tokenspeed_kernel.ops.attention import dsv4  # noqa: E402
from tokenspeed_kernel.ops.attention.dsv4 import triton as dsv4_triton  # noqa: E402
from tokenspeed_kernel.platform import Platform  # noqa: E402
from tokenspeed_kernel.registry import KernelRegistry, Priority  # noqa: E402
from tokenspeed_kernel.selection import select_kernel  # noqa: E402
from tokenspeed_kernel.signature import dense_tensor_format, format_signature  # noqa: E402

TRITON = "triton_dsv4_swa_cache_insert"
D, R, RECORD = 512, 64, 584
EPS = 1e-6
POISON = 0xA5


@pytest.fixture(autouse=True)
def clean_tokenspeed(monkeypatch):
    """No plugin loaded and our kernel not registered, before and after; an NVIDIA Hopper platform."""
    monkeypatch.delenv("ATTN_PROLOGUE_ENGINE_PLUGINS", raising=False)
    monkeypatch.delenv(ts_plugins.DISABLE_ENV_VAR, raising=False)

    def clean():
        if plugin._installed is not None:
            plugin._installed.uninstall()
        plugin._installed = None
        plugin._refused.clear()
        ts_plugins.reset_plugins()
        KernelRegistry.get()._unregister(plugin.NAME)
        KernelRegistry.get().clear_cache()

    clean()
    if not torch.cuda.is_available():
        Platform.override(nvidia_hopper())
    yield
    clean()


def in_tree() -> list[str]:
    return [
        s.name for s in KernelRegistry.get().list_kernels(plugin.FAMILY, plugin.MODE) if s.name != plugin.NAME
    ]


def our_records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name == plugin.log.name and r.levelno >= level]


def signature(dtype):
    return format_signature(
        q=dense_tensor_format(dtype),
        kv=dense_tensor_format(dtype),
        swa_kv_cache=dense_tensor_format(torch.uint8),
    )


def traits(has_q_out: bool) -> dict:
    return {"head_dim": D, "quant_block_size": 64, "rope_dim": R, "cache_layout": "fp8_swa_page_planar",
            "has_q_out": has_q_out}  # fmt: skip


def selected(dtype=torch.bfloat16, has_q_out=True) -> str:
    return select_kernel(plugin.FAMILY, plugin.MODE, signature(dtype), traits=traits(has_q_out)).name


@pytest.fixture
def in_tree_recorder(monkeypatch):
    """TokenSpeed's in-tree kernels' registry entries replaced by recorders (their GPU kernels cannot
    run on CPU tensors): returns the list of (name, kwargs) they were called with."""
    calls = []
    registry = KernelRegistry.get()
    for name in in_tree():

        def record(name=name, **kwargs):
            calls.append((name, kwargs))

        monkeypatch.setitem(registry._impls, name, record)
    registry.clear_cache()
    yield calls
    registry.clear_cache()


def counting(monkeypatch) -> list:
    """Count the calls of our op made by the plugin's kernel."""
    calls = []
    real = plugin.ops.qnorm_rope_kv_insert

    def qnorm_rope_kv_insert(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(plugin.ops, "qnorm_rope_kv_insert", qnorm_rope_kv_insert)
    return calls


# ---- inputs ----------------------------------------------------------------------------------
def make(
    gen,
    n,
    heads,
    page_size,
    pages,
    m=None,
    slot_dtype=torch.int64,
    pos_dtype=torch.int64,
    dtype=torch.bfloat16,
):
    """Fresh random inputs of TokenSpeed's op: q [n, heads, 512], kv [n, 512], a poisoned page-planar
    cache, `m` slots (default n: m < n is DP padding) with one negative, positions, a cos/sin table."""
    m = n if m is None else m
    q = (torch.randn(n, heads, D, generator=gen) * 3).to(dtype)
    kv = (torch.randn(n, D, generator=gen) * 2).to(dtype)
    cache = torch.full((pages, page_size * RECORD), POISON, dtype=torch.uint8)
    slots = torch.randperm(pages * page_size, generator=gen)[:m]
    if m > 1:
        slots[m // 2] = -1  # skipped: no byte changes
    max_pos = 4096
    positions = torch.randint(0, max_pos, (n,), generator=gen)
    theta = torch.rand(max_pos, R // 2, generator=gen) * 6.3
    cos_sin = torch.cat((theta.cos(), theta.sin()), dim=1).contiguous()
    return q, kv, cache, slots.to(slot_dtype), positions.to(pos_dtype), cos_sin


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like `t` whose every byte is POISON."""
    out = torch.empty_like(t)
    out.view(torch.uint8).fill_(POISON)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- installing ------------------------------------------------------------------------------
def test_discover_plugins_runs_our_entry_point_and_registers_our_kernel_at_plugin_priority(caplog):
    caplog.set_level(logging.INFO)
    before = set(in_tree())
    loaded = ts_plugins.discover_plugins()  # the real discovery: entry point group tokenspeed_kernel.plugins
    (ours,) = [p for p in loaded if p.name == "attn_prologue"]
    assert ours.kernel_names == (plugin.NAME,) and ours.num_kernels == 1
    assert plugin._installed is not None and plugin._installed.seams == [f"{plugin.DSV4_TRITON}.{TRITON}"]
    spec = KernelRegistry.get().get_by_name(plugin.NAME)
    assert spec.priority == int(Priority.PLUGIN) == 16 and spec.solution == "attn_prologue"
    assert spec.capability.vendors == frozenset({"nvidia"})
    triton_spec = KernelRegistry.get().get_by_name(TRITON)
    assert spec.traits == triton_spec.traits  # the in-tree kernels' traits
    assert spec.format_signatures == {signature(torch.bfloat16)} < triton_spec.format_signatures  # bf16 only
    assert set(in_tree()) == before  # nothing of TokenSpeed's removed or replaced
    assert getattr(dsv4_triton, TRITON) is KernelRegistry.get().get_impl(TRITON)
    (line,) = our_records(caplog, logging.INFO)
    assert (
        line.getMessage()
        == f"attn_prologue: replaced in tokenspeed-kernel 0.1.4: {plugin.DSV4_TRITON}.{TRITON}"
    )
    assert ts_plugins.discover_plugins() == []  # loaded once
    plugin._installed.uninstall()
    assert KernelRegistry.get().get_by_name(plugin.NAME) is None


def test_select_kernel_picks_ours_over_the_in_tree_kernels_for_bf16_only():
    assert selected() == TRITON  # before: TokenSpeed's (no CUDA extension here)
    ts_plugins.discover_plugins()
    for has_q_out in (True, False):
        assert selected(torch.bfloat16, has_q_out) == plugin.NAME
        assert selected(torch.float16, has_q_out) == TRITON  # TokenSpeed's fp16 record is not ours
    p = Platform.get()
    Platform.override(stub_platform(ts_platform, "amd", (9, 5)))
    KernelRegistry.get().clear_cache()
    try:
        assert selected() == TRITON  # capability NVIDIA only
    finally:
        Platform.override(p)
        KernelRegistry.get().clear_cache()
    plugin._installed.uninstall()
    assert selected() == TRITON


def test_a_reset_registry_gets_our_kernel_again_on_forced_discovery():
    ts_plugins.discover_plugins()
    KernelRegistry.get()._unregister(plugin.NAME)  # as a registry reset leaves it
    ts_plugins.discover_plugins(force=True)
    assert selected() == plugin.NAME


def test_engine_plugins_off_leaves_tokenspeed_untouched(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("ATTN_PROLOGUE_ENGINE_PLUGINS", "0")
    loaded = ts_plugins.discover_plugins()
    (ours,) = [p for p in loaded if p.name == "attn_prologue"]
    assert ours.num_kernels == 0 and plugin._installed is None and selected() == TRITON
    assert not our_records(caplog) and "ATTN_PROLOGUE_ENGINE_PLUGINS is off" in caplog.text


def test_tokenspeeds_own_disable_switch_skips_the_plugin(monkeypatch):
    monkeypatch.setenv(ts_plugins.DISABLE_ENV_VAR, "attn_prologue")
    ts_plugins.discover_plugins()
    assert plugin._installed is None and selected() == TRITON


def test_an_unknown_version_leaves_tokenspeed_untouched_with_one_warning(caplog):
    assert plugin.install(version="0.1.3") is None
    (warning,) = our_records(caplog)
    assert "0.1.3" in warning.getMessage() and "0.1.4" in warning.getMessage()
    assert KernelRegistry.get().get_by_name(plugin.NAME) is None and selected() == TRITON


@pytest.mark.parametrize("change", ["extra parameter", "missing"])
def test_a_changed_seam_leaves_tokenspeed_untouched_with_one_warning(change, monkeypatch, caplog):
    if change == "missing":
        monkeypatch.delattr(dsv4_triton, TRITON)
    else:

        def triton_dsv4_swa_cache_insert(
            q, kv, swa_kv_cache, slot_mapping, positions, cos_sin_cache, rms_norm_eps, page_size, q_out=None,
            enable_pdl=False,
        ):  # fmt: skip
            pass

        monkeypatch.setattr(dsv4_triton, TRITON, triton_dsv4_swa_cache_insert)
    assert plugin.install() is None
    (warning,) = our_records(caplog)
    assert TRITON in warning.getMessage() and "left untouched" in warning.getMessage()
    assert KernelRegistry.get().get_by_name(plugin.NAME) is None and selected() == TRITON


# ---- bytes through TokenSpeed's own op -------------------------------------------------------
CASES = [  # (tokens, heads, page_size, pages, slots: None = one per token, slot dtype, positions dtype)
    (1, 16, 64, 2, None, torch.int64, torch.int64),
    (7, 4, 64, 3, None, torch.int32, torch.int32),
    (33, 8, 16, 5, 20, torch.int64, torch.int64),  # DP padding: 20 of 33 rows inserted
    (5, 2, 64, 1, 0, torch.int64, torch.int64),  # no KV row at all
]


@pytest.mark.parametrize("with_q_out", [True, False], ids=["q_out", "in_place"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}h{c[1]}bs{c[2]}m{c[4]}{str(c[5])[-5:]}")
def test_tokenspeeds_op_writes_our_bytes(case, with_q_out, in_tree_recorder, monkeypatch):
    n, heads, page_size, pages, m, slot_dtype, pos_dtype = case
    ts_plugins.discover_plugins()
    ours = counting(monkeypatch)
    gen = torch.Generator().manual_seed(10 * CASES.index(case) + with_q_out)
    q, kv, cache, slots, positions, cos_sin = make(gen, n, heads, page_size, pages, m, slot_dtype, pos_dtype)
    q_in = q.clone()
    q_out = poisoned_like(q) if with_q_out else None

    dsv4.dsv4_swa_cache_insert(
        q, kv, cache, slots, positions, cos_sin, EPS, page_size, q_out=q_out, validate_positions=True
    )
    assert len(ours) == 1 and not in_tree_recorder

    want_q = poisoned_like(q)
    want_cache = torch.full_like(cache, POISON)
    ap.qnorm_rope_kv_insert(q_in, kv, want_q, want_cache, slots, positions.long(), cos_sin, EPS, page_size,
                            "fp8_ds_mla", numerics="preset=vllm")  # fmt: skip
    got_q = q_out if with_q_out else q
    assert torch.equal(bits(got_q), bits(want_q))
    assert torch.equal(cache, want_cache)
    if with_q_out:
        assert torch.equal(bits(q), bits(q_in))  # q is left unchanged
    written = torch.zeros_like(cache, dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            b, o = divmod(s, page_size)
            written[b, o * 576 : (o + 1) * 576] = True
            written[b, page_size * 576 + o * 8 : page_size * 576 + (o + 1) * 8] = True
    assert bool((cache[~written] == POISON).all())  # skipped rows and other slots untouched


def test_the_preset_is_what_tokenspeeds_rules_give_on_nan_and_inf(monkeypatch):
    """NaN -> 0xfe, a block holding Inf -> scale byte 255 (TokenSpeed's CUDA kernel: fminf(fmaxf(x, -448),
    448) and min(e + 127, 255)), a zero block -> byte 105, the pad byte 0."""
    ts_plugins.discover_plugins()
    gen = torch.Generator().manual_seed(7)
    q, kv, cache, slots, positions, cos_sin = make(gen, 1, 2, 64, 1)
    kv[0, 0:64] = 0
    kv[0, 64] = float("nan")
    kv[0, 128] = float("inf")
    dsv4.dsv4_swa_cache_insert(q, kv, cache, slots, positions, cos_sin, EPS, 64, validate_positions=True)
    o = int(slots[0])
    record, scales = cache[0, o * 576 : o * 576 + 448], cache[0, 64 * 576 + o * 8 : 64 * 576 + o * 8 + 8]
    assert scales[0] == 105 and scales[2] == 255 and scales[7] == 0
    assert record[64] == 0xFE and record[128] == 0xFE  # NaN; Inf * 0 = NaN
    assert bool((record[0:64] == 0).all())


def test_a_call_our_op_refuses_runs_tokenspeeds_kernel_with_one_warning(
    in_tree_recorder, monkeypatch, caplog
):
    ts_plugins.discover_plugins()
    ours = counting(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    # page_size 1: a 584 B page stride, accepted by TokenSpeed, not a multiple of 16 for ours
    q, kv, cache, slots, positions, cos_sin = make(gen, 3, 2, 1, 4)
    for _ in range(2):
        dsv4.dsv4_swa_cache_insert(q, kv, cache, slots, positions, cos_sin, EPS, 1, validate_positions=False)
    assert len(ours) == 2 and [name for name, _ in in_tree_recorder] == [TRITON, TRITON]
    assert set(in_tree_recorder[0][1]) == set(plugin.KERNEL_PARAMETERS)
    assert bool((cache == POISON).all())  # nothing written by ours
    (warning,) = our_records(caplog)
    assert "refused" in warning.getMessage()


def test_fp16_goes_to_tokenspeeds_kernel(in_tree_recorder, monkeypatch):
    ts_plugins.discover_plugins()
    ours = counting(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    q, kv, cache, slots, positions, cos_sin = make(gen, 2, 2, 64, 1, dtype=torch.float16)
    dsv4.dsv4_swa_cache_insert(q, kv, cache, slots, positions, cos_sin, EPS, 64, validate_positions=True)
    assert not ours and [name for name, _ in in_tree_recorder] == [TRITON]
