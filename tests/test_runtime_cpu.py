"""Dispatcher selection and errors, the config heuristic, and the scratch pool's accounting, locking
and views, on CPU (the tuning database: test_tuning_database.py)."""

import dataclasses

import attn_prologue as ap
import pytest
import torch
from attn_prologue import variants
from attn_prologue.cli.options import check_targets
from attn_prologue.errors import ScratchError, UnsupportedError
from attn_prologue.formats import UnknownFormatError
from attn_prologue.generated import registry
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import (
    ArchFamily,
    Conversions,
    IoDtype,
    Op,
    Request,
    Variant,
    arch_for_capability,
    find,
    generated,
    parse_name,
    unsupported_reason,
)


# ---- dispatch ----------------------------------------------------------------------------------
def test_capabilities_map_to_families_and_targets():
    assert arch_for_capability(9, 0) == (ArchFamily.SM90, "sm_90a")
    assert arch_for_capability(10, 0) == (ArchFamily.SM100, "sm_100a")
    # one family-specific target for both SM120 GPUs (RTX 50xx / RTX PRO 6000 and GB10)
    assert arch_for_capability(12, 0) == arch_for_capability(12, 1) == (ArchFamily.SM120, "sm_120f")
    assert arch_for_capability(10, 3) == (ArchFamily.SM100, "sm_103a")  # B300
    assert arch_for_capability(11, 0) == (ArchFamily.SM100, "sm_110a")  # Thor
    for unknown in ((8, 0), (12, 2), (10, 1)):
        with pytest.raises(UnsupportedError, match=f"{unknown[0]}.{unknown[1]}.*supported"):
            arch_for_capability(*unknown)
    with pytest.raises(UnsupportedError, match="did you mean sm_90a"):
        check_targets(["sm_90"])
    assert {t for f in ArchFamily for t in f.targets} == set(variants.TARGETS)


def request_of(v: Variant, conversions=None) -> Request:
    return Request(v.op, v.head_dim, v.rope_dim, v.cache_format, v.io_dtype, v.q_out, conversions, v.q_layout)


def test_every_generated_variant_is_found_by_its_request():
    names = sorted(generated())
    assert len(names) == len(registry.VARIANTS) > 100
    for name in names:
        v = parse_name(name)
        assert find(request_of(v, v.conversions), v.arch) == v
        if v.conversions is v.arch.default_conversions:
            assert find(request_of(v), v.arch) == v  # the default needs no choice


def test_portable_request_for_a_format_without_arch_conversions_uses_the_single_module():
    req = Request(Op.KV, 512, 64, "bf16", IoDtype.BF16, conversions=Conversions.PORTABLE)
    assert find(req, ArchFamily.SM120).name == "kv_d512r64_bf16_bf16_sm120"


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(head_dim=96), "head_dim=96: the lane mapping needs D == 128 or D % 256 == 0"),
        (dict(cache_format="mxfp4"), "mxfp4 stores D=128/R=64 records, not D=512/R=64"),
        (dict(rope_dim=32), "fp8_ds_mla stores D=512/R=64 records, not D=512/R=32"),
        (dict(head_dim=256, cache_format="bf16"), "it is supported but was not generated"),
    ],
)
def test_a_miss_says_what_list_why_says_and_names_the_nearest(change, reason):
    req = dataclasses.replace(Request(Op.QKV, 512, 64, "fp8_ds_mla", IoDtype.BF16), **change)
    with pytest.raises(UnsupportedError) as info:
        find(req, ArchFamily.SM120)
    msg = str(info.value)
    assert reason in msg and "nearest generated: " in msg
    why = unsupported_reason(req.variant(ArchFamily.SM120))
    assert why is None or why in msg  # the same sentence `list --why` prints
    nearest = msg.split("nearest generated: ")[1].split(", ")
    assert len(nearest) == 3 and all(n in generated() for n in nearest)


def test_native_conversions_are_not_offered_on_sm90():
    req = Request(Op.QKV, 512, 64, "fp8_ds_mla", IoDtype.BF16, conversions=Conversions.NATIVE)
    with pytest.raises(UnsupportedError, match="sm90 has no native ue8m0x2/e2m1x2 conversions"):
        find(req, ArchFamily.SM90)


def test_unknown_format_is_a_typed_error_naming_the_known_ones():
    with pytest.raises(UnknownFormatError, match="known formats: bf16, fp8_ds_mla"):
        find(Request(Op.KV, 512, 64, "fp9", IoDtype.BF16), ArchFamily.SM90)


