"""LaunchConfig.q_lanes: a Q row over k lanes (8, 16 or 32) instead of the module's own. Which modules take
it, how a config that does not apply is refused (compile, dispatch, build, tuning database), and what the
compiled code does with it on every arch: each lane loads D / (8 k) vectors of a row, no local memory,
64-bit token offsets, and in the chunk-interleaved layout no shared-memory stage (a warp's 32 / k rows
are stored side by side as they are). The bytes are checked against the reference on the GPU
(tests/gpu: test_interleaved_q_rows_under_other_launch_configs, test_launch_configs_match_reference)."""

from __future__ import annotations

import json

import pytest
from attn_prologue import dispatch, tuning
from attn_prologue.codegen.build import build_keys
from attn_prologue.errors import UnsupportedError
from attn_prologue.jit.compiler import CompileError, compile_entry
from attn_prologue.jit.kernel_cache import KernelCache
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import IoDtype, Op, Request, parse_name

from .test_emitted_code import address_problems, expected_min_128bit_loads
from .test_tuning_database import fake_device

Q16 = LaunchConfig(2, 1, lean_quant=True, defaults_only=True, q_lanes=16)


def test_the_key_spells_the_lanes_and_reads_back():
    assert Q16.key == "w2_u1_pdl1_nc1_lq_d_q16"
    assert LaunchConfig.from_key(Q16.key) == Q16
    assert LaunchConfig.from_key("w4_u1_pdl1_nc1_cs_r2_late_q8").q_lanes == 8
    assert LaunchConfig.from_key("w4_u1_pdl1_nc1").q_lanes == 0
    assert LaunchConfig.from_key("w4_u1_pdl1_nc1_q4").q_lanes == 4  # (index_q's rows only: Variant.q_lanes)
    with pytest.raises(ValueError, match="q_lanes must be 0"):
        LaunchConfig(q_lanes=2)


@pytest.mark.parametrize(
    "name, lanes",
    [
        ("qkv_d512r64_fp8_ds_mla_bf16_sm90", (0, 8, 16, 32)),
        ("qkv_qi_d512r64_mxfp8_bf16_sm120", (0, 8, 16, 32)),
        ("qkv_d128r64_mxfp4_bf16_sm90", (0, 8, 16)),  # 16 vectors a row: at most 16 lanes
        ("kv_d512r64_nvfp4_v41_bf16_sm90", (0,)),  # no Q rows
        ("kv_norm_d512r64_mxfp8_bf16_sm100", (0,)),
    ],
)
def test_which_modules_take_which_lanes(name, lanes):
    assert parse_name(name).q_lanes == lanes


@pytest.mark.parametrize(
    "name, config, says",
    [
        ("kv_d512r64_mxfp8_bf16_sm90", Q16, r"q_lanes=16 does not apply to this module \(it has no Q rows\)"),
        (
            "qkv_d128r64_mxfp4_bf16_sm90",
            LaunchConfig(q_lanes=32),
            r"q_lanes=32 does not apply .*\(0, 8, 16\)",
        ),
    ],
)
def test_a_module_that_does_not_take_the_lanes_refuses_them(tmp_path, name, config, says):
    with pytest.raises(CompileError, match=says):
        compile_entry(name, config, "sm_90a", tmp_path)
    assert "takes q_lanes" in parse_name(name).refusal(config)


def test_dispatch_refuses_a_forced_config_the_module_does_not_take(tmp_path):
    rt = dispatch.Runtime(cache=KernelCache(tmp_path), device_facts=fake_device())
    request = Request(Op.KV, 512, 64, "mxfp8", IoDtype.BF16)
    with pytest.raises(UnsupportedError, match="puts a Q row on 16 lanes; kv_d512r64_mxfp8_bf16_sm90 takes"):
        rt.launchers(request, 0, config=Q16)


def test_build_leaves_the_lanes_out_where_they_do_not_apply():
    plain = LaunchConfig()
    variants = [parse_name("kv_d512r64_mxfp8_bf16_sm90"), parse_name("qkv_d512r64_mxfp8_bf16_sm90")]
    keys = build_keys(variants, {"sm_90a"}, [Q16, plain])
    assert {(v.op.value, k.config.key) for v, k in keys} == {
        ("kv", plain.key),
        ("qkv", plain.key),
        ("qkv", Q16.key),
    }


def test_a_tuning_entry_with_lanes_its_variant_does_not_take_is_skipped(tmp_path):
    db = json.loads(tuning.shipped_database_path().read_text())
    kv = next(e for e in db["entries"] if e["variant"].startswith("kv_d512"))
    qkv = next(e for e in db["entries"] if e["variant"].startswith("qkv_d512"))
    db["entries"] = [{**kv, "config": Q16.key}, {**qkv, "config": Q16.key}]
    path = tmp_path / "db.json"
    path.write_text(json.dumps(db))
    with pytest.warns(tuning.TuningDatabaseWarning, match="skipped 1 invalid entries.*takes q_lanes"):
        loaded = tuning.TuningDatabase.load(path)
    assert [e["variant"] for e in loaded.entries] == [qkv["variant"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, target",
    [
        ("qkv_qi_d512r64_fp8_ds_mla_bf16_sm90", "sm_90a"),
        ("qkv_q8_qi_d512r64_mxfp8_bf16_sm100", "sm_100a"),
        ("qkv_qi_d512r64_mxfp8_bf16_sm120", "sm_120f"),
        ("qkv_d128r64_mxfp4_bf16_sm90", "sm_90a"),
    ],
)
def test_a_row_on_fewer_lanes_loads_more_vectors_a_lane_and_stages_nothing(tmp_path, name, target):
    v = parse_name(name)
    loads, staged = {}, {}
    for lanes in v.q_lanes[1:]:
        config = LaunchConfig(2, 2, lean_quant=True, defaults_only=True, q_lanes=lanes)
        meta = compile_entry(name, config, target, tmp_path / str(lanes))
        ptx = (tmp_path / str(lanes) / "kernel.ptx").read_text()
        bits = meta["ptx"]["global_access_bits"]
        loads[lanes] = sum(n for k, n in bits.items() if k.startswith("ld") and k.endswith(".128"))
        # each pass's row vectors and this lane's cos/sin (a warp's two passes unrolled)
        assert loads[lanes] == 2 * expected_min_128bit_loads(v, config)
        assert meta["ptx"]["local_memory"] is False and meta["resources"]["frame_bytes"] == 0
        checked, problems = address_problems(ptx)
        assert checked > 0 and not problems, problems[:5]
        staged[lanes] = "st.shared" in ptx
    assert loads[8] > loads[16]  # a row's vectors over fewer lanes: more a lane
    # two passes a warp stage their rows in shared memory only on a warp's lanes, in the interleaved layout
    assert staged == {k: k == 32 and v.q_layout.value == "interleaved" for k in staged}
