"""The parts of `simulate` that need no GPU: the engine model (prompt lengths, the chunked-prefill
scheduler, the block allocator and slot mappings, needle selection and location, the memory-budget
arithmetic, the plan) and the report (verdict and table from given pass results)."""

from __future__ import annotations

import pytest
import torch
from attn_prologue.cli import main as cli_main
from attn_prologue.lab import simulate as sim
from attn_prologue.lab.simulate import report


def run_schedule(prompts, max_tokens, decode_steps, num_blocks=None, bs=64, seed=0):
    schedule = sim.build_schedule(prompts, max_tokens, decode_steps)
    need = sum(sim.blocks_for(p + decode_steps, bs) for p in prompts)
    alloc = sim.BlockAllocator(num_blocks if num_blocks is not None else need, bs, seed=seed)
    per_step = [sim.step_slots_positions(step, alloc) for step in schedule]
    return schedule, alloc, per_step


def test_prompt_lengths_are_about_the_length_and_deterministic():
    a = sim.prompt_lengths(8, 30000, 0.05, seed=3)
    assert a == sim.prompt_lengths(8, 30000, 0.05, seed=3)
    assert a != sim.prompt_lengths(8, 30000, 0.05, seed=4)
    assert all(28500 <= x <= 31500 for x in a)
    assert sim.prompt_lengths(3, 100, 0.0) == [100, 100, 100]


@pytest.mark.parametrize(
    "prompts,max_tokens,decode",
    [
        ([3000, 2950, 3100, 2990], 4096, 8),
        ([30000, 29000, 31000, 30500, 28800, 30100, 29900, 30700], 32768, 32),
        ([1, 64, 65, 127, 128, 129], 100, 3),
        ([500], 4096, 0),
        ([10, 20, 30], 7, 5),
    ],
)
def test_every_prompt_token_scheduled_once_with_correct_positions(prompts, max_tokens, decode):
    schedule, alloc, per_step = run_schedule(prompts, max_tokens, decode)
    seen = {s: [] for s in range(len(prompts))}
    for step, (slots, positions) in zip(schedule, per_step):
        assert 0 < step.num_tokens <= max_tokens
        assert slots.shape == positions.shape == (step.num_tokens,)
        assert slots.dtype == positions.dtype == torch.int64
        row = 0
        for c in step.chunks:
            assert positions[row : row + c.length].tolist() == list(range(c.start, c.start + c.length))
            seen[c.seq].extend(range(c.start, c.start + c.length))
            row += c.length
    for s, p in enumerate(prompts):
        assert sorted(seen[s]) == list(range(p + decode)), s  # every token exactly once, in order of position
        assert seen[s] == sorted(seen[s])
    prefill = [st for st in schedule if st.kind == "prefill"]
    decodes = [st for st in schedule if st.kind == "decode"]
    assert len(decodes) == decode
    assert all(st.kind == "prefill" for st in schedule[: len(prefill)])  # prefills first, then decodes
    for k, st in enumerate(decodes):
        assert [(c.seq, c.start, c.length) for c in st.chunks] == [
            (s, p + k, 1) for s, p in enumerate(prompts)
        ]
    # FCFS chunked prefill fills every prefill step but the last one
    assert all(st.num_tokens == max_tokens for st in prefill[:-1])
    assert sum(st.num_tokens for st in prefill) == sum(prompts)


