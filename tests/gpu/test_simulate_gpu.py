"""A small serving simulation on the GPU (the `simulate` command scaled down): the pool mode runs a
chunked-prefill + decode schedule with no allocation after the pool is locked and every sampled
cache entry bit-exact; the old allocating op, under the same memory budget, runs out of memory."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from attn_prologue.lab import simulate as sim

pytestmark = pytest.mark.gpu


def small_options(tmp_path, **kw) -> sim.SimOptions:
    opts = sim.SimOptions(
        max_num_batched_tokens=4096,
        padded_heads=64,
        heads=16,
        layers=4,
        seqs=4,
        prompt_len=3000,
        decode_steps=8,
        needles=64,
        kv_fraction=0.90,
        allocating=True,
        seed=0,
        json_path=str(tmp_path / "simulate.json"),
    )
    for k, v in kw.items():
        setattr(opts, k, v)
    # The budget leaves the allocating mode at most half a padded-Q tensor of headroom after its KV
    # cache (computed from the sizes, see allocating_failure_budget), so its first full step cannot
    # get the [4096, 64, 512] bf16 tensor it allocates.
    opts.memory_budget_bytes = sim.allocating_failure_budget(opts, margin=0.5)
    return opts


def test_small_serving_simulation(tmp_path):
    opts = small_options(tmp_path)
    padded_q = sim.padded_q_bytes(opts)
    assert padded_q == 4096 * 64 * 512 * 2
    free0 = torch.cuda.mem_get_info()[0]
    assert opts.memory_budget_bytes < free0, "the test budget must be a real cap"

    r = sim.run(opts)
    pr, al = r["pool"], r["allocating"]

    # pool mode: the whole schedule ran, nothing was allocated after the lock, no OOM
    assert pr["oom"] is None
    assert pr["tokens"] == pr["tokens_scheduled"] == sum(r["prompt_lens"]) + opts.seqs * opts.decode_steps
    assert pr["reserved_bytes"] == 2 * padded_q
    assert pr["no_allocation_after_lock"], pr["allocations_after_lock"]
    assert pr["allocations_after_lock"] == {k: 0 for k in sim.MEM_KEYS}
    assert pr["unplanned_peak_bytes"] == 0
    assert pr["kv"]["capacity_tokens"] == pr["kv"]["num_blocks"] * opts.block_size
    assert pr["kv"]["num_blocks"] >= pr["block_tables"]["blocks_needed"] == pr["block_tables"]["blocks_used"]
    # needle recall: every sampled cache entry bit-exact; q_out within bf16 tolerance; pads zero
    assert pr["needles"] == opts.needles
    assert pr["decode_needles"] >= 1
    assert pr["recall"] == pr["needles"], pr["mismatches"]
    assert pr["q_close"] == pr["needles"]
    assert pr["needle_pads_zero"] == pr["needles"]
    assert pr["pool_pads_zero"]
    assert r["passed"]

    # allocating mode under the same budget: a bigger KV cache (no pool), then OOM or measured excess
    assert al is not None
    assert al["kv"]["num_blocks"] > pr["kv"]["num_blocks"]
    assert al["headroom_bytes"] < padded_q, (
        "the budget was meant to leave less headroom than one padded Q tensor",
        {"padded_q": padded_q, "budget": opts.memory_budget_bytes, "pool_kv": pr["kv"], "alloc": al},
    )
    assert al["outcome"] == "oom" or al["exceeded_budget"], al
    if al["outcome"] == "oom":
        assert al["oom"]["requested_bytes"] > al["headroom_bytes"]
        assert al["tokens"] < pr["tokens"]
    else:
        assert al["unplanned_peak_bytes"] > al["headroom_bytes"]

    # the budget cap is lifted afterwards: a tensor larger than the budget can be allocated again
    big = torch.empty(opts.memory_budget_bytes + padded_q, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.empty_cache()

    saved = json.loads((tmp_path / "simulate.json").read_text())
    for key in ("provenance", "options", "pool", "allocating", "summary"):
        assert key in saved
    assert saved["provenance"]["device"]["name"] == torch.cuda.get_device_name()
    assert saved["provenance"]["versions"]["torch"] == torch.__version__
    assert saved["pool"]["recall"] == pr["recall"]
    assert saved["pool"]["kv"]["capacity_tokens"] == pr["kv"]["capacity_tokens"]


def test_cli_simulate_small(tmp_path, capsys):
    from attn_prologue.cli import main

    out = tmp_path / "cli.json"
    rc = main(
        [
            "simulate",
            "--max-num-batched-tokens",
            "2048",
            "--seqs",
            "3",
            "--prompt-len",
            "1500",
            "--layers",
            "2",
            "--decode-steps",
            "4",
            "--needles",
            "16",
            "--memory-budget-gb",
            "2",
            "--no-allocating",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"needle recall \(bit-exact\)\s+16/16", text), text
    saved = json.loads(out.read_text())
    assert saved["allocating"] is None and saved["passed"]
    # the process's own command line (pytest's here), verbatim; the options say what ran
    assert saved["provenance"]["argv"] == sys.argv
    assert saved["options"]["max_num_batched_tokens"] == 2048 and saved["options"]["layers"] == 2
