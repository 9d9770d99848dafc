"""What the compiler emits for every launch knob and target beyond the build's: every knob compiles on
every arch (with its config in the PTX), the targets built only on request emit what the others do, and
int32 slot ids compile to a 32-bit slot load."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from attn_prologue.formats import ElementCode, ScaleCode
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import DEFAULT_BUILD_TARGETS, TARGETS, Conversions, parse_name

from .support.build import REPO, kernels_only_env
from .test_emitted_code import assert_config_in_ptx

# ---- every launch knob compiles on every arch ------------------------------------------------------
KNOB_VARIANTS = [
    "qkv_d512r64_fp8_ds_mla_bf16_sm90",
    "qkv_d512r64_fp8_ds_mla_bf16_sm100",
    "qkv_d512r64_fp8_ds_mla_bf16_sm120",
]


@pytest.mark.slow
def test_every_launch_knob_compiles_on_every_arch(tmp_path):
    """The GPU suite's knob configs (run there against the reference on sm_90a) compile for SM100 and
    SM120 too, with the knobs visible in the PTX and no local memory."""
    from tests.gpu.cases import CONFIG_KEYS

    cmd = [
        sys.executable,
        "-m",
        "attn_prologue",
        "build",
        "--cache-dir",
        str(tmp_path),
        "--targets",
        "sm_90a,sm_100a,sm_120f",
        "--config",
        ",".join(CONFIG_KEYS),
        "--variants",
        *KNOB_VARIANTS,
    ]
    env = kernels_only_env()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    cache = KernelCache(tmp_path)
    for variant in KNOB_VARIANTS:
        target = parse_name(variant).arch.targets[0]
        ptxs = {}
        keys = [k for k in CONFIG_KEYS if not parse_name(variant).refusal(LaunchConfig.from_key(k))]
        for key in keys:
            cfg = LaunchConfig.from_key(key)
            k = KernelKey(variant, cfg, target)
            meta = cache.read_meta(k)
            assert meta is not None and meta["config"] == key, (variant, key)
            ptx = (cache.entry_dir(k) / "kernel.ptx").read_text()
            assert_config_in_ptx(ptx, cfg)
            assert ("ld.global.nc" in ptx) == (
                cfg.non_coherent and not cfg.streaming and not cfg.pdl
            )  # (rows only; KernelBase.rows_non_coherent)
            assert meta["ptx"]["local_memory"] is False and meta["resources"]["frame_bytes"] == 0, (
                variant,
                key,
            )
            ptxs[key] = ptx
        assert len(set(ptxs.values())) == len(
            keys
        )  # every knob changes the code (row_split: tests/test_row_split.py)
        # lean_quant: the scale quotient amax / 448 by a reciprocal and a correction, not div.rn.f32
        divisions = {key: ptx.count("div.rn.f32") for key, ptx in ptxs.items()}
        lean = [key for key in keys if LaunchConfig.from_key(key).lean_quant]
        assert lean and all(divisions[k] < divisions[keys[0]] for k in lean), divisions


@pytest.mark.parametrize("target", [t for t in TARGETS if t not in DEFAULT_BUILD_TARGETS])
@pytest.mark.parametrize(
    "variant",
    [
        "qkv_d512r64_fp8_ds_mla_bf16_sm100",
        "kv_d128r64_mxfp4_fp16_sm100",
        "qkv_q8_d512r64_mxfp8_bf16_sm100_portable",
    ],
)
def test_targets_built_on_request_emit_what_the_others_do(tmp_path, variant, target):
    """sm_103a (B300) and sm_110a (Thor) are built only on request: the SM100 modules compile for them
    to the same global accesses and conversions as for sm_100a, with no local memory."""
    v = parse_name(variant)
    cache = KernelCache(tmp_path)
    extra = cache.ensure_built(KernelKey(variant, v.arch.default_config, target))
    base = cache.ensure_built(KernelKey(variant, v.arch.default_config, "sm_100a"))
    ptx = (cache.entry_dir(KernelKey(variant, v.arch.default_config, target)) / "kernel.ptx").read_text()
    assert re.search(rf"^\.target {target}$", ptx, re.M)
    facts, res = extra["ptx"], extra["resources"]
    for fact in ("global_access_bits", "cvt_ue8m0x2", "cvt_e2m1x2", "cvt_e4m3x2", "griddepcontrol"):
        assert facts[fact] == base["ptx"][fact], fact
    assert facts["max_load_bits"] == 128
    assert not facts["local_memory"] and not res["local_sections"] and res["frame_bytes"] == 0
    native = v.conversions is Conversions.NATIVE
    assert (facts["cvt_ue8m0x2"] > 0) == (native and v.format.scale is ScaleCode.UE8M0)
    assert (facts["cvt_e2m1x2"] > 0) == (native and v.format.element is ElementCode.E2M1)


@pytest.mark.parametrize(
    "variant",
    ["kv_d512r64_nvfp4_v41_bf16_sm120", "qkv_qi_d512r64_mxfp8_bf16_sm100", "kv_norm_d128r64_mxfp4_bf16_sm90"],
)
def test_int32_slot_ids_compile_to_a_32_bit_slot_load(tmp_path, variant):
    """Int32 slot ids are a compile-time width of the same module (LaunchConfig.slots32): the slot is
    read with a sign-extending 32-bit load, and every other global access is what the int64 build has."""
    v = parse_name(variant)
    cache = KernelCache(tmp_path)
    target = v.arch.targets[0]
    keys = [
        KernelKey(variant, c, target)
        for c in (v.arch.default_config, dataclasses.replace(v.arch.default_config, slots32=True))
    ]
    wide, narrow = (cache.ensure_built(k) for k in keys)
    ptx_wide, ptx_narrow = ((cache.entry_dir(k) / "kernel.ptx").read_text() for k in keys)
    assert "ld.global.s32" in ptx_narrow and "ld.global.s32" not in ptx_wide
    assert narrow["resources"]["frame_bytes"] == 0 and narrow["ptx"]["local_memory"] is False

    def others(meta):
        return {k: n for k, n in meta["ptx"]["global_access_bits"].items() if k not in ("ld.32", "ld.64")}

    assert others(narrow) == others(wide)


# ---- one SM120 target for 12.0 and 12.1 ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "kv_d512r64_nvfp4_v41_bf16_sm120",
        "qkv_q8_qi_d512r64_mxfp8_bf16_sm120",
        "kv_norm_d128r64_mxfp4_bf16_sm120",
    ],
)
def test_the_family_target_emits_the_exact_targets_sass(variant):
    """The dispatcher serves 12.0 and 12.1 GPUs with sm_120f cubins (their loader takes a family
    cubin on every 12.x): its SASS must be what ptxas emits for sm_120a (RTX 50xx, RTX PRO 6000) and
    for sm_121a (GB10), instruction for instruction, in every kernel of the module."""
    from attn_prologue.lab import sass_reader

    cfg = LaunchConfig.from_key("w4_u1_pdl1_nc1_cs")
    kernels = ["kernel"] + ([] if parse_name(variant).op.has_q else ["scan_kernel"])
    sass = {}
    for target in ("sm_120f", "sm_120a", "sm_121a"):
        cubin = sass_reader.line_info_cubin(variant, cfg, target)  # (the DSL takes any target it knows)
        sass[target] = [[i.text for i in sass_reader.disassemble(cubin, k)[0]] for k in kernels]
    assert all(len(body) > 100 for body in sass["sm_120f"])
    assert sass["sm_120f"] == sass["sm_120a"] == sass["sm_121a"]
