"""The indexer's Q prologue on the CPU: golden vectors of its reference (each expected byte derived in a
comment from vLLM 0.33.0's vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py, the CuTe-DSL
kernel, and common/ops/fused_indexer_q.py, the Triton one), the function and torch op (CPU: the reference),
torch.compile, vLLM's function signature, and typed refusals that write nothing."""

from __future__ import annotations

import math

import attn_prologue as ap
import pytest
import torch
from attn_prologue import numerics as nx
from attn_prologue.compat import vllm_indexer
from attn_prologue.dispatch import MAX_BUCKET_LOG2
from attn_prologue.errors import InputError, UnsupportedError
from attn_prologue.index_q import IndexQFlag, index_q_reference, numerics_bits, rotate
from attn_prologue.launcher import Launcher
from attn_prologue.parity import NumericsError
from attn_prologue.variants import parse_name

D, R = 128, 64


def identity_table(rows: int = 4) -> torch.Tensor:
    """cos = 1, sin = 0 at every position: the rotation leaves the values as they are."""
    return torch.cat((torch.ones(rows, R // 2), torch.zeros(rows, R // 2)), 1)


def one_row(values: dict[int, float], dtype=torch.bfloat16) -> torch.Tensor:
    q = torch.zeros(1, 1, D)
    for i, v in values.items():
        q[0, 0, i] = v
    return q.to(dtype)


def ref(
    q, fmt="fp8_token", numerics=None, w=1.0, softmax=0.5, head=0.25, table=None, pos=0, out=torch.float32
):
    weights = torch.full(q.shape[:2], w, dtype=q.dtype)
    positions = torch.full((q.shape[0],), pos, dtype=torch.int64)
    return index_q_reference(q, positions, identity_table() if table is None else table, weights, softmax, head,
                             fmt, numerics, out)  # fmt: skip


def test_fp8_scale_is_the_next_power_of_two_of_amax_over_448():
    # amax 1.0: fl(1.0 * fl(1/448)) = 0.00223..., between 2^-9 and 2^-8 -> p = 2^-8; the value 1.0 * 2^8 = 256
    # is e4m3 exponent 8 + 7 = 15, mantissa 0: byte 0x78; weights_out = (1 * fl(0.5 * 0.25)) * 2^-8 = 2^-11
    codes, scales, w, bad = ref(one_row({0: 1.0}))
    assert scales is None and bad == 0
    assert codes[0, 0, 0] == 0x78 and int(codes[0, 0, 1:].count_nonzero()) == 0
    assert w.item() == 2.0**-11


def test_fp8_amax_on_a_power_of_two_boundary_keeps_its_exponent():
    # amax 56 = 448 * 2^-3: 56 * fl(1/448) rounds to exactly 2^-3 (7 * fl(1/7) = 1 + 4.3e-8 rounds to 1), so
    # p = 2^-3 and 56 * 8 = 448 is the largest e4m3: 0x7E; -28 -> -224: exponent 7 + 7, mantissa 0b110: 0xF6
    codes, _, w, _ = ref(one_row({0: 56.0, 1: -28.0}))
    assert codes[0, 0, 0] == 0x7E and codes[0, 0, 1] == 0xF6
    assert w.item() == 0.125 * 2.0**-3


def test_fp8_amax_below_the_floor_uses_the_floor():
    # amax bf16(1e-5) = 1.00135803e-05 < 1e-4: fl(fl(1e-4) * fl(1/448)) = 2.23e-7 -> p = 2^-22; the value
    # 1.00135803e-05 * 2^22 = 41.9997, between e4m3 40 (0x62: exponent 5 + 7, mantissa 0b010) and 44: 40
    codes, _, w, _ = ref(one_row({5: 1e-5}))
    assert codes[0, 0, 5] == 0x62
    assert w.item() == 0.125 * 2.0**-22


def test_an_inf_row_wraps_in_the_cute_kernel_and_saturates_in_the_triton_one():
    row = one_row({0: 1.0, 1: -2.0, 2: float("inf"), 3: float("nan")})
    # CuTe-DSL: (0x7F800000 + 0x7FFFFF) >> 23 = 255: p = Inf, and the codes' multiplier (254 - 255) << 23 in
    # 32 bits = 0xFF800000 = -Inf: 1 -> -Inf -> -448 (0xFE), -2 -> 0x7E, Inf -> 0xFE, NaN -> 0x7F, and a zero
    # gives 0 * -Inf = NaN: 0x7F; weights_out = (1 * S) * Inf = Inf
    codes, _, w, _ = ref(row, numerics="vllm")
    assert codes[0, 0, :5].tolist() == [0xFE, 0x7E, 0xFE, 0x7F, 0x7F]
    assert w.item() == math.inf
    # Triton: p = exp2(ceil(log2(Inf))) = Inf and x / Inf: 1 -> +0, -2 -> -0 (0x80), Inf / Inf = NaN;
    # weights_out = ((1 * Inf) * 0.5) * 0.25 = Inf
    codes, _, w, _ = ref(row, numerics="vllm-triton")
    assert codes[0, 0, :5].tolist() == [0x00, 0x80, 0x7F, 0x7F, 0x00]
    assert w.item() == math.inf


def test_mxfp4_ties_round_to_even_with_a_unit_scale():
    # block amax 6: fl(6 * fl(1/6)) = 1 (6 * fl(1/6) = 1 + 3e-8), e = 127, codes of the values themselves;
    # ties to even: 0.25 -> 0, 0.75 -> 1.0 (2), 1.25 -> 1.0 (2), 1.75 -> 2.0 (4), 2.5 -> 2 (4), 3.5 -> 4 (6),
    # 5 -> 4 (6), 6 -> 6 (7); element 2j in the low nibble of byte j
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    codes, scales, w, _ = ref(one_row(dict(enumerate(ties))), fmt="mxfp4")
    assert codes[0, 0, :4].tolist() == [0 | 2 << 4, 2 | 4 << 4, 4 | 6 << 4, 6 | 7 << 4]
    # the other three blocks are zeros: amax floored at 6 * 2^-126, e = ceil(log2(2^-126)) + 127 = 1
    assert scales[0, 0].tolist() == [127, 1, 1, 1]
    assert w.item() == 0.125  # mxfp4 folds no row scale: w * fl(0.5 * 0.25)


def test_an_inf_block_in_mxfp4():
    row = one_row({0: 1.0, 1: float("inf"), 2: -3.0})
    # CuTe-DSL: e = 255 (the byte written), the multiplier -Inf (254 - 255 wrapped): 1 -> -6 (0xF), Inf -> 0xF,
    # -3 -> +6 (0x7), a zero -> NaN -> 0x7 (e2m1 has no NaN)
    codes, scales, _, _ = ref(row, fmt="mxfp4", numerics="vllm")
    assert scales[0, 0, 0] == 255 and codes[0, 0, :2].tolist() == [0xF | 0xF << 4, 0x7 | 0x7 << 4]
    # Triton: ceil(log2(Inf)) clamped to 127: byte 254, codes x * 2^-127: 1 -> 0, Inf -> 7, -3 -> -0 (0x8), 0 -> 0
    codes, scales, _, _ = ref(row, fmt="mxfp4", numerics="vllm-triton")
    assert scales[0, 0, 0] == 254 and codes[0, 0, :2].tolist() == [0 | 7 << 4, 0x8]


def test_rotation_is_fma_e_c_minus_o_s_and_fma_o_c_plus_e_s():
    # e = 1, o = 2 at dims 64, 65; c = fl(0.6), s = fl(0.8): fma(1, c, -(2s)) = 0.60000002384 - 1.60000002384
    # = -1 exactly; fma(2, c, 1 * s) = 2.0000000596, which rounds to 2 in float32 and bf16
    table = torch.tensor([[0.6] * (R // 2) + [0.8] * (R // 2)])
    x = rotate(one_row({64: 1.0, 65: 2.0}), torch.tensor([0]), table, 0)
    assert x[0, 0, 64].item() == -1.0 and x[0, 0, 65].item() == 2.0


def test_fp16_rows_round_the_rotated_values_through_bf16_under_the_triton_preset():
    # 1 + 2^-10 is an fp16 value but not a bf16 one: under ROTATED_BF16 it rounds to 1 (ties to even)
    q = one_row({64: 1.0 + 2.0**-10}, torch.float16)
    assert rotate(q, torch.tensor([0]), identity_table(), 0)[0, 0, 64].item() == 1.0 + 2.0**-10
    assert (
        rotate(q, torch.tensor([0]), identity_table(), int(IndexQFlag.ROTATED_BF16))[0, 0, 64].item() == 1.0
    )


def test_separate_scales_round_each_product():
    # w = 3 (bf16), softmax 0.1, head 0.3, amax -> p = 2^-8 as in the first test:
    # CuTe: fl32(3 * fl32(0.1 * 0.3 in double)) * 2^-8; Triton: ((3 * 2^-8) * fl32(0.1)) * fl32(0.3), each rounded
    q = one_row({0: 1.0})
    _, _, w_cute, _ = ref(q, w=3.0, softmax=0.1, head=0.3, numerics="vllm")
    _, _, w_triton, _ = ref(q, w=3.0, softmax=0.1, head=0.3, numerics="vllm-triton")
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    assert w_cute.item() == (f32(3.0) * f32(0.1 * 0.3)).item() * 2.0**-8
    assert w_triton.item() == ((f32(3.0 * 2.0**-8) * f32(0.1)) * f32(0.3)).item()
    assert w_cute.item() != w_triton.item()  # these operands are one where the orders differ


def test_a_position_outside_the_table_zeroes_the_token_and_counts_it():
    q = torch.randn(3, 2, D).bfloat16()
    codes, scales, w, bad = index_q_reference(q, torch.tensor([0, 9, -1]), identity_table(), torch.ones(3, 2).bfloat16(),
                                              1.0, 1.0, "mxfp4")  # fmt: skip
    assert bad == 2
    assert codes[1:].count_nonzero() == 0 and scales[1:].count_nonzero() == 0 and w[1:].count_nonzero() == 0
    assert codes[0].count_nonzero() > 0


def test_numerics_names():
    assert numerics_bits(None) == 0 and numerics_bits("preset=VLLM") == 0
    assert numerics_bits("vllm-triton", "fp16") == 7
    with pytest.raises(NumericsError, match="bf16 rows"):
        numerics_bits("vllm", "fp16")  # vLLM's CuTe-DSL kernel takes bf16 only
    with pytest.raises(NumericsError, match="did you mean vllm-triton"):
        numerics_bits("vllm-trition")


# ---- the function and the torch op -------------------------------------------------------------------
def inputs(t=6, h=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(32, R // 2, generator=g) * 6.28
    q = (torch.randn(t, h, D, generator=g) * 3).to(dtype)
    q[0, 0, 3] = float("nan")
    q[1, 1, 70] = float("-inf")
    return dict(q=q, positions=torch.randint(0, 32, (t,), generator=g), cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1),
                weights=torch.randn(t, h, generator=g).to(dtype), softmax_scale=0.088, head_scale=0.125)  # fmt: skip


def outputs(t, h, fmt, w_dtype=torch.float32):
    codes = torch.full((t, h, D // 2 if fmt == "mxfp4" else D), 0x55, dtype=torch.uint8)
    scales = torch.full((t, h, D // 32), 0x55, dtype=torch.uint8) if fmt == "mxfp4" else None
    return codes, torch.full((t, h), 7.0, dtype=w_dtype), scales


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
@pytest.mark.parametrize(
    "dtype, numerics",
    [(torch.bfloat16, None), (torch.bfloat16, "vllm-triton"), (torch.float16, "vllm-triton")],
)
def test_function_writes_the_reference(fmt, dtype, numerics):
    a = inputs(dtype=dtype)
    w_dtype = torch.bfloat16 if fmt == "mxfp4" else torch.float32
    codes, w, scales = outputs(6, 8, fmt, w_dtype)
    ap.index_q_rope_quant(**a, q_out=codes, weights_out=w, q_scales=scales, fmt=fmt, numerics=numerics)
    want = index_q_reference(*a.values(), fmt, numerics, w_dtype)
    assert torch.equal(codes, want[0]) and torch.equal(w.view(torch.int16), want[2].view(torch.int16))
    if scales is not None:
        assert torch.equal(scales, want[1])


@pytest.mark.parametrize("numerics", [None, "sglang"])
def test_int32_positions_give_the_int64_bytes(numerics):
    """SGLang's indexer passes int32 or int64 positions: the same outputs either way (the kernel takes
    them through a module compiled for int32, LaunchConfig.positions32; tests/gpu runs it)."""
    a = inputs()
    a["positions"][2] = 40  # outside the table: zeros, counted
    got = {}
    for dtype in (torch.int64, torch.int32):
        codes, w, scales = outputs(6, 8, "mxfp4")
        ap.index_q_rope_quant(**{**a, "positions": a["positions"].to(dtype)}, q_out=codes, weights_out=w,
                              q_scales=scales, fmt="mxfp4", numerics=numerics)  # fmt: skip
        got[dtype] = (codes, w, scales)
    assert all(torch.equal(x, y) for x, y in zip(got[torch.int64], got[torch.int32]))
    assert not got[torch.int32][0][2].any()


def test_torch_compile_matches_eager():
    a = inputs()
    eager, compiled = outputs(6, 8, "fp8_token"), outputs(6, 8, "fp8_token")
    ap.index_q_rope_quant(**a, q_out=eager[0], weights_out=eager[1])
    fn = torch.compile(lambda c, w: ap.index_q_rope_quant(**a, q_out=c, weights_out=w), fullgraph=True)
    fn(compiled[0], compiled[1])
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_vllm_signature_returns_vllms_types():
    a = inputs(h=64)
    args = (a["positions"], a["q"], a["cos_sin_cache"], a["weights"], a["softmax_scale"], a["head_scale"])
    q8, w = vllm_indexer.fused_indexer_q_rope_quant(*args)
    assert q8.dtype == torch.float8_e4m3fn and w.dtype == torch.float32
    assert torch.equal(q8.view(torch.uint8), index_q_reference(*a.values(), "fp8_token", "vllm")[0])
    (packed, scale_words), w = vllm_indexer.fused_indexer_q_rope_quant(
        *args, use_fp4=True, weights_out_dtype=torch.bfloat16
    )
    want = index_q_reference(*a.values(), "mxfp4", "vllm", torch.bfloat16)
    assert scale_words.shape == (6, 64) and scale_words.dtype == torch.int32  # DeepGEMM's q_sf
    assert torch.equal(scale_words.view(torch.uint8).view(6, 64, 4), want[1]) and torch.equal(packed, want[0])
    with pytest.raises(InputError, match="float32 weights"):
        vllm_indexer.fused_indexer_q_rope_quant(*args, weights_out_dtype=torch.bfloat16)


def bad_calls():
    """(what is wrong, the keyword changes that make it so, the error type, words of its message)."""
    t, h = 6, 8
    return [
        ("q dtype", dict(q=torch.zeros(t, h, D)), InputError, "bfloat16 or float16"),
        ("head dim", dict(q=torch.zeros(t, h, 64, dtype=torch.bfloat16)), UnsupportedError, "q has D=64"),
        (
            "positions dtype",
            dict(positions=torch.zeros(t, dtype=torch.int16)),
            InputError,
            "positions must be torch.int64 or torch.int32",
        ),
        (
            "weights rows",
            dict(weights=torch.zeros(t + 1, h, dtype=torch.bfloat16)),
            InputError,
            "weights must have shape",
        ),
        ("table width", dict(cos_sin_cache=torch.zeros(8, 32)), InputError, "cos_sin_cache must have shape"),
        (
            "table dtype",
            dict(cos_sin_cache=torch.zeros(8, R, dtype=torch.bfloat16)),
            InputError,
            "torch.float32",
        ),
        ("scale type", dict(softmax_scale=True), InputError, "softmax_scale must be a finite float"),
        ("scale value", dict(head_scale=float("nan")), InputError, "head_scale must be a finite float"),
        ("format", dict(fmt="nvfp4"), UnsupportedError, "fp8_token or mxfp4"),
        (
            "scales for fp8",
            dict(q_scales=torch.zeros(t, h, 4, dtype=torch.uint8)),
            InputError,
            "q_scales is for",
        ),
        (
            "preset",
            dict(numerics="sglnag"),
            NumericsError,
            "did you mean sglang.*presets: vllm, vllm-triton, sglang, tokenspeed",
        ),
        (
            "negated view",
            dict(weights=torch.zeros(t, h, dtype=torch.bfloat16)._neg_view()),
            InputError,
            "negated",
        ),
        (
            "q_out stride",
            dict(q_out=torch.zeros(t, h, 2 * D, dtype=torch.uint8)[..., :D]),
            InputError,
            "contiguous within a token",
        ),
    ]


@pytest.mark.parametrize("what, change, error, words", bad_calls(), ids=[c[0] for c in bad_calls()])
def test_a_bad_call_is_refused_before_anything_is_written(what, change, error, words):
    a = inputs()
    codes, w, _ = outputs(6, 8, "fp8_token")
    call = {**a, "q_out": codes, "weights_out": w, "q_scales": None, "fmt": "fp8_token", **change}
    before = (call["q_out"].clone(), w.clone())
    with pytest.raises(error, match=words):
        ap.index_q_rope_quant(**call)
    assert torch.equal(call["q_out"], before[0]) and torch.equal(w, before[1])


def test_outputs_overlapping_an_input_or_each_other_are_refused():
    a = inputs()
    codes, w, scales = outputs(6, 8, "mxfp4")
    with pytest.raises(InputError, match="overlaps"):
        ap.index_q_rope_quant(
            **a, q_out=codes, weights_out=w, q_scales=codes.view(-1)[: 6 * 8 * 4].view(6, 8, 4), fmt="mxfp4"
        )
    with pytest.raises(InputError, match="overlaps"):
        ap.index_q_rope_quant(
            **a, q_out=a["q"].view(torch.uint8).view(-1)[: 6 * 8 * D].view(6, 8, D), weights_out=w
        )
    assert (codes == 0x55).all() and (w == 7.0).all()


def test_mxfp4_needs_its_scales():
    a = inputs()
    codes, w, _ = outputs(6, 8, "mxfp4")
    with pytest.raises(InputError, match="q_scales must be a tensor"):
        ap.index_q_rope_quant(**a, q_out=codes, weights_out=w, fmt="mxfp4")


class StandInRuntime:
    """A runtime whose launchers run the reference in the compiled argument order (the kernel path's
    plumbing on the CPU: argument order, per-call scales, the shape's cached calls)."""

    def __init__(self):
        self.calls, self.seen, self.asked = {}, [], []

    def errors_buffer(self, device):
        return torch.zeros(2, dtype=torch.int32)

    def launchers(self, request, device, **kw):
        self.asked.append(kw)
        v = parse_name(f"index_q_d128r64_{request.cache_format}_{request.io_dtype.value}_sm90")

        def fn(*args):
            a = dict(zip(v.arguments, args, strict=True))
            self.seen.append(a)
            codes, scales, w, _ = index_q_reference(
                a["q_in"], a["positions"], a["cos_sin_cache"], a["weights"], a["weights_scale"], a["head_scale"],
                v.cache_format, a["numerics"], torch.float32,
            )  # fmt: skip
            a["q_out"].copy_(codes)
            a["weights_out"].view(torch.float32).copy_(w)
            if scales is not None:
                a["q_scales"].copy_(scales)

        return tuple(
            Launcher(v, v.arch.default_config, "sm_90a", 0, fn, 1) for _ in range(MAX_BUCKET_LOG2 + 1)
        )


@pytest.mark.parametrize("fmt, numerics", [("fp8_token", None), ("mxfp4", "vllm-triton")])
def test_the_kernel_path_passes_each_call_its_scales(fmt, numerics):
    a = inputs()
    rt = StandInRuntime()
    for softmax in (0.088, 0.5):  # the second call reuses the shape's calls with other scales
        codes, w, scales = outputs(6, 8, fmt)
        call = {**a, "softmax_scale": softmax}
        ap.index_q_rope_quant(
            **call, q_out=codes, weights_out=w, q_scales=scales, fmt=fmt, numerics=numerics, runtime=rt
        )
        want = index_q_reference(*call.values(), fmt, numerics)
        assert torch.equal(codes, want[0]) and torch.equal(w, want[2])
        assert scales is None or torch.equal(scales, want[1])
    assert len(rt.calls) == 1 and len(rt.seen) == 2


def test_the_kernel_path_asks_for_a_module_of_its_bits_and_positions_width():
    """Each shape's launchers are asked folded to the call's bits and for int32 positions where given
    (the GPU test that caught a call path which did not ask: test_int32_positions_run_their_own_module_...)."""
    rt = StandInRuntime()
    a = inputs()
    for dtype in (torch.int64, torch.int32):
        codes, w, _ = outputs(6, 8, "fp8_token")
        ap.index_q_rope_quant(**{**a, "positions": a["positions"].to(dtype)}, q_out=codes, weights_out=w,
                              numerics="sglang", runtime=rt)  # fmt: skip
    assert [(k["positions32"], k["fold_numerics"], k["numerics"]) for k in rt.asked] == [
        (False, True, numerics_bits("sglang")),
        (True, True, numerics_bits("sglang")),
    ]


def test_the_float16_codes_keep_every_code_the_index_q_kernel_asks_of_them():
    """index_q's MXFP4 codes (not HADAMARD) go through e2m1_pack8_io: float16 pairs of y = x * m with x an
    I/O-dtype value (bf16 or fp16, every bit pattern) and m each multiplier the kernel uses: 2^(127 - e) for
    every byte e a finite block can get, -Inf (an Inf block's wrapped inverse) and 2^-127 (INF_SATURATES).
    Twin of the kernel's arithmetic: numerics.e2m1_pack_codes_in_f16; rule: numerics.e2m1_codes."""
    every = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    for x in (every.view(torch.bfloat16).float(), every.view(torch.float16).float()):
        for m in [2.0 ** (127 - e) for e in range(1, 254)] + [-math.inf, 2.0**-127]:
            y = x * torch.tensor(m, dtype=torch.float32)
            assert torch.equal(nx.e2m1_pack_codes_in_f16(y), nx.e2m1_codes(y)), m
