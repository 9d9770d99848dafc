"""A compressed writer's call of more than SPECULATIVE_ROWS rows (0 in the shipped plan: every one) scans windows of positions and
gives only the group-boundary rows a warp's row work, in rounds: bit for bit against the reference
with whole-cache compares and poisoned storage, for positions as an engine sends them (runs of
consecutive positions), random ones, and every row a boundary (the most rounds a window can take),
under launch configs with 1, 2 and 4 passes per warp, a row over two warps and a persistent grid;
and in checked mode every out-of-range row is counted once, boundary or not."""

from __future__ import annotations

import pytest
import torch
from attn_prologue import dispatch
from attn_prologue.launch import LaunchConfig

from .cases import Case, compare, describe_mismatch, make_inputs, run_kernel, run_reference

pytestmark = pytest.mark.gpu

# (op, format, head dim, compress ratio): every record a compressed writer takes, every ratio
WRITERS = [
    ("kv", "fp8_ds_mla", 512, 4),
    ("kv", "mxfp8", 512, 128),
    ("kv", "nvfp4_v41", 512, 2),
    ("kv", "nvfp4_dsv4", 512, 2),
    ("kv_norm", "fp8_token", 128, 4),
    ("kv_norm", "mxfp4", 128, 128),
]
CONFIGS = ["w4_u1_pdl1_nc1_cs", "w4_u2_pdl1_nc1_cs_lq", "w2_u4_pdl1_nc1_cs_lq_d", "w8_u1_pdl1_nc1_c1_cs"]
ROW_SPLIT = "w4_u2_pdl1_nc1_cs_lq_r2"


def runs_of_positions(ratio: int):
    """Sequences of consecutive positions (chunked prefill of a few requests), each starting anywhere."""

    def mutate(x):
        n, max_pos = x.positions.shape[0], x.cos_sin_cache.shape[0]
        g = torch.Generator(device="cpu").manual_seed(n + ratio)
        pos, t = torch.empty(n, dtype=torch.int64), 0
        while t < n:
            length = int(torch.randint(1, 700, (1,), generator=g))
            length = min(length, n - t, max_pos)
            start = int(torch.randint(0, max_pos - length + 1, (1,), generator=g))
            pos[t : t + length] = torch.arange(start, start + length)
            t += length
        x.positions.copy_(pos)

    return mutate


def scattered_boundaries(ratio: int):
    """Random positions, every third row moved to its group's boundary."""

    def mutate(x):
        pos = x.positions
        group = torch.div(pos, ratio, rounding_mode="floor")
        k = torch.arange(pos.shape[0], device=pos.device)
        on = (k % 3 == 0) & ((group + 1) * ratio - 1 < x.cos_sin_cache.shape[0])
        pos.copy_(torch.where(on, (group + 1) * ratio - 1, pos))

    return mutate


def every_row_a_boundary(ratio: int):
    def mutate(x):
        groups = x.cos_sin_cache.shape[0] // ratio
        x.positions.copy_(x.positions % groups * ratio + ratio - 1)

    return mutate


POSITIONS = {"runs": runs_of_positions, "scattered": scattered_boundaries, "all": every_row_a_boundary}


def check(case: Case, mutate, config: str | None, checked: bool = False) -> None:
    x = make_inputs(case)
    mutate(x)
    kw = {"config": LaunchConfig.from_key(config)} if config else {}
    got = run_kernel(x, checked=checked, **kw)
    want = run_reference(x)
    torch.cuda.synchronize()
    diff = compare(got, want)
    assert all(v == 0 for v in diff.values()), f"{case} {config}: {diff} {describe_mismatch(got, want)}"


@pytest.mark.parametrize("op,fmt,d,ratio", WRITERS)
@pytest.mark.parametrize("layout", sorted(POSITIONS))
def test_large_compressed_calls_insert_exactly_the_boundary_rows(op, fmt, d, ratio, layout):
    configs = [None, *CONFIGS] + ([ROW_SPLIT] if d == 512 else [])
    for i, n in enumerate((513, 1000, 2049)):
        for config in configs:
            case = Case(
                n=n, op=op, head_dim=d, cache_format=fmt, compress_ratio=ratio, block_size=(64, 256, 32)[i],
                negative_every=7, page_align=512, slot_dtype=("int64", "int32")[i % 2], seed=60 + i,
            )  # fmt: skip
            check(case, POSITIONS[layout](ratio), config)


@pytest.mark.parametrize("op,fmt,d,ratio", [WRITERS[0], WRITERS[2], WRITERS[4]])
@pytest.mark.parametrize("config", [None, "w4_u2_pdl1_nc1_cs_lq", ROW_SPLIT])
def test_large_compressed_calls_count_every_out_of_range_row_once(op, fmt, d, ratio, config):
    if config == ROW_SPLIT and d != 512:
        pytest.skip("row_split takes D = 512 rows only")
    case = Case(n=700, op=op, head_dim=d, cache_format=fmt, compress_ratio=ratio, negative_every=9, seed=70)
    x = make_inputs(case)
    scattered_boundaries(ratio)(x)
    capacity = x.k_cache.shape[0] * case.block_size
    max_pos = x.cos_sin_cache.shape[0]
    boundary = torch.nonzero((x.positions + 1) % ratio == 0).flatten().tolist()
    other = torch.nonzero((x.positions + 1) % ratio != 0).flatten().tolist()
    for k in boundary[1:40:4] + other[2:40:4]:  # out of range at boundary rows and at rows the writer drops
        if x.slot_mapping[k] >= 0:
            x.slot_mapping[k] = capacity + k
    x.positions[boundary[3]] = max_pos + ratio - 1 - max_pos % ratio  # a boundary position past the table
    x.positions[other[5]] = -1
    x.slot_mapping[other[6]] = -1  # skipped, not counted, though its position is out of range
    x.positions[other[6]] = max_pos
    slots, pos = x.slot_mapping.to(torch.int64), x.positions
    expected = int(((slots >= 0) & ((slots >= capacity) | (pos < 0) | (pos >= max_pos))).sum())
    assert expected > 10  # the case really holds rows of both kinds
    err = dispatch.default_runtime().errors_buffer(x.kv.device)
    err.zero_()
    kw = {"config": LaunchConfig.from_key(config)} if config else {}
    got = run_kernel(x, checked=True, **kw)
    want = run_reference(x)
    torch.cuda.synchronize()
    assert compare(got, want) == {k: 0 for k in compare(got, want)}, f"{case}: {describe_mismatch(got, want)}"
    assert err[0].item() == expected
