"""`simulate` across ranks with the kernels: two ranks sharing one GPU (gloo, CUDA tensors; NCCL
cannot put two ranks on one device), started by `--spawn`. Each rank reserves its pool before its
KV cache, runs its head shard with every step padded to the agreed token count, and must show no
allocation after the lock, bit-exact needles equal to a one-process full-head run, cache bytes
equal across its TP group and zero pad heads; the allocating mode runs out of memory on each rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from attn_prologue.lab import simulate as sim

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(max_num_batched_tokens=2048, layers=2, seqs=3, prompt_len=1500, decode_steps=4, needles=32)


def run_ranks(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "ranks.json"
    small = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    # one GPU for both ranks, whatever the machine has
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    proc = subprocess.run(
        [sys.executable, "-m", "attn_prologue", "simulate", *small, "--spawn", "--backend", "gloo", "--json", str(out),
         "--timeout-s", "300", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc, json.loads(out.read_text())


def check_rank(e: dict, heads: int, padded: int) -> None:
    pr = e["pool"]
    assert e["passed"] and all(e["checks"].values()), e["checks"]
    assert pr["oom"] is None and pr["tokens"] == pr["tokens_scheduled"]
    assert pr["reserved_bytes"] == pr["reserved_bytes_after"] == 2 * 2048 * padded * 512 * 2
    # the CUDA allocator counted nothing between the lock and the end of the schedule
    assert pr["allocations_after_lock"] == {k: 0 for k in sim.MEM_KEYS} and pr["unplanned_peak_bytes"] == 0
    assert pr["pool_views"]["outside_reservation"] == 0
    assert pr["padded_tokens"] == pr["padded_tokens_expected"]
    assert pr["recall"] == pr["needles"] == SMALL["needles"] and pr["q_close"] == pr["needles"]
    fh = pr["full_head"]  # the kernel at H live heads equals the kernel with all 64 heads, bit for bit
    assert fh["q_equal"] == fh["records_equal"] == fh["needles"] == SMALL["needles"]
    assert (
        pr["needle_pads_zero"] == pr["needles"] and pr["pool_pads_zero"] and pr["blocks_outside_tables_zero"]
    )
    assert pr["kv"]["num_blocks"] >= pr["block_tables"]["blocks_needed"] > 0


def test_two_tp_ranks_share_one_gpu(tmp_path):
    """TP 2: 64 query heads -> 32 live per rank, padded to 64; the allocating mode, under a budget
    leaving it less than one padded Q tensor of headroom, runs out of memory on both ranks."""
    opts = sim.SimOptions(**SMALL, heads=32, padded_heads=64, tp=2, query_heads=64)
    budget = sim.allocating_failure_budget(opts, margin=0.5)
    proc, doc = run_ranks(tmp_path, "--tp", "2", "--dp", "1", "--memory-budget-gb", f"{budget / 1e9:.9f}")
    t = doc["topology"]
    assert (t["world"], t["backend"], t["ranks_per_device"]) == (2, "gloo", 2)
    assert len(set(t["devices"])) == 1 and t["memory_budget_bytes"] == [budget, budget]
    for e in doc["ranks"]:
        check_rank(e, 32, 64)
        tc = e["pool"]["tp_cache"]
        assert tc["tables_equal"] and tc["mismatched_bytes"] == 0 and tc["blocks_compared"] > 0
        al = e["allocating"]
        assert al["outcome"] == "oom" and al["oom"]["requested_bytes"] > al["headroom_bytes"], al
    # both ranks got the same [N, 64, 512] request at the same step: they fail at the same point
    assert len({(e["allocating"]["oom"]["step"], e["allocating"]["oom"]["layer"]) for e in doc["ranks"]}) == 1
    assert "verdict  PASS" in proc.stdout


def test_two_dp_ranks_share_one_gpu_unpadded(tmp_path):
    """DP 2: 3 sequences split 2 + 1, every step padded to the larger batch (rank 1 runs pad rows,
    and in its last step only pad rows); 64 live heads, P = 64 (no pad heads). Without a budget,
    ranks sharing the GPU get equal shares of its free memory."""
    _, doc = run_ranks(tmp_path, "--tp", "1", "--dp", "2", "--padded-heads", "64", "--no-allocating")
    t = doc["topology"]
    assert t["ranks_per_device"] == 2 and all(b is not None for b in t["memory_budget_bytes"])
    ranks = doc["ranks"]
    assert [e["seq_ids"] for e in ranks] == [[0, 2], [1]]
    for e in ranks:
        check_rank(e, 64, 64)
        assert "tp_cache" not in e["pool"]
    padded = ranks[1]["pool"]
    assert padded["padded_rows"] > 0 and len(padded["padded_tokens"]) > padded["steps"]  # idle steps too
