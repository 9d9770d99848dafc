"""A small tuning sweep end to end on the GPU: its choice per bucket is at least as fast as the
heuristic's config when both are re-timed afterwards."""

import pytest
from attn_prologue import dispatch, tuning
from attn_prologue.lab import tune
from attn_prologue.lab.provenance import provenance

pytestmark = pytest.mark.gpu


def test_small_sweep_beats_or_ties_the_heuristic(tmp_path):
    arch = dispatch.default_runtime().device().arch
    variant = f"qkv_d512r64_fp8_ds_mla_bf16_{arch.value}"
    default = arch.default_config
    configs = tune.prune([default, *tune.DEFAULT_SPACE[:6]])
    buckets = [1, 64, 2048]
    sweep = tune.run([variant], buckets, configs, jobs=2, replays=10, log=lambda msg: None)
    assert not [f for f in sweep.failures if not f[3].startswith("pruned")]
    env = tuning.current_environment()
    rows = tune.entries(sweep, [variant], buckets, env, 64, 64, provenance=provenance())
    assert [r["bucket"] for r in rows] == buckets
    for r in rows:
        best = tune.time_config(
            variant, tuning.LaunchConfig.from_key(r["config"]), r["bucket"], h=64, p=64, replays=15
        )
        heur = tune.time_config(variant, default, r["bucket"], h=64, p=64, replays=15)
        assert best <= heur * 1.03, (r, best, heur)  # equal configs re-time within noise
    db = tuning.TuningDatabase.load(tmp_path / "db.json")
    db.merge(rows)
    db.save()
    assert len(tuning.TuningDatabase.load(tmp_path / "db.json").table_for(env)) == len(buckets)
