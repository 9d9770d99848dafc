"""LaunchConfig.row_split: a KV row over k warps. Which modules take it, how a config that does not
apply is refused (compile, dispatch, build, tuning database), and what the compiled code does with it
on every arch (each lane loads 1/k of the row; no local memory; 64-bit token offsets). The bytes are
checked against the reference on the GPU (tests/gpu: test_kv_writers_with_a_row_over_two_warps,
test_row_split_parity_choices_and_edges, test_launch_configs_match_reference)."""

from __future__ import annotations

import json

import pytest
from attn_prologue import tuning
from attn_prologue.codegen.build import build_keys
from attn_prologue.jit.compiler import CompileError, compile_entry
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import parse_name

from .test_emitted_code import address_problems, expected_min_128bit_loads


def test_the_key_spells_the_split_and_reads_back():
    c = LaunchConfig(4, 2, streaming=True, lean_quant=True, defaults_only=True, row_split=2)
    assert c.key == "w4_u2_pdl1_nc1_cs_lq_d_r2"
    assert LaunchConfig.from_key(c.key) == c
    assert LaunchConfig.from_key("w4_u1_pdl1_nc1").row_split == 1
    with pytest.raises(ValueError, match="row_split must be 1, 2 or 4"):
        LaunchConfig(row_split=3)


@pytest.mark.parametrize(
    "name, splits",
    [
        ("kv_d512r64_nvfp4_v41_bf16_sm90", (1, 2)),  # 2 vectors per lane over one warp
        ("kv_d512r64_fp8_ds_mla_bf16_sm120", (1, 2)),
        ("kv_d128r64_mxfp4_bf16_sm90", (1,)),  # 16 lanes already hold a row's 16 vectors
        ("kv_norm_d512r64_mxfp8_bf16_sm90", (1,)),  # an RMSNorm sums over the whole row
        ("qkv_d512r64_fp8_ds_mla_bf16_sm90", (1,)),  # Q rows are never split
    ],
)
def test_which_modules_take_a_split(name, splits):
    assert parse_name(name).row_splits == splits


def test_a_module_that_does_not_take_the_split_refuses_it(tmp_path):
    with pytest.raises(CompileError, match=r"row_split=2 does not apply to this module \(it takes \(1,\)\)"):
        compile_entry("kv_norm_d128r64_mxfp4_bf16_sm90", LaunchConfig(row_split=2), "sm_90a", tmp_path)


def test_build_leaves_a_given_split_out_where_it_does_not_apply():
    split, plain = LaunchConfig(row_split=2), LaunchConfig()
    variants = [parse_name("kv_d512r64_mxfp8_bf16_sm90"), parse_name("qkv_d512r64_mxfp8_bf16_sm90")]
    keys = build_keys(variants, {"sm_90a"}, [split, plain])
    assert sorted((v.op.value, k.config.key) for v, k in keys) == [
        ("kv", plain.key),
        ("kv", split.key),
        ("qkv", plain.key),
    ]


def test_a_tuning_entry_with_a_split_its_variant_does_not_take_is_skipped(tmp_path):
    db = json.loads(tuning.shipped_database_path().read_text())
    entry = next(e for e in db["entries"] if e["variant"].startswith("qkv_"))
    good = next(e for e in db["entries"] if e["variant"].startswith("kv_d512"))
    db["entries"] = [
        {**entry, "config": "w4_u1_pdl1_nc1_r2"},
        {**good, "config": "w4_u1_pdl1_nc1_r2"},
    ]
    path = tmp_path / "db.json"
    path.write_text(json.dumps(db))
    with pytest.warns(tuning.TuningDatabaseWarning, match="skipped 1 invalid entries.*takes row_split"):
        loaded = tuning.TuningDatabase.load(path)
    assert [e["config"] for e in loaded.entries] == ["w4_u1_pdl1_nc1_r2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, target",
    [
        ("kv_d512r64_nvfp4_v41_bf16_sm90", "sm_90a"),
        ("kv_d512r64_fp8_ds_mla_bf16_sm90", "sm_90a"),
        ("kv_d512r64_mxfp8_bf16_sm100", "sm_100a"),
        ("kv_d512r64_nvfp4_dsv4_bf16_sm120", "sm_120f"),
    ],
)
def test_a_split_row_loads_half_its_vectors_per_lane_on_every_arch(tmp_path, name, target):
    v = parse_name(name)
    loads = {}
    for split in (1, 2):
        config = LaunchConfig(4, 1, streaming=True, row_split=split)
        meta = compile_entry(name, config, target, tmp_path / str(split))
        ptx = (tmp_path / str(split) / "kernel.ptx").read_text()
        bits = meta["ptx"]["global_access_bits"]
        loads[split] = sum(n for k, n in bits.items() if k.startswith("ld") and k.endswith(".128"))
        assert loads[split] == expected_min_128bit_loads(v, config)  # row vectors + this lane's cos/sin
        assert meta["ptx"]["local_memory"] is False and meta["resources"]["frame_bytes"] == 0
        checked, problems = address_problems(ptx)
        assert checked > 0 and not problems, problems[:5]
    assert loads[2] < loads[1]  # 2 row vectors per lane over one warp, 1 over two
