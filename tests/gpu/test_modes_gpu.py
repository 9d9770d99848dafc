"""The op modes DeepSeek-V4.1 engines call, on the GPU, bit for bit against the reference: Q norm
and Q RoPE on and off, the chunk-interleaved Q layout, the compressed-cache writer and the
indexer-key writer at every compress ratio their formats take, int32 and int64 slot ids, with DP
padding, negative and out-of-range slots, block sizes 32/64/256 and poisoned outputs (the whole
cache storage and the whole q_out are compared)."""

from __future__ import annotations

import pytest
import torch
from attn_prologue import api, dispatch
from attn_prologue.launch import LaunchConfig
from attn_prologue.scratch import ScratchPool

from .cases import (
    Case,
    boundaries,
    compare,
    describe_mismatch,
    make_inputs,
    run_kernel,
    run_reference,
)

pytestmark = pytest.mark.gpu


def check(case: Case, mutate=None, **kw):
    x = make_inputs(case)
    if mutate is not None:
        mutate(x)
    got = run_kernel(x, **kw)
    want = run_reference(x)
    torch.cuda.synchronize()
    diff = compare(got, want)
    assert all(v == 0 for v in diff.values()), f"{case}: {diff} {describe_mismatch(got, want)}"
    return x, got


QKV_FORMATS = [("fp8_ds_mla", False), ("mxfp8", False), ("mxfp8", True), ("nvfp4_dsv4", False)]


@pytest.mark.parametrize("fmt,q8", QKV_FORMATS)
@pytest.mark.parametrize("norm,rope", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("slot_dtype", ["int64", "int32"])
def test_q_modes(fmt, q8, norm, rope, slot_dtype):
    base = dict(cache_format=fmt, q_fp8=q8, apply_q_norm=norm, apply_q_rope=rope, slot_dtype=slot_dtype)
    check(Case(n=1, h=8, p=16, block_size=32, seed=1, **base))
    check(Case(n=130, h=16, p=64, m=70, block_size=64, negative_every=5, seed=2, **base))  # DP padding


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "mxfp8"])
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("hp", [(8, 64), (64, 64), (16, 128), (128, 128), (6, 64)])  # 6: odd heads, 58 pads
def test_interleaved_q_layout(fmt, q8, hp):
    h, p = hp
    for norm, rope in ((True, True), (False, True), (False, False)):
        base = dict(cache_format=fmt, q_fp8=q8, q_layout="interleaved", apply_q_norm=norm, apply_q_rope=rope)
        check(Case(n=1, h=h, p=p, seed=3, **base))
        check(Case(n=97, h=h, p=p, m=50, negative_every=4, block_size=256, seed=4, **base))


INTERLEAVED_CONFIGS = [
    "w2_u2_pdl1_nc1_lq_d",  # the H200 database's pick at T >= 2048
    "w4_u2_pdl1_nc1_cs",
    "w16_u2_pdl1_nc1",
    "w8_u1_pdl0_nc0_c4",  # one row a warp: no stage
    "w2_u4_pdl1_nc1_spread",
    "w4_u4_pdl1_nc1_c4_cs",  # persistent
    "w2_u1_pdl1_nc1_lq_d_q16",  # a row on 16 lanes: two adjacent heads a store, no stage
    "w2_u2_pdl1_nc1_lq_d_q16",  # and two passes of them
    "w4_u1_pdl1_nc1_cs_q8",  # four heads a store
]