def test_default_configs_and_their_arithmetic():
    from attn_prologue.codegen.archs import ARCH_SPECS, resident_warps

    for family in ArchFamily:
        assert ARCH_SPECS[family.value].default_config == family.default_config
        assert family.default_config.warps_per_cta == 4  # see codegen/archs.py for why, SM120 included
    # registers are allocated per warp in multiples of 8 per thread, CTAs whole: 41-48 registers give
    # 40 resident warps with 4-warp CTAs (10 CTAs of 6,144 registers), 40 registers give 48
    assert {resident_warps(r, 4, 64, 32) for r in range(41, 49)} == {40}
    assert resident_warps(40, 4, 64, 32) == 48 and resident_warps(44, 2, 48, 24) == 42
    assert resident_warps(32, 1, 48, 24) == 24  # CTA-limited
    h200 = ARCH_SPECS["sm90"].parts[1]
    assert round(h200.bytes_per_clock_per_sm, 1) == 18.4 and 12 < h200.warps_needed < 13
    text = ARCH_SPECS["sm120"].reasoning()
    assert "GB10" in text and "40-40 warps per SM" in text and "4-warp" in text


def test_launch_config_keys_round_trip():
    from attn_prologue.launch import all_configs

    for c in all_configs():
        assert LaunchConfig.from_key(c.key) == c
    with pytest.raises(ValueError):
        LaunchConfig(warps_per_cta=3)
    with pytest.raises(ValueError):
        LaunchConfig.from_key("w4")


# ---- scratch pool --------------------------------------------------------------------------------
def test_pool_accounting_views_lock_and_does_not_fit():
    pool = ap.ScratchPool()
    added = pool.reserve(max_tokens=16, padded_heads=8, head_dim=128, micro_batches=2, device="cpu")
    assert added == pool.reserved_bytes == 2 * 16 * 8 * 128 * 2
    assert (
        pool.reserve(max_tokens=8, padded_heads=8, head_dim=128, micro_batches=2, device="cpu") == 0
    )  # fits
    buf0 = pool.buffer(padded_heads=8, head_dim=128, micro_batch=0, device="cpu")
    buf1 = pool.buffer(padded_heads=8, head_dim=128, micro_batch=1, device="cpu")
    assert buf0.data_ptr() != buf1.data_ptr() and not buf0.any() and not buf1.any()  # zeroed once
    pool.lock()
    v = pool.view(5, padded_heads=8, head_dim=128, micro_batch=1, device="cpu")
    assert v.shape == (5, 8, 128) and v.data_ptr() == buf1.data_ptr()
    assert (
        pool.view(5, padded_heads=8, head_dim=128, micro_batch=1, device="cpu") is v
    )  # cached, no new tensor
    with pytest.raises(ScratchError, match="do not fit the locked scratch pool"):
        pool.view(17, padded_heads=8, head_dim=128, device="cpu")
    with pytest.raises(ScratchError, match="locked"):
        pool.reserve(max_tokens=32, padded_heads=8, head_dim=128, device="cpu")
    with pytest.raises(ScratchError, match="no scratch reserved"):
        pool.buffer(padded_heads=16, head_dim=128, device="cpu")
    assert pool.reserved_bytes == added


class Claimant:
    """Stands in for a bound op (which needs a GPU): records what the pool tells it."""

    def __init__(self):
        self.reasons = []

    def invalidate(self, reason):
        self.reasons.append(reason)


def test_pool_grows_before_lock_keeps_zero_once_ownership_and_retires_old_buffers():
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, padded_heads=8, head_dim=128, micro_batches=1, device="cpu")
    op = Claimant()
    t = pool.claim(2, owner=op, padded_heads=8, head_dim=128, device="cpu")
    v = pool.view(10, padded_heads=8, head_dim=128, device="cpu")  # not locked: grows (zeroed)
    assert v.shape[0] == 10 and not v.any() and v.data_ptr() != t.data_ptr()
    assert op.reasons and "replaced by a larger one (10 tokens)" in op.reasons[0]  # its buffer is gone
    assert pool.reserved_bytes == 10 * 8 * 128 * 2  # the old buffer is not counted (nor held by the pool)
    with pytest.raises(ScratchError, match="already serves H=2"):  # ownership moved to the new buffer
        pool.claim(4, padded_heads=8, head_dim=128, device="cpu")
    again = Claimant()
    pool.claim(2, owner=again, padded_heads=8, head_dim=128, device="cpu")
    pool.release()
    assert pool.reserved_bytes == 0 and again.reasons == [
        "its scratch buffer was released; bind the layer again"
    ]
    assert len(op.reasons) == 1  # told once


