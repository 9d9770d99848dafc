"""Every sm_90a variant against the reference on the GPU, bit for bit (issue: kernels correct on a
real GPU). Outputs are poisoned before each run (q_out NaN / 0x7F, cache random bytes) and the
whole cache storage (page padding included) and the whole q_out are compared byte by byte with
the reference run on clones of the same poisoned buffers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attn_prologue import dispatch, ops
from attn_prologue.formats import get_format
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import INTERLEAVED_PADDED_HEADS, ArchFamily, QLayout, generated, parse_name

from .cases import (
    CONFIG_KEYS,
    CONFIG_VARIANTS,
    Case,
    compare,
    describe_mismatch,
    make_inputs,
    module_fields,
    run_kernel,
    run_reference,
)

pytestmark = pytest.mark.gpu

SM90 = sorted(n for n in generated() if parse_name(n).arch is ArchFamily.SM90)


def check(case: Case, **kw):
    x = make_inputs(case)
    got = run_kernel(x, **kw)
    want = run_reference(x, write_pad_heads=kw.get("write_pad_heads", True))
    torch.cuda.synchronize()
    diff = compare(got, want)
    assert all(v == 0 for v in diff.values()), f"{case}: {diff} {describe_mismatch(got, want)}"
    return x, got, want


def cases_for(name: str) -> list[Case]:
    v = parse_name(name)
    base = module_fields(v)
    cases = [
        Case(n=1, h=8, p=16, block_size=16, seed=1, **base),
        Case(n=7, h=16, p=16, block_size=64, negative_every=3, seed=2, **base),
        Case(n=64, h=8, p=64, block_size=256, m=50, page_pad=48, kv_row_pad=64, seed=3, **base),
        Case(n=513, h=16, p=32, block_size=64, negative_every=7, zero_rows=2, seed=4, **base),
    ]
    if v.q_layout is QLayout.INTERLEAVED:  # run that module (the call picks it), at a P it takes
        cases = [replace(c, p=INTERLEAVED_PADDED_HEADS[0], q_layout=v.q_layout.value) for c in cases]
    return cases


@pytest.mark.parametrize("name", SM90)
def test_variant_matches_reference(name):
    for case in cases_for(name):
        check(case)


# Every launch knob against the reference (CONFIG_KEYS in cases.py; run_suite.sh prebuilds them).
@pytest.mark.parametrize(
    "name, key",
    [
        (name, key)
        for name in CONFIG_VARIANTS
        for key in CONFIG_KEYS
        if not parse_name(name).refusal(LaunchConfig.from_key(key))  # the modules that take it
    ],
)
def test_launch_configs_match_reference(name, key):
    config = LaunchConfig.from_key(key)
    for case in cases_for(name):
        check(case, config=config)


MAIN = dict(head_dim=512, rope_dim=64, cache_format="fp8_ds_mla", dtype="bf16")


@pytest.mark.parametrize("n", [0, 1, 7, 64, 513, 4096])
@pytest.mark.parametrize(
    "hp",
    [(8, 8), (8, 16), (16, 16), (16, 32), (8, 64), (64, 64), (64, 128), (128, 128)]
    + [(1, 8), (3, 8), (5, 16), (12, 16), (24, 32), (96, 128), (100, 128)],  # row // H by a magic number
)
def test_token_counts_and_head_padding(n, hp):
    h, p = hp
    check(Case(n=n, h=h, p=p, block_size=64, negative_every=5 if n > 4 else 0, seed=n + h, **MAIN))


def test_in_place_p_equals_h():
    check(Case(n=300, h=32, p=32, in_place=True, seed=11, **MAIN))


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_block_sizes_page_padding_and_strided_kv(block_size):
    check(
        Case(
            n=700,
            h=16,
            p=64,
            block_size=block_size,
            page_pad=64 + 16 * block_size,
            kv_row_pad=128,
            seed=block_size,
            **MAIN,
        )
    )


def test_dp_padding_and_negative_slots():
    check(Case(n=257, h=64, p=64, m=130, negative_every=4, seed=21, **MAIN))


@pytest.mark.parametrize(
    "fmt,d",
    [
        ("fp8_ds_mla", 512),
        ("mxfp8", 512),
        ("fp8_token", 128),
        ("mxfp4", 128),
        ("bf16", 512),
        ("fp8_tensor", 128),
    ],
)
def test_fp16_and_extreme_values(fmt, d):
    # large values saturate fp8_tensor (scale 0.02) and the fp8 q output; zero rows give all-zero blocks
    for scale in (1e-3, 1.0, 300.0):
        check(
            Case(
                n=65,
                h=8,
                p=16,
                head_dim=d,
                cache_format=fmt,
                dtype="fp16",
                scale=scale,
                zero_rows=3,
                seed=int(scale * 10),
            )
        )
        check(
            Case(
                n=65,
                h=8,
                p=16,
                head_dim=d,
                cache_format=fmt,
                dtype="bf16",
                scale=scale * 1e3,
                q_fp8=True,
                zero_rows=3,
                seed=7,
            )
        )


def test_nan_and_inf_inputs():
    for fmt, d in (
        ("fp8_ds_mla", 512),
        ("mxfp8", 512),
        ("fp8_token", 128),
        ("mxfp4", 128),
        ("fp8_tensor", 512),
    ):
        x = make_inputs(Case(n=16, h=8, p=8, head_dim=d, cache_format=fmt, seed=5, op="kv"))
        x.kv[1, 3] = float("nan")
        x.kv[2, 5] = float("inf")
        x.kv[3, 7] = float("-inf")
        x.kv[4, :] = float("nan")
        got = run_kernel(x)
        want = run_reference(x)
        diff = compare(got, want)
        assert diff["cache_bytes_diff"] == 0, f"{fmt}: {describe_mismatch(got, want)}"


def test_zero_once_pads_untouched():
    x = make_inputs(Case(n=100, h=8, p=64, seed=9, **MAIN))
    got = run_kernel(x, write_pad_heads=False)
    want = run_reference(x, write_pad_heads=False)
    assert compare(got, want) == {"cache_bytes_diff": 0, "q_out_bytes_diff": 0}
    assert torch.isnan(got.q_out[:, 8:].float()).all()  # pads keep their poison: never written


def test_64bit_offsets():
    """T * H * D = 32768 * 128 * 512 > 2^31 elements: offsets past 4 GiB must be right."""
    n, h = 32768, 128
    case = Case(n=n, h=h, p=h, m=64, block_size=64, seed=31, extra_rows=0, **MAIN)
    x = make_inputs(case)
    got = run_kernel(x)
    torch.cuda.synchronize()
    # compare the last 64 tokens (byte offsets beyond 2^32) and a sample elsewhere, chunked to bound memory
    from attn_prologue import reference

    for lo in (0, n // 2, n - 64):
        sl = slice(lo, lo + 64)
        want = torch.full_like(got.q_out[sl], float("nan"))
        q = reference.q_values(x.q_in[sl], x.positions[sl], x.cos_sin_cache, 1e-6)
        reference.store_q(want, q)
        assert torch.equal(got.q_out[sl].view(torch.int16), want.view(torch.int16)), f"rows {lo}..{lo + 64}"
    want_storage = x.extra["k_storage"].clone()
    m = x.slot_mapping.shape[0]
    vals = reference.kv_values(x.kv[:m], x.positions[:m], x.cos_sin_cache)
    reference.insert_kv(
        want_storage[:, : x.k_cache.shape[1]], get_format("fp8_ds_mla"), vals, x.slot_mapping, 64
    )
    assert torch.equal(got.extra["k_storage"], want_storage)


def test_checked_mode_counts_and_skips_out_of_range():
    x = make_inputs(Case(n=40, h=8, p=8, seed=13, op="qkv", **MAIN))
    capacity = x.k_cache.shape[0] * 64
    x.slot_mapping[3] = capacity  # one past the end
    x.slot_mapping[5] = capacity + 1000
    x.positions[7] = x.cos_sin_cache.shape[0]  # one past the table
    x.positions[9] = -2
    err = dispatch.default_runtime().errors_buffer(x.kv.device)
    err.zero_()
    got = run_kernel(x, checked=True)
    torch.cuda.synchronize()
    assert err.tolist() == [4, 2]  # kv rows 3, 5, 7, 9 skipped; q tokens 7 and 9 zeroed
    # expected: the reference on the same inputs with those rows skipped / zeroed
    y = make_inputs(Case(n=40, h=8, p=8, seed=13, op="qkv", **MAIN))
    y.slot_mapping[[3, 5, 7, 9]] = -1
    y.positions[[7, 9]] = 0
    want = run_reference(y)
    want.q_out[[7, 9], :8] = 0
    assert compare(got, want) == {"cache_bytes_diff": 0, "q_out_bytes_diff": 0}


GRAPH_VARIANTS = [
    ("qkv", "fp8_ds_mla", 512, False),
    ("qkv", "fp8_ds_mla", 512, True),
    ("qkv", "mxfp8", 512, False),
    ("kv", "fp8_token", 128, False),
    ("kv_norm", "mxfp4", 128, False),
    ("qkv", "bf16", 128, False),
    ("kv", "fp8_tensor", 512, False),
    ("qkv", "nvfp4_dsv4", 512, False),
    ("kv", "nvfp4_v41", 512, False),
]


@pytest.mark.parametrize("op,fmt,d,q8", GRAPH_VARIANTS)
def test_cuda_graph_replay_matches_eager(op, fmt, d, q8):
    case = Case(n=96, h=16, p=32, head_dim=d, cache_format=fmt, op=op, q_fp8=q8, seed=41)
    x = make_inputs(case)
    g_out = run_reference(x)  # any buffers with the right shapes; contents replaced below
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def call():
        if op == "qkv":
            ops.qnorm_rope_kv_insert(
                x.q_in,
                x.kv,
                g_out.q_out,
                g_out.k_cache,
                x.slot_mapping,
                x.positions,
                x.cos_sin_cache,
                1e-6,
                case.block_size,
                fmt,
                kv_scale=x.kv_scale,
                q_scale=x.q_scale,
            )
        else:
            ops.kv_rope_insert(
                x.kv,
                g_out.k_cache,
                x.slot_mapping,
                x.positions,
                x.cos_sin_cache,
                case.block_size,
                fmt,
                norm_weight=x.norm_weight,
                eps=1e-6,
                kv_scale=x.kv_scale,
            )

    with torch.cuda.stream(stream):
        call()  # warm up (binds the kernel) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (42, 43):
        fresh = make_inputs(Case(n=96, h=16, p=32, head_dim=d, cache_format=fmt, op=op, q_fp8=q8, seed=seed))
        for name in ("q_in", "kv", "slot_mapping", "positions", "cos_sin_cache", "norm_weight"):
            src, dst = getattr(fresh, name), getattr(x, name)
            if dst is not None:
                dst.copy_(src)
        g_out.extra["k_storage"].copy_(fresh.extra["k_storage"])
        if g_out.q_out is not None:
            g_out.q_out.view(torch.uint8).copy_(fresh.q_out.view(torch.uint8))
        graph.replay()
        eager = run_kernel(fresh)
        torch.cuda.synchronize()
        assert compare(g_out, eager) == {k: 0 for k in compare(g_out, eager)}
