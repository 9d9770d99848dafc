"""The tuner learns index_q on CPU terms: its own sweep space (only the knobs its template reads), the module
a timing runs is the one a call with the default bits is served, and a tuned entry reaches every preset's
calls folded to their bits. The timing itself runs on the GPU (tests/gpu/test_tune_gpu.py)."""

import pytest
from attn_prologue import dispatch, tuning
from attn_prologue.index_q import numerics_bits
from attn_prologue.lab import tune
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import IoDtype, Op, Request, parse_name

from .test_tuning_database import RecordingCache, fake_device

VARIANTS = ("index_q_d128r64_fp8_token_bf16_sm90", "index_q_d128r64_mxfp4_bf16_sm90")


@pytest.mark.parametrize("name", VARIANTS)
def test_the_index_q_space_holds_only_configs_its_module_takes(name):
    v = parse_name(name)
    space = tune.space_for(name)
    assert len({c.key for c in space}) == len(space) == len(tune.prune(space))
    assert [c.key for c in space if v.refusal(c)] == []
    # what the qkv writers' default space adds is refused or absent here
    assert v.refusal(LaunchConfig(4, 1, True, True, spread_kv=True))
    assert not any(c.lean_quant or c.cos_sin_late or c.defaults_only or c.spread_kv for c in space)
    assert tune.space_for("qkv_d512r64_fp8_ds_mla_bf16_sm90") == list(tune.DEFAULT_SPACE)


@pytest.mark.parametrize("name", VARIANTS)
def test_a_tuned_index_q_entry_serves_every_preset_folded_to_its_bits(tmp_path, name):
    """The entry keeps the config unfolded; the defaults' calls run exactly the module the tuner timed
    (tune.module_timed), an engine preset's calls the same config folded to the preset's bits."""
    v = parse_name(name)
    tuned = LaunchConfig.from_key("w8_u2_pdl1_nc0")
    env = tuning.environment_for("NVIDIA H200", 132, (9, 0))
    db = tuning.TuningDatabase(
        [{**env.as_dict(), "variant": name, "bucket": 2048, "config": tuned.key, "us": 1.0}]
    )
    rt = dispatch.Runtime(
        cache=RecordingCache(tmp_path), tuning_db=db.save(tmp_path / "db.json"), device_facts=fake_device()
    )
    req = Request(Op.INDEX_Q, 128, 64, v.cache_format, IoDtype.BF16)
    i = dispatch.bucket_index(2048)
    for preset in (None, "vllm", "sglang", "tokenspeed"):
        bits = numerics_bits(preset, "bf16", v.cache_format)
        served = rt.launchers(req, 0, heads=64, written=64, numerics=bits, fold_numerics=True)
        assert served[i].config == tuned.folded_to(bits, v.default_numerics), preset
        assert served[i + 1].config == v.arch.default_config.folded_to(bits, v.default_numerics)
        if bits == numerics_bits(None):
            assert served[i].config == tune.module_timed(name, tuned)
    assert tune.module_timed(name, tuned) != tuned  # the tuner compiles and times the folded module


@pytest.mark.parametrize("name", VARIANTS)
def test_an_entry_tuned_for_a_preset_serves_that_presets_calls_first(tmp_path, name):
    """`tune --numerics sglang` keeps its configs folded to SGLang's bits: those entries serve SGLang's calls
    and no other preset's; the unfolded entry of the same bucket serves the rest, and each survives a merge
    of the other."""
    v = parse_name(name)
    general = LaunchConfig.from_key("w8_u2_pdl1_nc0")
    sglang_bits = numerics_bits("sglang", "bf16", v.cache_format)
    [for_sglang] = tune.for_preset(name, [LaunchConfig.from_key("w4_u1_pdl1_nc1_cs_q4")], "sglang")
    assert for_sglang.folded_numerics == sglang_bits
    assert tune.for_preset(name, [general], "vllm") == [general]  # the defaults' entries serve every call
    assert tuning.entry_numerics({"config": for_sglang.key}) == sglang_bits
    assert tuning.entry_numerics({"config": general.key}) is None
    env = tuning.environment_for("NVIDIA H200", 132, (9, 0))
    path = tmp_path / "db.json"
    for config in (general, for_sglang):  # two runs merged into one file
        entry = {**env.as_dict(), "variant": name, "bucket": 2048, "config": config.key, "us": 1.0}
        tuning.TuningDatabase.merge_into(path, [entry])
    assert len(tuning.TuningDatabase.load(path).entries) == 2
    rt = dispatch.Runtime(cache=RecordingCache(tmp_path), tuning_db=path, device_facts=fake_device())
    req = Request(Op.INDEX_Q, 128, 64, v.cache_format, IoDtype.BF16)
    i = dispatch.bucket_index(2048)
    for preset in ("vllm", "sglang", "tokenspeed"):
        bits = numerics_bits(preset, "bf16", v.cache_format)
        served = rt.launchers(req, 0, heads=64, written=64, numerics=bits, fold_numerics=True)
        want = for_sglang if preset == "sglang" else general.folded_to(bits, v.default_numerics)
        assert served[i].config == want, preset
        assert served[i + 1].config == v.arch.default_config.folded_to(bits, v.default_numerics), preset


def test_only_index_q_is_tuned_per_preset():
    with pytest.raises(ValueError, match="only index_q"):
        tune.for_preset(
            "qkv_d512r64_fp8_ds_mla_bf16_sm90", [LaunchConfig.from_key("w4_u1_pdl1_nc1")], "sglang"
        )
