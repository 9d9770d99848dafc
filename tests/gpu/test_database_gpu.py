"""Every launch config the shipped tuning database picks, run at the size it was picked for, bit for
bit against the reference. The launch-config tests (test_kernels_gpu.py) cover every knob on a few
modules at small sizes; this covers the exact (module, config, compress ratio) choices a serving
call on the tuned GPU runs, with the heads they were tuned at and a token count inside their largest
bucket (at most 3584: past that only the grid's stride count grows), so a re-tune cannot ship an
untested pair.
"""

from __future__ import annotations

import pytest
import torch
from attn_prologue import tuning
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import parse_name

from .cases import (
    Case,
    boundaries,
    compare,
    describe_mismatch,
    make_inputs,
    module_fields,
    run_kernel,
    run_reference,
)

pytestmark = pytest.mark.gpu

MAX_TOKENS = 4096


def shipped_choices() -> list[tuple[str, str, int, int, int, int]]:
    """(variant, config, compress ratio, heads, heads written, largest bucket it was picked for)."""
    largest: dict[tuple, int] = {}
    for e in tuning.TuningDatabase.load(tuning.shipped_database_path()).entries:
        heads, written, ratio = tuning.entry_shape(e)
        key = (e["variant"], e["config"], ratio, heads, written)
        largest[key] = max(largest.get(key, 0), e["bucket"])
    return [(*key, bucket) for key, bucket in sorted(largest.items())]


@pytest.mark.parametrize("name, key, ratio, heads, written, bucket", shipped_choices())
def test_shipped_choice_matches_reference(name, key, ratio, heads, written, bucket):
    v = parse_name(name)
    n = min(bucket, MAX_TOKENS)
    n -= n // 8  # inside the bucket, and not a multiple of the CTA's rows
    case = Case(
        n=n,
        h=heads,
        p=written,
        **module_fields(v),
        q_layout=v.q_layout.value,
        compress_ratio=ratio,
        block_size=64,
        negative_every=7 if n > 1 else 0,
        seed=bucket + heads + ratio,
    )
    x = make_inputs(case)
    if ratio > 1:
        boundaries(ratio)(x)
    got = run_kernel(x, config=LaunchConfig.from_key(key))
    want = run_reference(x)
    torch.cuda.synchronize()
    diff = compare(got, want)
    assert all(d == 0 for d in diff.values()), f"{case} {key}: {diff} {describe_mismatch(got, want)}"
