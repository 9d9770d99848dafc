"""The bench's mode rows on the GPU: a qkv mode is timed between two timings of the full op on its own
inputs (bench.full_op), and the targets checker reads its ratio from those (targets.NO_SLOWER,
INTERLEAVED_COST), before a long bench run depends on it."""

import math

import pytest
from attn_prologue.lab import bench, targets

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "modes", [dict(apply_q_norm=False), dict(q_layout="interleaved")], ids=["no-q-norm", "interleaved"]
)
def test_a_mode_row_carries_the_full_op_timed_around_it(modes):
    n = 2048 if modes.get("q_layout") else 1  # (INTERLEAVED_COST is a T >= 2048 target)
    shape = bench.Shape(n=n, **modes)
    r = bench.run_shape(shape, baselines=False, replays=5).as_json()
    full = r["extra"]["full_op_us"]
    assert len(full) == 2 and all(math.isfinite(t) and t > 0 for t in full), full
    # the pairing's row (the shape has others too, e.g. its copy ratio at T >= 2048)
    pairing = (targets.NO_SLOWER.name, targets.INTERLEAVED_COST.name)
    rows = [
        row
        for row in targets.check_targets({"results": [r]})
        if row["shape"] == shape.label and row["target"] in pairing
    ]
    assert len(rows) == 1, rows
    assert rows[0]["measured"] == pytest.approx(r["op"]["median_us"] / (sum(full) / 2))
    # the full op alone is its own yardstick: no pairing, no mode row
    plain = bench.run_shape(bench.full_op(shape), baselines=False, replays=5).as_json()
    assert "full_op_us" not in plain["extra"]
