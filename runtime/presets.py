"""Engine presets: the parity choices that make each engine's cache writer, by one name.

`numerics="preset=vllm-triton"` (or `Numerics(preset="vllm-triton")`) resolves per cache format to the
fields below; fields given next to it override them (`"preset=vllm-triton, fp4_zero=positive"`), and
every field a preset leaves out keeps the format's default. A preset has an entry only for the
formats its engine writes and whose writer source was read; any other format is a NumericsError
naming the formats it has. Each entry cites the writer (repository, file, commit) and says which
row classes it still cannot match, and why (docs/formats.md, "Matching an engine byte for byte").
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import did_you_mean
from .parity import (
    AmaxFloor,
    E4m3Nan,
    Fp4Zero,
    InfScale,
    NopeRotation,
    Numerics,
    NumericsError,
    RopeOrder,
    RotatedRow,
    ScaleFloor,
    ScalePad,
)

# the row classes every golden-vector set covers, and the presets' notes name
ROW_CLASSES = ("finite", "signed zeros", "NaN", "Inf", "below the amax floor", "overflow")


@dataclass(frozen=True)
class PresetEntry:
    """One engine's writer of one format: the fields that reproduce it, where it was read, and the
    row classes (ROW_CLASSES) it cannot match with why; an empty `unmatched` matches them all."""

    numerics: Numerics
    source: str
    unmatched: dict[str, str]


@dataclass(frozen=True)
class Preset:
    name: str
    engine: str
    formats: dict[str, PresetEntry]


VLLM_CUDA = "vllm-project/vllm csrc/libtorch_stable/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu"
VLLM_V41 = "vllm-project/vllm vllm/models/deepseek_v41/common/ops/"
SGLANG_JIT = "sgl-project/sglang python/sglang/kernels/jit/"
# Triton's tl.clamp(x, -c, c) with constant c is min.xorsign.abs.f32 on sm_90+ (triton-lang/triton
# third_party/nvidia/lib/TritonNVIDIAGPUToLLVM/ElementwiseOpToLLVM.cpp @0043a8d8, isClipPattern):
# a NaN becomes +c with the NaN's sign, and the multiply before it leaves the canonical +NaN.
TRITON_CLAMP = "NaN -> 0x7E: Triton's symmetric clamp is min.xorsign.abs (triton @0043a8d8)"
APPROX_LOG2 = (
    "a float32 row whose block amax lies within ~2^-22 above 448 * 2^k: Triton's lg2.approx can give "
    "the lower exponent (its largest element then clamps to 448); bf16-rounded rows never do"
)
KV_NORM_NOTE = (
    "kv_norm op only: the writer's weighted RMSNorm uses tl.rsqrt (approximate) and a tree sum, so a "
    "normed value can round to the neighbouring bf16 (rarely visible after quantization)"
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "vllm",
            "vLLM's CUDA fused op fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert",
            {
                "fp8_ds_mla": PresetEntry(
                    Numerics(e4m3_nan=E4m3Nan.NEG_MAX, inf_scale=InfScale.OVERFLOW),
                    f"{VLLM_CUDA} @bb0ebe87 (processDeepseekV4Slot): fmaxf(amax, 1e-4), ceilf(log2f(amax / 448)), "
                    "fminf(fmaxf(x * 2^-e, -448), 448), byte fminf(e + 127, 255)",
                    {},
                ),
                "mxfp8": PresetEntry(
                    Numerics(e4m3_nan=E4m3Nan.NEG_MAX, inf_scale=InfScale.OVERFLOW),
                    "bytedance-iaas/vllm csrc/libtorch_stable/fused_deepseek_v4_qnorm_rope_kv_insert_kernel.cu "
                    "@36ecb251 (the kv_mxfp8 branch of the same kernel: the 584 B rules on 32-wide blocks)",
                    {},
                ),
            },
        ),
        Preset(
            "vllm-triton",
            "vLLM's V4.1 Triton writers (compressed cache rope_quant_insert, indexer keys, plain rows)",
            {
                "fp8_ds_mla": PresetEntry(
                    Numerics(
                        rope_order=RopeOrder.ODD_COS, e4m3_nan=E4m3Nan.POS_MAX, inf_scale=InfScale.OVERFLOW
                    ),
                    f"{VLLM_V41}fused_compress_quant_cache.py @1bd28daa (_rope_quant_insert_kernel: the NoPE "
                    f"quantized unrotated, the rope tail from the rotation); {TRITON_CLAMP}",
                    {},
                ),
                "mxfp8": PresetEntry(
                    Numerics(
                        rotated_row=RotatedRow.FP32,
                        nope_rotation=NopeRotation.IDENTITY,
                        rope_order=RopeOrder.ODD_COS,
                        e4m3_nan=E4m3Nan.POS_MAX,
                        inf_scale=InfScale.OVERFLOW,
                    ),
                    f"{VLLM_V41}fused_compress_quant_cache.py @1bd28daa (_rope_quant_insert_mxfp8_kernel); "
                    f"{TRITON_CLAMP}",
                    {"finite": APPROX_LOG2},
                ),
                "nvfp4_v41": PresetEntry(
                    Numerics(
                        fp4_zero=Fp4Zero.SIGNED,
                        rotated_row=RotatedRow.FP32,
                        nope_rotation=NopeRotation.IDENTITY,
                        rope_order=RopeOrder.ODD_COS,
                    ),
                    f"{VLLM_V41}fused_compress_quant_cache.py @1bd28daa (_rope_quant_insert_nvfp4_kernel: "
                    "clamp(amax * (1/6), 2^-9, 448), div_rn, cvt.rn.satfinite.e2m1x2)",
                    {},
                ),
                "fp8_token": PresetEntry(
                    Numerics(
                        nope_rotation=NopeRotation.IDENTITY,
                        rope_order=RopeOrder.ODD_COS,
                        e4m3_nan=E4m3Nan.POS_MAX,
                        inf_scale=InfScale.OVERFLOW,
                    ),
                    f"{VLLM_V41}indexer_k_store.py @2e31c954 (_indexer_k_norm_rope_quant_store_kernel, FP8); "
                    f"{TRITON_CLAMP}",
                    {"finite": KV_NORM_NOTE},
                ),
                "mxfp4": PresetEntry(
                    Numerics(nope_rotation=NopeRotation.IDENTITY, rope_order=RopeOrder.ODD_COS),
                    f"{VLLM_V41}indexer_k_store.py @2e31c954 (_indexer_k_norm_rope_quant_store_kernel, MXFP4)",
                    {
                        "finite": KV_NORM_NOTE,
                        "Inf": "a block holding Inf: byte 254 as here, but its elements are scaled by 2^-127 "
                        "(here 2^-126), which differs for finite values >= 2^124 in that block",
                    },
                ),
                "bf16": PresetEntry(
                    Numerics(nope_rotation=NopeRotation.IDENTITY, rope_order=RopeOrder.ODD_COS),
                    f"{VLLM_V41}fused_compress_quant_cache.py @1bd28daa (_rope_plain_insert_kernel, bf16)",
                    {},
                ),
            },
        ),
        Preset(
            "flashmla",
            "FlashMLA's reference quantizer tests/quant.py (a test reference, run on the GPU)",
            {
                "fp8_ds_mla": PresetEntry(
                    Numerics(scale_floor=ScaleFloor.SCALE, inf_scale=InfScale.OVERFLOW),
                    "deepseek-ai/FlashMLA tests/quant.py @520fec6a (quantize_k_cache, MODEL1_FP8Sparse: "
                    "2^ceil(log2(clamp_min(amax / 448, 1e-4))), x / scale to float8_e4m3fn, e8m0 of Inf 0xFF)",
                    {
                        "NaN": "torch's amax propagates NaN: a block holding one gets scale byte 0xFF and "
                        "every element NaN (here amax ignores NaN)",
                    },
                ),
            },
        ),
        Preset(
            "sglang",
            "SGLang's V4 writers (store.cuh, main_norm_rope.cuh) and V4.1 row writers (kv_layout.cuh)",
            {
                "fp8_ds_mla": PresetEntry(
                    Numerics(e4m3_nan=E4m3Nan.POS_MAX, inf_scale=InfScale.OVERFLOW, scale_pad=ScalePad.SKIP),
                    f"{SGLANG_JIT}csrc/deepseek_v4/store.cuh @v0.5.23 (read from the sglang-0.5.23 wheel; the V4 "
                    "branch of fused_store_cache, the same rule as main_norm_rope.cuh's V4 branch): "
                    "fmaxf(1e-4, amax) / 448, the UE8M0 byte from its bits rounded up (fp8_utils.cuh "
                    "cast_to_ue8m0), pack_fp8's fmaxf(fminf(x * 2^-e, 448), -448), scale bytes 0..6 written "
                    "and the pad byte not",
                    {
                        "Inf": "a block holding Inf gets byte 255 as here, but its reciprocal scale, built from "
                        "bits as 2^(127 - 255), is -Inf: finite values become -+448 (the sign flipped), zeros "
                        "and NaN +448 (here x * 0: +-0, and Inf -> NaN -> 0x7E)",
                        "finite": "kv_norm op only: SGLang's fused V4 writer (main_norm_rope.cuh "
                        "fused_k_norm_rope_flashmla) rotates and quantizes the float32 normed row, not the bf16 "
                        "one, so about 3% of the NoPE bytes and a third of the rope values differ; its "
                        "bf16-sourced path (SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE=1: fused_norm_rope.cuh, then "
                        "store.cuh) rounds as here, but for the norm's rsqrtf (approximate): a normed value "
                        "can round to the neighbouring bf16",
                    },
                ),
                "mxfp8": PresetEntry(
                    Numerics(scale_floor=ScaleFloor.SCALE),
                    "sgl-project/sglang python/sglang/kernels/jit/include/sgl_kernel/deepseek_v4/kv_layout.cuh "
                    "@2005a302 (store_row_fp8: the exponent from amax's bits, floored at byte 114)",
                    {
                        "Inf": "the exponent is taken from +Inf's bits: byte 247 (SGLang documents NaN / Inf "
                        "inputs as not handled)",
                        "NaN": "a block whose values are all NaN (every block of a row the kv_norm op normalizes "
                        "with a NaN in it) takes its exponent from NaN's bits, byte 247 or 248 by the NaN's "
                        "payload (here 114)",
                    },
                ),
                "nvfp4_v41": PresetEntry(
                    Numerics(fp4_zero=Fp4Zero.SIGNED),
                    "sgl-project/sglang python/sglang/kernels/jit/include/sgl_kernel/deepseek_v4/kv_layout.cuh "
                    "@2005a302 (store_row_fp4: e4m3(clamp(amax / 6, 2^-9, 448)), __fdiv_rn, the sign kept; "
                    "its amax / 6 equals amax * fl(1/6) here for every bf16 or fp16 amax)",
                    {},
                ),
            },
        ),
        Preset(
            "flashinfer",
            "FlashInfer's SM120 NVFP4 writer (quantize_fp32_group16_to_nvfp4_regs)",
            {
                "nvfp4_dsv4": PresetEntry(
                    Numerics(fp4_zero=Fp4Zero.SIGNED),
                    "flashinfer-ai/flashinfer include/flashinfer/attention/sparse_mla_sm120/common/"
                    "nvfp4_quantization.cuh @3fe65b06 (e4m3(amax / 6), x * (1 / s), 0 when s is 0)",
                    {},
                ),
            },
        ),
        Preset(
            "trtllm",
            "TensorRT-LLM's 584 B footer-scale writer (footer_scale_kv._quant_scatter_kernel)",
            {
                "fp8_ds_mla": PresetEntry(
                    Numerics(
                        amax_floor=AmaxFloor.E8,
                        rope_order=RopeOrder.ODD_COS,
                        e4m3_nan=E4m3Nan.POS_MAX,
                        inf_scale=InfScale.WRAPPED,
                        scale_pad=ScalePad.SKIP,
                    ),
                    "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/"
                    "footer_scale_kv.py @d77955c5 (EPS 1e-8, (int32(e) + 127) to uint8, no pad store); "
                    f"{TRITON_CLAMP}; the rope tail from mla_rope_inplace, whose odd term is "
                    "coef.x * v.y + coef.y * v.x (rotary_embedding_transform)",
                    {},
                ),
            },
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset of that name, or a NumericsError naming the closest and listing them all."""
    preset = PRESETS.get(name)
    if preset is None:
        hint = did_you_mean(str(name), PRESETS)
        raise NumericsError(f"unknown numerics preset {name!r}{hint}; presets: {', '.join(PRESETS)}")
    return preset


def preset_entry(name: str, fmt_name: str) -> PresetEntry:
    """The preset's entry for a format, or a NumericsError naming what exists."""
    preset = get_preset(name)
    entry = preset.formats.get(fmt_name)
    if entry is None:
        others = [n for n, p in PRESETS.items() if fmt_name in p.formats]
        raise NumericsError(
            f"preset {name} has no cache format {fmt_name}: it covers {', '.join(preset.formats)}; "
            f"presets for {fmt_name}: {', '.join(others) or 'none'}"
        )
    return entry
