"""The op modes on CPU (the reference path of the torch ops): Q norm / Q RoPE off, the interleaved Q
layout, the compressed-cache and indexer-key writers (compress_ratio), int32 slot ids, and the typed
errors of each mode. Expected values are computed here from the definitions in docs/op.md, not by
calling the code under test a second way."""

from __future__ import annotations

import pytest
import torch
from attn_prologue import kv_rope_insert, qnorm_rope_kv_insert, reference
from attn_prologue.errors import InputError, UnsupportedError
from attn_prologue.formats import get_format


def inputs(n=9, h=4, p=64, d=512, r=64, fmt="fp8_ds_mla", bs=16, seed=0, slot_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    f = get_format(fmt)
    blocks = (n + bs - 1) // bs * 2 + 1
    theta = torch.rand(300, r // 2, generator=g) * 6.28
    return dict(
        q_in=torch.randn(n, h, d, generator=g).to(torch.bfloat16),
        kv=torch.randn(n, d, generator=g).to(torch.bfloat16),
        q_out=torch.full((n + 2, p, d), float("nan"), dtype=torch.bfloat16),
        k_cache=torch.randint(0, 256, (blocks, bs * f.bytes_per_token(d)), generator=g, dtype=torch.uint8),
        slot_mapping=torch.randperm(blocks * bs, generator=g)[:n].to(slot_dtype),
        positions=torch.randint(0, 300, (n,), generator=g),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
    )


def qkv(a, fmt="fp8_ds_mla", bs=16, **kw):
    qnorm_rope_kv_insert(a["q_in"], a["kv"], a["q_out"], a["k_cache"], a["slot_mapping"], a["positions"],
                         a["cos_sin_cache"], 1e-6, bs, fmt, **kw)  # fmt: skip


def test_interleaved_layout_puts_each_value_where_the_definition_says():
    a = inputs(n=3, h=5, p=64)
    b = {k: v.clone() for k, v in a.items()}
    qkv(a, q_layout="interleaved")
    qkv(b)  # head-major: the same values, in the other order
    n, h, p, d = 3, 5, 64, 512
    flat = a["q_out"][:n].reshape(n, p * d)
    for t in range(n):
        for head in (0, 4):
            for dim in (0, 15, 16, 100, 511):
                assert flat[t, (dim // 16) * p * 16 + head * 16 + dim % 16] == b["q_out"][t, head, dim]
        pads = flat[t].view(d // 16, p, 16)[:, h:]
        assert (pads == 0).all()  # every chunk's pad heads
    assert torch.isnan(a["q_out"][n:].float()).all()  # rows >= N untouched
    assert torch.equal(a["k_cache"], b["k_cache"])  # the layout changes Q only


def test_q_norm_and_rope_switches():
    a = inputs(n=4, h=2, p=2)
    eps = 1e-6
    x = a["q_in"].float()
    cs = a["cos_sin_cache"][a["positions"]]
    # no norm, no rope: q_out is q_in itself
    b = {k: v.clone() for k, v in a.items()}
    qkv(b, apply_q_norm=False, apply_q_rope=False)
    assert torch.equal(b["q_out"][:4], a["q_in"])
    # rope only: the rotated dims follow GPT-J pairs, the others are q_in
    c = {k: v.clone() for k, v in a.items()}
    qkv(c, apply_q_norm=False)
    e, o = x[..., 448::2], x[..., 449::2]
    cos, sin = cs[:, None, :32], cs[:, None, 32:]
    want_even = (e * cos - o * sin).to(torch.bfloat16).float()
    assert torch.equal(c["q_out"][:4, :, :448], a["q_in"][:, :, :448])
    assert (c["q_out"][:4, :, 448::2].float() - want_even).abs().max() <= 2**-6  # 1 bf16 ulp (fma order)
    # norm only: x / rms(x), no rotation anywhere
    d = {k: v.clone() for k, v in a.items()}
    qkv(d, apply_q_rope=False)
    normed = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    assert (d["q_out"][:4].float() - normed).abs().max() <= 2**-6 * normed.abs().max()
    # the KV path ignores the Q switches
    assert torch.equal(b["k_cache"], c["k_cache"]) and torch.equal(c["k_cache"], d["k_cache"])


@pytest.mark.parametrize(
    "fmt,d,norm", [("fp8_ds_mla", 512, False), ("nvfp4_v41", 512, False), ("mxfp4", 128, True)]
)
@pytest.mark.parametrize("ratio", [2, 4, 128])
def test_compressed_writers_insert_group_boundaries_rotated_at_the_group_start(fmt, d, norm, ratio):
    a = inputs(n=12, d=d, fmt=fmt, seed=ratio)
    pos = a["positions"]
    pos[::3] = (pos[::3] // ratio + 1) * ratio - 1  # boundaries: (p + 1) % r == 0
    pos[1::3] = pos[1::3] // ratio * ratio + (ratio > 2)  # not boundaries (for r = 2: p even)
    weight = (torch.rand(d) + 0.5).to(torch.bfloat16) if norm else None
    before = a["k_cache"].clone()
    kv_rope_insert(a["kv"], a["k_cache"], a["slot_mapping"], pos, a["cos_sin_cache"], 16, fmt, weight,
                   compress_ratio=ratio)  # fmt: skip
    # expected: an ordinary insert (r = 1) of the boundary rows only, at position p // r * r
    boundary = (pos + 1) % ratio == 0
    want = before.clone()
    slots = torch.where(boundary, a["slot_mapping"], torch.full_like(a["slot_mapping"], -1))
    kv_rope_insert(a["kv"], want, slots, pos // ratio * ratio, a["cos_sin_cache"], 16, fmt, weight)
    assert boundary.any() and not boundary.all()
    assert torch.equal(a["k_cache"], want)


def test_int32_slot_ids_write_the_same_bytes_as_int64():
    for fmt in ("fp8_ds_mla", "nvfp4_dsv4"):
        a, b = inputs(fmt=fmt, seed=3), inputs(fmt=fmt, seed=3, slot_dtype=torch.int32)
        a["slot_mapping"][2] = -1
        b["slot_mapping"][2] = -1
        qkv(a, fmt)
        qkv(b, fmt)
        assert torch.equal(a["k_cache"], b["k_cache"]) and torch.equal(
            a["q_out"].view(torch.int16), b["q_out"].view(torch.int16)
        )


def test_mode_errors_are_typed_and_write_nothing():
    a = inputs(fmt="nvfp4_dsv4")
    before = a["k_cache"].clone()
    with pytest.raises(UnsupportedError, match="compress_ratio=4 .*supported: 1, 2"):
        kv_rope_insert(a["kv"], a["k_cache"], a["slot_mapping"], a["positions"], a["cos_sin_cache"], 16,
                       "nvfp4_dsv4", compress_ratio=4)  # fmt: skip
    with pytest.raises(UnsupportedError, match="compress_ratio=3"):
        kv_rope_insert(a["kv"], a["k_cache"], a["slot_mapping"], a["positions"], a["cos_sin_cache"], 16,
                       "nvfp4_dsv4", compress_ratio=3)  # fmt: skip
    with pytest.raises(InputError, match="int64 or int32"):
        kv_rope_insert(a["kv"], a["k_cache"], a["slot_mapping"].to(torch.int16), a["positions"],
                       a["cos_sin_cache"], 16, "nvfp4_dsv4")  # fmt: skip
    assert torch.equal(a["k_cache"], before)
    b = inputs(p=48)
    q_before = b["q_out"].clone()
    with pytest.raises(InputError, match="interleaved Q layout .* P=48"):
        qkv(b, q_layout="interleaved")
    with pytest.raises(InputError, match="q_layout must be one of head_major, interleaved"):
        qkv(b, q_layout="chunked")
    assert torch.equal(b["q_out"].view(torch.int16), q_before.view(torch.int16))
    c = inputs(h=64, p=64)
    with pytest.raises(InputError, match="interleaved q_out cannot be written in place"):
        qkv({**c, "q_out": c["q_in"]}, q_layout="interleaved")


def test_modes_trace_under_torch_compile_without_graph_breaks():
    a, b = inputs(seed=7), inputs(seed=7)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q_in, kv, q_out, k_cache, slots, positions, cos_sin):
        qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, positions, cos_sin, 1e-6, 16, "fp8_ds_mla",
                             apply_q_norm=False, q_layout="interleaved")  # fmt: skip
        kv_rope_insert(kv, k_cache, slots, positions, cos_sin, 16, "fp8_ds_mla", compress_ratio=4)

    step(*(a[k] for k in ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")))
    reference.qnorm_rope_kv_insert(b["q_in"], b["kv"], b["q_out"], b["k_cache"], b["slot_mapping"], b["positions"],
                                   b["cos_sin_cache"], 1e-6, 16, apply_q_norm=False, q_layout="interleaved")  # fmt: skip
    reference.kv_rope_insert(b["kv"], b["k_cache"], b["slot_mapping"], b["positions"], b["cos_sin_cache"], 16,
                             compress_ratio=4)  # fmt: skip
    assert torch.equal(a["k_cache"], b["k_cache"])
    assert torch.equal(a["q_out"].view(torch.int16), b["q_out"].view(torch.int16))


def test_parity_choices_reach_the_cpu_path_in_either_spelling_and_a_missing_one_writes_nothing():
    from attn_prologue.formats import Numerics, NumericsError, ScaleFloor

    a, b = inputs(fmt="mxfp8", seed=9), inputs(fmt="mxfp8", seed=9)
    for x in (a, b):
        x["kv"][:3] *= 1e-4  # small blocks: the two scale floors give different bytes
    qkv(a, "mxfp8", numerics="scale_floor=scale")
    reference.qnorm_rope_kv_insert(b["q_in"], b["kv"], b["q_out"], b["k_cache"], b["slot_mapping"], b["positions"],
                                   b["cos_sin_cache"], 1e-6, 16, "mxfp8",
                                   numerics=Numerics(scale_floor=ScaleFloor.SCALE))  # fmt: skip
    assert torch.equal(a["k_cache"], b["k_cache"])
    c = inputs(fmt="mxfp8", seed=9)
    c["kv"][:3] *= 1e-4
    qkv(c, "mxfp8")  # the default floor differs on those blocks
    assert not torch.equal(c["k_cache"], a["k_cache"])
    d = inputs(fmt="nvfp4_v41", seed=9)
    before = d["k_cache"].clone()
    with pytest.raises(
        NumericsError, match="nvfp4_v41 has no scale_floor choice.*fp4_zero=signed\\|positive\\|exact"
    ):
        kv_rope_insert(d["kv"], d["k_cache"], d["slot_mapping"], d["positions"], d["cos_sin_cache"], 16,
                       "nvfp4_v41", numerics="scale_floor=scale")  # fmt: skip
    with pytest.raises(NumericsError, match="not a parity choice"):
        kv_rope_insert(d["kv"], d["k_cache"], d["slot_mapping"], d["positions"], d["cos_sin_cache"], 16,
                       "nvfp4_v41", numerics="fp4_zero=negative")  # fmt: skip
    with pytest.raises(NumericsError, match="preset vllm has no cache format nvfp4_v41.*vllm-triton, sglang"):
        kv_rope_insert(d["kv"], d["k_cache"], d["slot_mapping"], d["positions"], d["cos_sin_cache"], 16,
                       "nvfp4_v41", numerics="preset=vllm")  # fmt: skip
    for bad in ([1], "fp4_zero=zero", "fp4_zero=positive, fp4_zero=signed"):  # issue 28 item 14
        with pytest.raises(NumericsError):
            kv_rope_insert(d["kv"], d["k_cache"], d["slot_mapping"], d["positions"], d["cos_sin_cache"], 16,
                           "nvfp4_v41", numerics=bad)  # fmt: skip
    assert torch.equal(d["k_cache"], before)


def test_a_field_given_as_its_value_string_is_that_field_everywhere():
    """Numerics(scale_floor="scale") is Numerics(scale_floor=ScaleFloor.SCALE): the same kernel bits
    and the same bytes on the CPU path (it used to be dropped on the CUDA paths, issue 28 item 14)."""
    from attn_prologue.formats import Numerics, NumericsFlag, ScaleFloor

    assert Numerics(scale_floor="scale") == Numerics(scale_floor=ScaleFloor.SCALE)
    assert get_format("mxfp8").numerics_flags(Numerics(scale_floor="scale")) == NumericsFlag.SCALE_FLOOR
    a, b = inputs(fmt="mxfp8", seed=3), inputs(fmt="mxfp8", seed=3)
    for x in (a, b):
        x["kv"][:3] *= 1e-4
    qkv(a, "mxfp8", numerics=Numerics(scale_floor="scale"))
    qkv(b, "mxfp8", numerics=Numerics(scale_floor=ScaleFloor.SCALE))
    assert torch.equal(a["k_cache"], b["k_cache"])
