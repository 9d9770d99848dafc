"""The indexer's Q prologue on the GPU: every generated module this GPU runs, bit for bit against the
reference on poisoned outputs, for every preset (and Hadamard bits no preset combines), random rows with the conversions' edge rows, a token
outside the table, float32 and bf16 weights_out, every launch knob it takes, vLLM's function, CUDA-graph
replay and torch.compile."""

from __future__ import annotations

import attn_prologue as ap
import pytest
import torch
from attn_prologue.compat import vllm_indexer
from attn_prologue.index_q import IndexQFlag, index_q_reference
from attn_prologue.index_q_hadamard import sglang_index_q, tokenspeed_index_q
from attn_prologue.launch import LaunchConfig
from attn_prologue.selftest import edge_rows

pytestmark = pytest.mark.gpu

D, R, MAX_POS = 128, 64, 4096


def make(t, h, dtype, seed=0, bad_token=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, D, generator=g) * 4).to(dtype)
    edges = edge_rows(D)
    n = min(len(edges), t)
    q[:n, 0] = edges[:n].to(dtype)  # zeros, subnormals, floors, ties, Inf, NaN in head 0 of the first tokens
    if t > 9:
        q[9] *= 1e-6  # whole tokens below the floors
    theta = torch.rand(MAX_POS, R // 2, generator=g) * 6.28
    positions = torch.randint(0, MAX_POS, (t,), generator=g)
    if bad_token is not None and t > bad_token:
        positions[bad_token] = MAX_POS + 5
    cpu = dict(q=q, positions=positions, cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
               weights=torch.randn(t, h, generator=g).to(dtype), softmax_scale=0.0884, head_scale=0.125)  # fmt: skip
    return cpu, {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in cpu.items()}


def poisoned(t, h, fmt, w_dtype):
    codes = torch.full((t, h, D // 2 if fmt == "mxfp4" else D), 0x55, dtype=torch.uint8, device="cuda")
    scales = torch.full((t, h, D // 32), 0x55, dtype=torch.uint8, device="cuda") if fmt == "mxfp4" else None
    return codes, torch.full((t, h), 7.0, device="cuda").to(w_dtype), scales


def check(cpu, got, fmt, numerics, w_dtype):
    codes, w, scales = got
    want = index_q_reference(*cpu.values(), fmt, numerics, w_dtype)
    torch.cuda.synchronize()
    bad = (codes.cpu() != want[0]).nonzero()
    assert bad.numel() == 0, f"{len(bad)} code bytes differ, first at {bad[:4].tolist()}"
    assert torch.equal(w.cpu().view(torch.int16 if w_dtype == torch.bfloat16 else torch.int32),
                       want[2].view(torch.int16 if w_dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    if scales is not None:
        assert torch.equal(scales.cpu(), want[1])


F = IndexQFlag
CASES = [
    (fmt, dtype, numerics, w_dtype)
    for fmt in ("fp8_token", "mxfp4")
    for dtype, numerics in (
        (torch.bfloat16, "vllm"),
        (torch.bfloat16, "vllm-triton"),
        (torch.float16, "vllm-triton"),
        (torch.bfloat16, "sglang"),
        (torch.bfloat16, "tokenspeed"),
        # the Hadamard bits no preset sets alone or together: the pow2 FP8 scale and RNE-free codes after the
        # transform, TokenSpeed's Triton sums on sm_90, fp16 rows
        (torch.bfloat16, int(F.HADAMARD)),
        (torch.bfloat16, int(F.HADAMARD | F.TRITON_SM90_SUMS | F.NOPE_ROTATED | F.INF_SATURATES)),
        (torch.float16, int(F.HADAMARD | F.ROPE_UNFUSED | F.ROTATED_BF16 | F.UNROUNDED)),
        (torch.float16, int(F.HADAMARD)),  # (the float32 rows' shrunk nearest-even codes, not bf16 words)
    )
    for w_dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("fmt, dtype, numerics, w_dtype", CASES)
@pytest.mark.parametrize("t, h", [(1, 64), (37, 64), (300, 8), (1024, 64)])
def test_kernel_matches_the_reference(fmt, dtype, numerics, w_dtype, t, h):
    cpu, dev = make(t, h, dtype, seed=t + h, bad_token=5)
    out = poisoned(t, h, fmt, w_dtype)
    errors = ap.default_runtime().errors_buffer(dev["q"].device)
    before = int(errors[1])
    ap.index_q_rope_quant(
        **dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, numerics=numerics
    )
    check(cpu, out, fmt, numerics, w_dtype)
    assert int(errors[1]) - before == (1 if t > 5 else 0)  # the token outside the table, counted once


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize(
    "config",
    [
        LaunchConfig(
            warps_per_cta=w, passes_per_warp=p, pdl=pdl, non_coherent=nc, streaming=st, ctas_per_sm=c
        )
        for w, p, pdl, nc, st, c in [
            (4, 1, True, True, True, 0),
            (8, 2, False, False, False, 0),
            (2, 4, True, True, False, 2),
            (1, 1, True, False, True, 1),
        ]
    ],  # fmt: skip
    ids=lambda c: c.key,
)
def test_every_launch_knob_gives_the_same_bytes(fmt, config):
    cpu, dev = make(777, 64, torch.bfloat16, seed=3)
    out = poisoned(777, 64, fmt, torch.float32)
    ap.index_q_rope_quant(**dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, config=config)
    check(cpu, out, fmt, None, torch.float32)


@pytest.mark.parametrize("fmt, dtype, numerics", sorted({c[:3] for c in CASES}, key=str), ids=str)
def test_rows_on_four_lanes_give_the_same_bytes(fmt, dtype, numerics):
    """LaunchConfig.q_lanes=4 (a row's 16 vectors on 4 lanes, 4 slots a lane: the tuner's other layout) for
    every preset and bits of the cases above, a token outside the table among the rows."""
    cpu, dev = make(300, 64, dtype, seed=21, bad_token=7)
    out = poisoned(300, 64, fmt, torch.float32)
    config = LaunchConfig(warps_per_cta=4, pdl=True, non_coherent=True, streaming=True, q_lanes=4)
    ap.index_q_rope_quant(
        **dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, numerics=numerics, config=config
    )
    check(cpu, out, fmt, numerics, torch.float32)


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize("numerics", ["vllm", "sglang"])
def test_int32_positions_run_their_own_module_to_the_same_bytes(fmt, numerics):
    """SGLang's indexer passes int32 positions: a module compiled for them (LaunchConfig.positions32), a
    token outside the table among them."""
    cpu, dev = make(300, 64, torch.bfloat16, seed=13, bad_token=7)
    dev["positions"] = dev["positions"].to(torch.int32)
    out = poisoned(300, 64, fmt, torch.float32)
    ap.index_q_rope_quant(
        **dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, numerics=numerics
    )
    check(cpu, out, fmt, numerics, torch.float32)


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize("engine", ["sglang", "tokenspeed"])
def test_hadamard_presets_give_their_engine_references_bytes(engine, fmt):
    """The kernel against the engine-derived references themselves (index_q_hadamard: each rule cited from the
    engine's source), not only the composed reference."""
    cpu, dev = make(333, 64, torch.bfloat16, seed=11)
    out = poisoned(333, 64, fmt, torch.float32)
    ap.index_q_rope_quant(**dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, numerics=engine)
    fn = sglang_index_q if engine == "sglang" else tokenspeed_index_q
    engine_fmt = {"fp8_token": "fp8", "mxfp4": "fp4" if engine == "sglang" else "mxfp4"}[fmt]
    codes, scales, w = fn(*cpu.values(), engine_fmt)
    torch.cuda.synchronize()
    assert torch.equal(out[0].cpu(), codes)
    assert torch.equal(out[1].cpu().view(torch.int32), w.reshape(333, 64).view(torch.int32))
    assert scales is None or torch.equal(out[2].cpu(), scales)


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
def test_portable_conversions_give_the_native_bytes(fmt):
    if torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("the native E2M1 conversion needs SM100 or SM120 (sm90 runs the portable module only)")
    cpu, dev = make(200, 64, torch.bfloat16, seed=5)
    for conversions in ("native", "portable"):
        out = poisoned(200, 64, fmt, torch.float32)
        ap.index_q_rope_quant(
            **dev, q_out=out[0], weights_out=out[1], q_scales=out[2], fmt=fmt, conversions=conversions
        )
        check(cpu, out, fmt, None, torch.float32)


def test_vllm_function_and_graph_replay():
    cpu, dev = make(64, 64, torch.bfloat16, seed=7)
    args = tuple(
        dev[k] for k in ("positions", "q", "cos_sin_cache", "weights", "softmax_scale", "head_scale")
    )
    (packed, scale_words), w = vllm_indexer.fused_indexer_q_rope_quant(*args, use_fp4=True)
    want = index_q_reference(*cpu.values(), "mxfp4", "vllm")
    assert torch.equal(packed.cpu(), want[0]) and torch.equal(
        scale_words.cpu().view(torch.uint8).view(64, 64, 4), want[1]
    )
    # caller-owned outputs under a CUDA graph: the replay writes the new inputs' bytes
    out = poisoned(64, 64, "fp8_token", torch.float32)
    vllm_indexer.fused_indexer_q_rope_quant_out(*args, out[0], out[1])  # (warm: the kernel is loaded)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vllm_indexer.fused_indexer_q_rope_quant_out(*args, out[0], out[1])
    cpu2, dev2 = make(64, 64, torch.bfloat16, seed=8)
    for k in ("q", "weights", "positions"):
        dev[k].copy_(dev2[k])
    out[0].fill_(0x55)
    graph.replay()
    check(cpu2 | {"cos_sin_cache": cpu["cos_sin_cache"]}, out, "fp8_token", "vllm", torch.float32)


def test_torch_compile_runs_the_kernel():
    cpu, dev = make(50, 64, torch.bfloat16, seed=9)
    out = poisoned(50, 64, "mxfp4", torch.float32)
    fn = torch.compile(lambda c, w, s: ap.index_q_rope_quant(**dev, q_out=c, weights_out=w, q_scales=s, fmt="mxfp4"),
                       fullgraph=True)  # fmt: skip
    fn(*out)
    check(cpu, out, "mxfp4", None, torch.float32)


@pytest.mark.parametrize("fmt, numerics", [("fp8_token", None), ("mxfp4", "sglang")])
def test_bound_op_writes_the_reference_over_token_counts_and_in_a_graph(fmt, numerics):
    """bind_index_q: calls of varying T and both position widths, then one captured in a CUDA graph and
    replayed on new inputs, each against the reference on poisoned outputs."""
    h = 64
    op = ap.bind_index_q(num_heads=h, softmax_scale=0.0884, head_scale=0.125, fmt=fmt, numerics=numerics)
    for seed, (t, width) in enumerate([(300, torch.int64), (1, torch.int64), (77, torch.int32)]):
        cpu, dev = make(t, h, torch.bfloat16, seed=20 + seed, bad_token=3)
        dev["positions"] = dev["positions"].to(width)
        out = poisoned(t, h, fmt, torch.float32)
        op(*(dev[k] for k in ("q", "positions", "cos_sin_cache", "weights")), *out)
        check(cpu, out, fmt, numerics, torch.float32)
    cpu, dev = make(64, h, torch.bfloat16, seed=30)
    tensors = [dev[k] for k in ("q", "positions", "cos_sin_cache", "weights")]
    out = poisoned(64, h, fmt, torch.float32)
    op(*tensors, *out)  # (the geometry is checked eagerly once; the captured call is the fast path)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*tensors, *out)
    cpu2, dev2 = make(64, h, torch.bfloat16, seed=31)
    for k in ("q", "weights", "positions"):
        dev[k].copy_(dev2[k])
    for o in out:
        if o is not None:
            o.fill_(0x55) if o.dtype == torch.uint8 else o.fill_(7.0)
    graph.replay()
    check(cpu2 | {"cos_sin_cache": cpu["cos_sin_cache"]}, out, fmt, numerics, torch.float32)