def test_a_step_mixes_chunks_of_several_sequences():
    schedule = sim.build_schedule([3000, 2950, 3100, 2990], 4096, 0)
    assert any(len({c.seq for c in st.chunks}) > 1 for st in schedule)
    full = sim.build_schedule([30000] * 8, 32768, 0)
    assert len(full) == -(-8 * 30000 // 32768)
    assert any(len(st.chunks) > 1 for st in full)


def test_scheduler_rejects_bad_sizes():
    with pytest.raises(sim.SimulationError):
        sim.build_schedule([10, 10, 10], 2, 1)  # a decode step of 3 tokens does not fit
    with pytest.raises(sim.SimulationError):
        sim.build_schedule([10], 0, 0)


def test_slots_are_unique_and_follow_the_block_tables():
    prompts, bs, decode = [700, 64, 1, 129, 500], 64, 9
    schedule, alloc, per_step = run_schedule(prompts, 256, decode, bs=bs, seed=5)
    all_slots = torch.cat([s for s, _ in per_step])
    assert all_slots.unique().numel() == all_slots.numel() == sum(prompts) + decode * len(prompts)
    need = sum(sim.blocks_for(p + decode, bs) for p in prompts)
    assert alloc.num_free == 0 and alloc.num_blocks == need  # exactly ceil(len / bs) blocks per sequence
    for s, p in enumerate(prompts):
        table = alloc.table(s)
        assert len(table) == sim.blocks_for(p + decode, bs)
    for step, (slots, _positions) in zip(schedule, per_step):
        row = 0
        for c in step.chunks:
            for j in range(c.length):
                pos = c.start + j
                slot = int(slots[row + j])
                assert slot == alloc.table(c.seq)[pos // bs] * bs + pos % bs == alloc.slot(c.seq, pos)
                assert slot // bs in alloc.table(c.seq) and slot % bs == pos % bs
            row += c.length
    # tables of different sequences share no block
    blocks = [b for s in range(len(prompts)) for b in alloc.table(s)]
    assert len(blocks) == len(set(blocks))


def test_block_allocator_grows_frees_and_runs_out():
    a = sim.BlockAllocator(10, 16)  # no seed: blocks in order
    a.ensure(0, 1)
    assert a.table(0) == [0]
    a.ensure(0, 16)
    assert a.table(0) == [0]
    a.ensure(0, 17)
    assert a.table(0) == [0, 1]
    a.ensure(1, 40)
    assert a.table(1) == [2, 3, 4] and a.num_free == 5
    assert a.slot(1, 33) == 4 * 16 + 1
    with pytest.raises(sim.SimulationError):
        a.slot(1, 48)  # not allocated yet
    with pytest.raises(sim.SimulationError):
        a.ensure(2, 6 * 16)  # needs 6, 5 free
    assert a.num_free == 5  # a refused request takes nothing
    a.free(0)
    assert a.num_free == 7 and a.table(0) == []
    a.ensure(2, 7 * 16)
    assert a.num_free == 0 and sorted(a.table(2)) == [0, 1, 5, 6, 7, 8, 9]
    shuffled = sim.BlockAllocator(1000, 64, seed=1)
    shuffled.ensure(0, 64 * 1000)
    assert sorted(shuffled.table(0)) == list(range(1000)) and shuffled.table(0) != list(range(1000))
    again = sim.BlockAllocator(1000, 64, seed=1)
    again.ensure(0, 64 * 1000)
    assert again.table(0) == shuffled.table(0)


def test_needle_selection_is_deterministic_and_covers_the_schedule():
    prompts, decode, layers = sim.prompt_lengths(8, 30000, 0.05, seed=0), 32, 43
    a = sim.select_needles(prompts, decode, layers, 64, seed=0)
    assert a == sim.select_needles(prompts, decode, layers, 64, seed=0)
    assert a != sim.select_needles(prompts, decode, layers, 64, seed=1)
    assert len(a) == len(set(a)) == 64
    for nd in a:
        assert 0 <= nd.seq < 8 and 0 <= nd.pos < prompts[nd.seq] + decode and 0 <= nd.layer < layers
    n_dec = sum(1 for nd in a if nd.pos >= prompts[nd.seq])
    assert n_dec == 8  # 1/8 from decode tokens
    assert len({nd.seq for nd in a}) > 1 and len({nd.layer for nd in a}) > 1
    # more needles than tokens x layers: all of them
    small = sim.select_needles([3, 2], 1, 2, 1000, seed=0)
    assert len(small) == (3 + 2 + 2) * 2
    assert sim.select_needles([5], 0, 1, 3, seed=0) == sim.select_needles([5], 0, 1, 3, seed=0)
    assert all(nd.pos < 5 for nd in sim.select_needles([5], 0, 1, 3, seed=0))


def test_located_needles_point_at_their_token():
    prompts, decode, layers, max_tokens = [3000, 2950, 3100, 2990], 8, 4, 4096
    schedule, alloc, per_step = run_schedule(prompts, max_tokens, decode)
    needles = sim.select_needles(prompts, decode, layers, 64, seed=2)
    where = sim.locate_needles(schedule, needles)
    found = 0
    for si, by_layer in where.items():
        slots, positions = per_step[si]
        for layer, hits in by_layer.items():
            for ni, row in hits:
                nd = needles[ni]
                assert nd.layer == layer
                assert int(positions[row]) == nd.pos
                assert int(slots[row]) == alloc.slot(nd.seq, nd.pos)
                # the row belongs to the needle's sequence
                r0 = 0
                for c in schedule[si].chunks:
                    if r0 <= row < r0 + c.length:
                        assert c.seq == nd.seq
                    r0 += c.length
                found += 1
    assert found == len(needles)
    with pytest.raises(sim.SimulationError):
        sim.locate_needles(schedule, [sim.Needle(0, 10**6, 0)])


def test_memory_budget_arithmetic_for_the_gpu_test():
    opts = sim.SimOptions(
        max_num_batched_tokens=4096, seqs=4, prompt_len=3000, layers=4, decode_steps=8, needles=64
    )
    pq = sim.padded_q_bytes(opts)
    assert pq == 4096 * 64 * 512 * 2 == 256 * 2**20
    assert sim.pool_bytes(opts) == 2 * pq
    budget = sim.allocating_failure_budget(opts)
    arena = sim.input_arena_bytes(opts)
    # the allocating mode's KV cache leaves (1 - f) * (budget - arena) <= pq / 2 of headroom
    assert (1 - opts.kv_fraction) * (budget - arena) <= 0.5 * pq + 1
    # the pool mode still has room for the pool and a KV cache the schedule fits in
    prompts = sim.prompt_lengths(opts.seqs, opts.prompt_len, opts.prompt_jitter, opts.seed)
    need = sum(sim.blocks_for(p + opts.decode_steps, opts.block_size) for p in prompts)
    block = 64 * 584
    kv_pool = opts.kv_fraction * (
        budget - arena - sim.pool_bytes(opts) - 64 * 2**20
    )  # 64 MiB of allocator rounding
    assert kv_pool // (opts.layers * block) > 10 * need


def test_cli_parses_simulate_and_fails_cleanly_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the no-GPU path")
    assert cli_main(["simulate", "--layers", "2", "--no-allocating"]) == 2  # parsed, then refused
    assert (
        capsys.readouterr().err.strip()
        == "attn_prologue simulate: needs a CUDA GPU, and none is available here; `--device cpu` runs the same "
        "schedule through the PyTorch reference"
    )


def test_plan_is_what_the_parts_give():
    opts = sim.SimOptions(max_num_batched_tokens=4096, seqs=4, prompt_len=3000, layers=4, decode_steps=8)
    plan = sim.make_plan(opts)
    prompts = sim.prompt_lengths(opts.seqs, opts.prompt_len, opts.prompt_jitter, opts.seed)
    assert plan.prompt_lens == prompts
    assert plan.schedule == sim.build_schedule(prompts, 4096, 8)
    assert plan.needles == sim.select_needles(prompts, 8, 4, opts.needles, opts.seed)
    assert plan.where == sim.locate_needles(plan.schedule, plan.needles)
    assert plan.max_pos == sim.max_position(prompts, 8)
    assert plan.needed_blocks == sum(sim.blocks_for(p + 8, opts.block_size) for p in prompts)
    assert plan.total_tokens == sum(prompts) + 4 * 8


def pass_results(needles=64, **over):
    kv = {"num_blocks": 100, "capacity_tokens": 6400, "kv_bytes": 2**30, "free_bytes": 2**31}
    pool = {
        "reserved_bytes": 2**28, "kv": kv, "steps": 4, "prefill_steps": 3, "decode_steps": 1, "layer_calls": 16,
        "tokens": 1000, "tokens_scheduled": 1000, "seconds": 0.5, "oom": None, "no_allocation_after_lock": True,
        "allocations_after_lock": {k: 0 for k in sim.MEM_KEYS}, "unplanned_peak_bytes": 0, "recall": needles,
        "needles": needles, "needle_parts": {"nope_e4m3": needles, "rope_bf16": needles, "scale_ue8m0": needles},
        "q_close": needles, "q_exact": needles, "needle_pads_zero": needles, "pool_pads_zero": True,
        "stopped_by_another_rank": False, "padding_agreed": True, "blocks_outside_tables_zero": True,
        "pool_views": {"calls": 16, "outside_reservation": 0},
    }  # fmt: skip
    pool.update(over)
    oom = {"step": 2, "steps": 4, "layer": 1, "tokens": 4096, "requested_bytes": 2**28}
    allocating = {"kv": kv, "outcome": "oom", "oom": oom, "headroom_bytes": 2**27, "unplanned_peak_bytes": 0}
    return pool, allocating


@pytest.mark.parametrize(
    "over,passed",
    [
        ({}, True),
        ({"recall": 63}, False),
        ({"no_allocation_after_lock": False}, False),
        ({"tokens": 999}, False),
        ({"blocks_outside_tables_zero": False}, False),
        ({"padding_agreed": False}, False),
        ({"full_head": {"needles": 64, "q_equal": 64, "records_equal": 63}}, False),
        ({"tp_cache": {"tables_equal": True, "blocks_compared": 9, "mismatched_bytes": 1}}, False),
        ({"tp_cache": {"tables_equal": True, "blocks_compared": 9, "mismatched_bytes": 0}}, True),
    ],
)
def test_report_gives_the_verdict_and_the_table(over, passed):
    opts = sim.SimOptions(max_num_batched_tokens=4096, seqs=4, prompt_len=3000, layers=4, decode_steps=8)
    origin = {"device": {"name": "NVIDIA H200", "capability": "9.0", "sm_count": 132}}
    pool, allocating = pass_results(**over)
    doc = report.document(opts, sim.make_plan(opts), pool, allocating, 1.5, origin)
    assert doc["provenance"] is origin and doc["options"]["layers"] == 4
    assert doc["passed"] is passed and doc["summary"]["passed"] is passed
    assert doc["summary"]["allocating_oom_at"] == {"step": 2, "layer": 1, "tokens": 4096}
    text = sim.summary(doc)
    assert text.splitlines()[0].split() == ["device", "NVIDIA", "H200"]
    assert "torch.cuda.OutOfMemoryError at step 2/4" in text
    assert text.splitlines()[-1].endswith("PASS" if passed else "FAIL")