@pytest.mark.parametrize("key", INTERLEAVED_CONFIGS)
@pytest.mark.parametrize("q8", [False, True])
def test_interleaved_q_rows_under_other_launch_configs(key, q8):
    """Chunk-interleaved Q rows across CTA sizes, passes per warp, persistent grids and KV spread. With
    2 or 4 passes a warp, rows go through shared memory when H is a multiple of them (8, 16, 64: u adjacent
    heads of one token) and straight to q_out when not (6 with 4 passes). On 16 or 8 lanes (q_lanes) a
    warp's rows are stored side by side as they are (with H = 6 on 8 lanes, rows of two tokens)."""
    for n, h, p in ((1, 8, 64), (513, 6, 64), (77, 16, 64), (200, 64, 128)):
        check(
            Case(n=n, h=h, p=p, m=n - n // 3, negative_every=5, q_layout="interleaved", q_fp8=q8, seed=n + h),
            config=LaunchConfig.from_key(key),
        )


def test_interleaved_zero_once_leaves_pads_alone():
    case = Case(n=40, h=8, p=64, q_layout="interleaved", seed=5)
    x = make_inputs(case)
    got = run_kernel(x, write_pad_heads=False)
    want = run_reference(x, write_pad_heads=False)
    torch.cuda.synchronize()
    assert compare(got, want) == {"cache_bytes_diff": 0, "q_out_bytes_diff": 0}


COMPRESSED = [(f, r) for f in ("fp8_ds_mla", "mxfp8", "nvfp4_v41") for r in (1, 2, 4, 128)] + [
    ("nvfp4_dsv4", 1),
    ("nvfp4_dsv4", 2),
]


@pytest.mark.parametrize("fmt,ratio", COMPRESSED)
@pytest.mark.parametrize("slot_dtype", ["int64", "int32"])
def test_compressed_cache_writer(fmt, ratio, slot_dtype):
    base = dict(op="kv", cache_format=fmt, compress_ratio=ratio, slot_dtype=slot_dtype)
    for i, bs in enumerate((32, 64, 256)):
        check(
            Case(n=150, block_size=bs, negative_every=6, page_align=512, seed=10 + i, **base),
            boundaries(ratio),
        )
    check(Case(n=1, block_size=64, seed=13, **base), boundaries(ratio))


# a KV row over 2 warps (LaunchConfig.row_split), 2 rows per warp: 1 to 513 rows, so a grid's last
# warps hold half a row group, negative and out-of-range slots counted once per row
ROW_SPLIT = LaunchConfig.from_key("w4_u2_pdl1_nc1_cs_lq_r2")


@pytest.mark.parametrize("fmt,ratio", COMPRESSED)
def test_kv_writers_with_a_row_over_two_warps(fmt, ratio):
    base = dict(op="kv", cache_format=fmt, compress_ratio=ratio)
    for i, (n, bs) in enumerate(((1, 64), (7, 32), (150, 64), (513, 256))):
        case = Case(n=n, block_size=bs, negative_every=6 if n > 6 else 0, page_align=512, seed=50 + i, **base)
        check(case, boundaries(ratio), config=ROW_SPLIT)
    case = Case(n=41, block_size=64, seed=55, **base)
    x = make_inputs(case)
    boundaries(ratio)(x)
    x.slot_mapping[3] = x.k_cache.shape[0] * case.block_size  # out of range
    x.positions[9] = x.cos_sin_cache.shape[0]
    x.positions[10] = -1
    err = dispatch.default_runtime().errors_buffer(x.kv.device)
    err.zero_()
    got, want = run_kernel(x, checked=True, config=ROW_SPLIT), run_reference(x)
    torch.cuda.synchronize()
    assert compare(got, want) == {k: 0 for k in compare(got, want)}, f"{case}: {describe_mismatch(got, want)}"
    assert err[0].item() == 3


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
@pytest.mark.parametrize("slot_dtype", ["int64", "int32"])
def test_indexer_key_writer(fmt, ratio, slot_dtype):
    """k_pre [N, 128]: weighted RMSNorm, bf16, RoPE at the group position, bf16, quantize; boundary rows only."""
    base = dict(op="kv_norm", head_dim=128, cache_format=fmt, compress_ratio=ratio, slot_dtype=slot_dtype)
    check(Case(n=200, block_size=64, negative_every=7, seed=20, **base), boundaries(ratio))
    check(Case(n=3, block_size=64, seed=21, **base), boundaries(ratio))


@pytest.mark.parametrize("slot_dtype", ["int64", "int32"])
def test_out_of_range_ids_are_skipped_and_counted_in_every_writer(slot_dtype):
    for op, fmt, d, ratio in (
        ("kv", "nvfp4_v41", 512, 2),
        ("kv_norm", "mxfp4", 128, 4),
        ("qkv", "mxfp8", 512, 1),
    ):
        case = Case(n=40, h=8, p=8, op=op, head_dim=d, cache_format=fmt, compress_ratio=ratio,
                    slot_dtype=slot_dtype, seed=30)  # fmt: skip
        x = make_inputs(case)
        boundaries(ratio)(x)
        capacity = x.k_cache.shape[0] * case.block_size
        x.slot_mapping[3] = capacity
        x.slot_mapping[6] = -7
        x.positions[9] = x.cos_sin_cache.shape[0]
        err = dispatch.default_runtime().errors_buffer(x.kv.device)
        err.zero_()
        got = run_kernel(x, checked=True)
        want = run_reference(x)
        torch.cuda.synchronize()
        assert compare(got, want) == {k: 0 for k in compare(got, want)}, (
            f"{case}: {describe_mismatch(got, want)}"
        )
        assert err[0].item() == 2  # kv rows 3 (slot = capacity) and 9 (position = max_pos)


def test_bound_kv_op_matches_the_one_call_function_and_replays_in_a_graph():
    fmt, ratio = "nvfp4_v41", 2
    case = Case(n=96, op="kv", cache_format=fmt, compress_ratio=ratio, seed=40)
    x = make_inputs(case)
    boundaries(ratio)(x)
    want = run_reference(x)
    op = api.bind_kv(cache_format=fmt, block_size=case.block_size, compress_ratio=ratio)
    got = run_reference(x)  # same layout; its bytes are replaced below
    got.extra["k_storage"].copy_(x.extra["k_storage"])
    op(x.kv, got.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache)
    torch.cuda.synchronize()
    assert compare(got, want) == {"cache_bytes_diff": 0}
    # int32 ids on the same bound op, then a CUDA-graph replay of it
    slots32 = x.slot_mapping.to(torch.int32)
    got.extra["k_storage"].copy_(x.extra["k_storage"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(x.kv, got.k_cache, slots32, x.positions, x.cos_sin_cache)
    torch.cuda.current_stream().wait_stream(stream)
    assert compare(got, want) == {"cache_bytes_diff": 0}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x.kv, got.k_cache, slots32, x.positions, x.cos_sin_cache)
    got.extra["k_storage"].copy_(x.extra["k_storage"])
    graph.replay()
    torch.cuda.synchronize()
    assert compare(got, want) == {"cache_bytes_diff": 0}


def test_bound_qkv_op_with_v41_modes():
    """V4.1 on SM100: apply_q_norm=False, interleaved Q into a locked pool, int32 ids."""
    case = Case(n=50, h=16, p=64, cache_format="mxfp8", apply_q_norm=False, q_layout="interleaved",
                slot_dtype="int32", seed=50)  # fmt: skip
    x = make_inputs(case)
    want = run_reference(x)
    pool = ScratchPool()
    pool.reserve(max_tokens=64, padded_heads=64, head_dim=512)
    pool.lock()
    op = api.bind(num_heads=16, padded_heads=64, cache_format="mxfp8", block_size=case.block_size, pool=pool,
                  apply_q_norm=False, q_layout="interleaved")  # fmt: skip
    storage = x.extra["k_storage"].clone()
    k_cache = storage[:, : x.k_cache.shape[1]]
    q = op(x.q_in, x.kv, k_cache, x.slot_mapping, x.positions, x.cos_sin_cache)
    torch.cuda.synchronize()
    assert torch.equal(storage, want.extra["k_storage"])
    assert torch.equal(q.view(torch.int16), want.q_out[: case.n].view(torch.int16))


def test_a_ratio_the_format_does_not_take_is_refused_before_writing():
    from attn_prologue import ops
    from attn_prologue.errors import UnsupportedError

    x = make_inputs(Case(n=8, op="kv", cache_format="nvfp4_dsv4", seed=60))
    before = x.extra["k_storage"].clone()
    with pytest.raises(UnsupportedError, match="compress_ratio=4.*supported: 1, 2"):
        ops.kv_rope_insert(x.kv, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, 64, "nvfp4_dsv4",
                           compress_ratio=4)  # fmt: skip
    assert torch.equal(x.extra["k_storage"], before)
