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


@pytest.mark.parametrize("fmt", ["fp8_token", "mxfp4"])
def test_index_q_sweep_beats_or_ties_the_heuristic_and_serves_the_same_bytes(tmp_path, fmt):
    """index_q through the tuner: its own space, the entry re-timed against the heuristic, and a runtime
    reading the new database writes the bytes the default runtime writes (sglang's bits: a folded twin)."""
    import torch
    from attn_prologue import index_q_ops
    from attn_prologue.lab import bench_index_q

    arch = dispatch.default_runtime().device().arch
    variant = f"index_q_d128r64_{fmt}_bf16_{arch.value}"
    default = arch.default_config
    configs = tune.prune([default, *tune.space_for(variant)[::12]])
    buckets = [1, 2048]
    sweep = tune.run([variant], buckets, configs, jobs=2, replays=10, log=lambda msg: None)
    assert not [f for f in sweep.failures if not f[3].startswith("pruned")]
    rows = tune.entries(
        sweep, [variant], buckets, tuning.current_environment(), 64, 64, provenance=provenance()
    )
    assert [r["bucket"] for r in rows] == buckets
    for r in rows:
        best = tune.time_config(
            variant, tuning.LaunchConfig.from_key(r["config"]), r["bucket"], h=64, p=64, replays=15
        )
        heur = tune.time_config(variant, default, r["bucket"], h=64, p=64, replays=15)
        assert best <= heur * 1.03, (r, best, heur)
    db = tuning.TuningDatabase.load(tmp_path / "db.json")
    db.merge(rows)
    tuned_rt = dispatch.Runtime(tuning_db=db.save())
    (a,) = bench_index_q.input_sets(2048, fmt, 1, numerics="sglang")
    outs = []
    for rt in (dispatch.default_runtime(), tuned_rt):
        for name in ("q_out", "weights_out", "q_scales"):
            if a[name] is not None:
                a[name].fill_(0x5A if a[name].dtype == torch.uint8 else float("nan"))
        index_q_ops.index_q_rope_quant(**a, runtime=rt)
        outs.append([a[n].clone() for n in ("q_out", "weights_out", "q_scales") if a[n] is not None])
    for mine, theirs in zip(*outs, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