def test_a_bound_op_is_told_when_its_scratch_buffer_is_released():
    """A real bound op (on CPU, kernel stubbed) registers with the pool: after release() its next call
    is refused and it holds no buffer."""
    from .support.bad_inputs import BS, H, P, valid
    from .support.stub_kernels import StubRuntime, stub_bind

    rt = StubRuntime()
    op = stub_bind(runtime=rt, num_heads=H, padded_heads=P, max_tokens=12, block_size=BS)
    a = valid("cpu")
    args = [a[k] for k in ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")]
    op(*args)
    op.pool.release()
    with pytest.raises(ScratchError, match="its scratch buffer was released; bind the layer again"):
        op(*args)
    assert rt.kernel.calls == 1 and op.buffers == []


def test_a_zero_once_claim_is_for_one_head_count_and_one_q_layout():
    """The live elements of a zero-once buffer depend on the Q layout as well as on H (interleaved Q
    puts head h's dims in 16-element chunks P * 16 apart), so a second layout is refused like a
    second H; writers of every head (pads rewritten per call) never share a zero-once buffer."""
    key = dict(padded_heads=64, head_dim=512, device="cpu")
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, micro_batches=2, **key)
    pool.claim(16, **key)
    pool.claim(16, q_layout="head_major", **key)  # the same claim again is fine
    with pytest.raises(ScratchError, match=r"H=16 live heads \(head_major\).*H=16 \(interleaved\)"):
        pool.claim(16, q_layout="interleaved", **key)
    with pytest.raises(ScratchError, match="a writer of every head cannot share it"):
        pool.claim(16, writes_pads=True, **key)
    pool.claim(16, writes_pads=True, micro_batch=1, **key)
    pool.claim(48, q_layout="interleaved", writes_pads=True, micro_batch=1, **key)  # any H, any layout
    with pytest.raises(ScratchError, match="cannot be zero-once for H=16"):
        pool.claim(16, micro_batch=1, **key)
    pool.view(8, micro_batch=1, **key)  # grows (not locked): the new buffer keeps the claim's kind
    with pytest.raises(ScratchError, match="cannot be zero-once"):
        pool.claim(16, micro_batch=1, **key)


def test_claimants_are_held_weakly():
    import gc

    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, padded_heads=8, head_dim=128, micro_batches=1, device="cpu")
    pool.claim(2, owner=Claimant(), padded_heads=8, head_dim=128, device="cpu")
    gc.collect()
    pool.release()  # a dropped bound op is not kept alive, nor called


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU is told")
def test_without_a_gpu_the_pool_and_bind_point_to_the_cpu_way():
    with pytest.raises(ScratchError, match='pass device="cpu"'):
        ap.ScratchPool().reserve(max_tokens=4, padded_heads=8, head_dim=512)
    pool = ap.ScratchPool()
    assert pool.reserve(max_tokens=4, padded_heads=8, head_dim=512, device="cpu") == 2 * 4 * 8 * 512 * 2
    with pytest.raises(UnsupportedError, match="call attn_prologue.qnorm_rope_kv_insert or kv_rope_insert"):
        ap.bind(
            num_heads=4, padded_heads=8, head_dim=512, rope_dim=64, cache_format="fp8_ds_mla", block_size=64
        )


@pytest.mark.parametrize("head_dim", [256, 96])
def test_a_call_that_names_no_arch_is_not_told_of_one(head_dim):
    """A head dim no module takes, on the CPU (the reference): the miss names the request and its
    nearest generated variants without an arch (it was named as an _sm90 variant)."""
    n, h = 4, 8
    with pytest.raises(UnsupportedError) as info:
        ap.qnorm_rope_kv_insert(
            torch.randn(n, h, head_dim, dtype=torch.bfloat16), torch.randn(n, head_dim, dtype=torch.bfloat16),
            torch.empty(n, h, head_dim, dtype=torch.bfloat16), torch.zeros(8, 64 * 584, dtype=torch.uint8),
            torch.arange(n), torch.arange(n), torch.rand(64, 64), 1e-6, 64,
        )  # fmt: skip
    msg = str(info.value)
    assert msg.startswith(f"no kernel variant qkv_d{head_dim}r64_fp8_ds_mla_bf16: ")
    assert "_sm" not in msg and "nearest generated: qkv_d512r64_fp8_ds_mla_bf16" in msg
    with pytest.raises(
        UnsupportedError, match=f"no kernel variant kv_d{head_dim}r64_fp8_ds_mla_bf16: "
    ) as info:
        ap.kv_rope_insert(torch.randn(n, head_dim, dtype=torch.bfloat16), torch.zeros(8, 64 * 584, dtype=torch.uint8),
                          torch.arange(n), torch.arange(n), torch.rand(64, 64), 64, "fp8_ds_mla")  # fmt: skip
    assert "_sm" not in str(info.value)
