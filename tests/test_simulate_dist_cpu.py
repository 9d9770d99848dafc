"""`simulate` across ranks on the CPU: real torch.distributed (gloo) processes running the PyTorch
reference, started by `--spawn`, by torchrun, and by a launcher's environment variables; the DP
split and padding plan, the typed errors for bad options, and the rank collectives the checks use.

Shapes are tiny (2 layers, prompts of ~50 tokens, 8 query heads) so each run of 2 or 4 processes
takes seconds on two cores; the needles cover every (token, layer), so the per-rank checks compare
every record written against a one-process run with every head."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from attn_prologue.cli import main as cli_main
from attn_prologue.errors import InputError
from attn_prologue.lab import simulate as sim
from attn_prologue.lab.simulate.ranks import Ranks
from attn_prologue.scratch import ScratchPool

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--query-heads", "8", "--layers", "2", "--seqs", "3", "--prompt-len", "50",
         "--max-num-batched-tokens", "64", "--decode-steps", "2", "--needles", "1000", "--timeout-s", "60"]  # fmt: skip
TIMEOUT = 120  # seconds a whole run may take before the test fails (it takes ~10-20 s on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "attn_prologue", "simulate", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    return proc


def check_ranks(doc: dict, tp: int, dp: int, padded_heads: int, backend: str | None = "gloo") -> None:
    """What every rank of a passing CPU run must show, read from the result file."""
    t = doc["topology"]
    assert (t["tp"], t["dp"], t["world"], t["backend"]) == (tp, dp, tp * dp, backend)
    assert t["devices"] == ["cpu"] * (tp * dp)
    if backend is not None:  # launched ranks: set for them (absent from the test's environment)
        assert t["environment"] == sim.NO_MULTICAST
    assert doc["options"]["heads"] == 8 // tp and doc["options"]["query_heads"] == 8
    ranks = doc["ranks"]
    assert [e["rank"] for e in ranks] == list(range(tp * dp))
    # DP splits the sequences round robin; TP ranks of a group hold the same ones
    assert sorted(s for e in ranks if e["tp_rank"] == 0 for s in e["seq_ids"]) == [0, 1, 2]
    for e in ranks:
        assert e["seq_ids"] == ranks[e["dp_rank"] * tp]["seq_ids"] == list(range(e["dp_rank"], 3, dp))
    plan = [sim.make_plan(sim.SimOptions(**{**doc["options"], "json_path": None}), d) for d in range(dp)]
    for e in ranks:
        pr = e["pool"]
        assert e["passed"] and all(e["checks"].values()), e["checks"]
        # every rank ran the same padded count per step: the largest of any DP group's batch
        assert pr["padded_tokens"] == pr["padded_tokens_expected"] == list(plan[0].padded_tokens)
        assert pr["padded_tokens"] == [
            max(p.schedule[i].num_tokens if i < len(p.schedule) else 0 for p in plan)
            for i in range(len(pr["padded_tokens"]))
        ]
        assert pr["tokens"] == pr["tokens_scheduled"] == plan[e["dp_rank"]].total_tokens
        assert pr["padded_rows"] == sum(pr["padded_tokens"]) - pr["tokens"]
        # the pool, reserved before the KV cache was sized, handed out views of itself only
        assert pr["reserved_bytes"] == pr["reserved_bytes_after"] == 2 * 64 * padded_heads * 512 * 2
        assert pr["pool_views"] == {"calls": 2 * len(pr["padded_tokens"]), "outside_reservation": 0}
        assert pr["allocations_after_lock"] is None  # no CUDA allocator to count here
        # every (token, layer) is a needle: all bit-exact, and equal to the one-process full-head run
        assert pr["needles"] == 2 * pr["tokens"] == pr["recall"] == pr["q_exact"]
        assert pr["full_head"] == {
            "needles": pr["needles"],
            "q_equal": pr["needles"],
            "records_equal": pr["needles"],
        }
        assert pr["needle_pads_zero"] == pr["needles"] and pr["pool_pads_zero"]
        assert pr["blocks_outside_tables_zero"]
        # the KV cache is sized alike on every rank (the fewest blocks any rank measured)
        assert (
            pr["kv"]["num_blocks"]
            == ranks[0]["pool"]["kv"]["num_blocks"]
            >= pr["block_tables"]["blocks_needed"]
        )
        assert e["allocating"] is None  # needs a CUDA memory cap
        if tp > 1:
            tc = pr["tp_cache"]
            assert tc["tables_equal"] and tc["mismatched_bytes"] == 0
            assert tc["blocks_compared"] == 2 * pr["block_tables"]["blocks_used"] > 0
        else:
            assert "tp_cache" not in pr
    if dp > 1:  # the DP group with fewer tokens ran pad rows
        assert any(e["pool"]["padded_rows"] > 0 for e in ranks)
    assert doc["passed"]


@pytest.mark.parametrize("tp,dp,padded", [(2, 1, 8), (2, 2, 8)])
def test_spawned_ranks_pass_every_check(tmp_path, tp, dp, padded):
    out = tmp_path / "ranks.json"
    proc = run_cli(*SMALL, "--tp", str(tp), "--dp", str(dp), "--padded-heads", str(padded), "--spawn",
                   "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["topology"]["launcher"] == "spawn"
    check_ranks(doc, tp, dp, padded)
    assert doc["provenance"]["command"].split()[-5:] == [
        "--padded-heads",
        str(padded),
        "--spawn",
        "--json",
        str(out),
    ]
    assert "verdict  PASS" in proc.stdout and proc.stdout.count("[pool] step 1/") == 1  # rank 0 talks


def test_torchrun_ranks_unpadded(tmp_path):
    """torchrun (--standalone: it picks a free port) starts the ranks; P == H: no pad heads."""
    out = tmp_path / "torchrun.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
         "attn_prologue", "simulate", *SMALL, "--tp", "1", "--dp", "2", "--padded-heads", "8", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["topology"]["launcher"] == "torchrun"
    check_ranks(doc, 1, 2, 8)


def test_ranks_that_see_different_tokens_fail(tmp_path):
    """Two processes started through a launcher's variables (as torchrun sets them), each told a
    different seed: the TP ranks then hold different sequences, which the checks must catch."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        args = [
            *SMALL,
            "--needles",
            "16",
            "--tp",
            "2",
            "--seed",
            str(rank),
            "--json",
            str(tmp_path / f"r{rank}.json"),
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "attn_prologue", "simulate", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs  # ran to the end, and failed
    doc = json.loads((tmp_path / "r0.json").read_text())
    for e in doc["ranks"]:
        assert not e["passed"]
        assert e["pool"]["tp_cache"]["tables_equal"] is False
        assert not e["checks"]["tp_cache_equal"]
    assert "verdict  FAIL" in outs[0]


@pytest.mark.parametrize(
    "args,says",
    [
        (["--tp", "3", "--spawn"], "query_heads=8 is not divisible by tp=3: TP shards whole heads"),
        (["--tp", "2"], "--tp 2 --dp 1 needs 2 processes: add --spawn"),
        (["--tp", "2", "--heads", "4", "--spawn"], "--heads is the one simulated rank's head count"),
        (["--tp", "2", "--padded-heads", "2", "--spawn"], "padded_heads=2 < heads=4"),
        (["--tp", "1", "--memory-budget-gb", "1"], "cannot be enforced on the CPU"),
        (["--tp", "1", "--backend", "nccl", "--spawn"], "the nccl backend needs CUDA tensors"),
    ],
)
def test_bad_options_are_typed_errors_before_any_rank_starts(capsys, args, says):
    assert cli_main(["simulate", *SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn_prologue simulate: ") and says in err and err.count("\n") == 1, err


def test_options_from_python_are_checked_as_the_command_line_checks_them():
    """The parser refuses `--dp 0` itself (tests/test_cli.py); SimOptions built in Python meet the same rule."""
    with pytest.raises(InputError, match="dp must be positive, got 0"):
        sim.check_options(sim.SimOptions(dp=0, device="cpu"))
    with pytest.raises(SystemExit):
        cli_main(["simulate", *SMALL, "--dp", "0", "--spawn"])


def test_launcher_variables_must_match_tp_x_dp(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli_main(["simulate", *SMALL, "--tp", "2"]) == 2
    assert "the launcher started 3 processes, but --tp 2 x --dp 1 = 2" in capsys.readouterr().err
    assert cli_main(["simulate", *SMALL, "--tp", "2", "--spawn"]) == 2
    assert "--spawn starts the ranks itself: it cannot run under torchrun" in capsys.readouterr().err


def test_a_rank_s_typed_error_names_the_rank():
    """Every rank refuses a schedule whose decode step (2 sequences in DP group 0) does not fit the
    token budget: the spawning process reports it as one line naming the rank, no traceback."""
    proc = run_cli(*SMALL, "--tp", "1", "--dp", "2", "--spawn", "--max-num-batched-tokens", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr.split("attn_prologue simulate:")[-1]
    assert "attn_prologue simulate: rank 0: SimulationError: " in proc.stderr


def test_world_of_one_in_process(tmp_path):
    """--tp 1 --dp 1 without a launcher: the same program and checks, no process group."""
    out = tmp_path / "one.json"
    assert (
        cli_main(["simulate", *SMALL, "--tp", "1", "--dp", "1", "--padded-heads", "16", "--json", str(out)])
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["topology"]["launcher"] == "in-process" and doc["topology"]["backend"] is None
    check_ranks(doc, 1, 1, 16, backend=None)


def test_one_rank_alone_on_the_cpu(tmp_path, capsys):
    """The one-rank program (no --tp/--dp) runs on the CPU reference too, with the one-rank report."""
    out = tmp_path / "alone.json"
    assert (
        cli_main(
            ["simulate", *SMALL[:2], *SMALL[4:], "--heads", "4", "--padded-heads", "8", "--json", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["passed"] and "ranks" not in doc and doc["pool"]["recall"] == doc["pool"]["needles"] > 0
    assert doc["allocating"] is None and "skipped (needs a CUDA device" in capsys.readouterr().out


def test_dp_plan_splits_sequences_and_pads_every_step_to_the_largest():
    opts = sim.SimOptions(seqs=5, prompt_len=300, max_num_batched_tokens=256, decode_steps=3, layers=2, dp=2,
                          tp=2, query_heads=8, heads=4, needles=20)  # fmt: skip
    everyone = sim.prompt_lengths(5, 300, opts.prompt_jitter, opts.seed)
    plans = [sim.make_plan(opts, d) for d in range(2)]
    assert (
        [list(p.seq_ids) for p in plans]
        == [[0, 2, 4], [1, 3]]
        == [sim.dp_sequences(5, 2, d) for d in range(2)]
    )
    for p in plans:
        assert p.prompt_lens == [everyone[s] for s in p.seq_ids]
        assert p.max_pos == max(everyone) + 3  # one cos/sin table on every rank
        assert all(nd.seq < len(p.prompt_lens) for nd in p.needles)
        assert p.padded_tokens == plans[0].padded_tokens
    longest = max(len(p.schedule) for p in plans)
    assert len(plans[0].padded_tokens) == longest
    for i, n in enumerate(plans[0].padded_tokens):
        real = [p.schedule[i].num_tokens if i < len(p.schedule) else 0 for p in plans]
        assert n == max(real) and n <= 256
    assert any(
        len(set(p.schedule[i].num_tokens for p in plans)) > 1
        for i in range(min(map(len, (p.schedule for p in plans))))
    )
    # one DP group: the padded counts are its own
    alone = sim.make_plan(sim.SimOptions(seqs=5, prompt_len=300, max_num_batched_tokens=256, decode_steps=3))
    assert alone.padded_tokens == tuple(s.num_tokens for s in alone.schedule)


def test_pool_views_are_inside_the_reservation():
    pool = ScratchPool()
    pool.reserve(max_tokens=16, padded_heads=8, head_dim=512, micro_batches=2, device="cpu")
    pool.lock()
    buf = pool.buffer(padded_heads=8, head_dim=512, device="cpu")
    assert sim.in_reservation(pool.view(5, padded_heads=8, head_dim=512, device="cpu"), buf)
    other = pool.buffer(padded_heads=8, head_dim=512, micro_batch=1, device="cpu")
    assert not sim.in_reservation(other[:5], buf)  # another buffer of the pool
    assert not sim.in_reservation(buf.clone()[:5], buf)  # a fresh allocation of the same shape
    assert not sim.in_reservation(torch.empty(17, 8, 512, dtype=torch.bfloat16), buf)


def test_launchers_keep_multicast_off_without_overriding():
    env = {"NCCL_NVLS_ENABLE": "1"}
    sim.keep_multicast_off(env)
    assert env == {
        "NCCL_NVLS_ENABLE": "1",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert sim.torchrun_env({"RANK": "3", "WORLD_SIZE": "4"}) == dict(
        rank=3, world=4, local_rank=3, local_world=4
    )
    assert sim.torchrun_env({"LOCAL_RANK": "0"}) is None


def _collectives(rank: int, port: int, results) -> None:
    """One rank of a TP 2 x DP 2 world: what each collective of ranks.Ranks returns."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60)
    )
    try:
        peers = Ranks(tp=2, dp=2, timeout_s=60)
        t = torch.arange(6, dtype=torch.int64) * 10 + rank
        t[0] = 7  # the same on every rank; elements 1..5 differ by rank
        results.put(
            dict(
                rank=rank,
                ids=(peers.tp_rank, peers.dp_rank, list(peers.tp_ranks)),
                step=peers.agree_step([5, 9, 0, 3][rank], failed=rank == 2),
                step_ok=peers.agree_step(rank, failed=False),
                min=peers.min(10 - rank),
                max=peers.max(10 - rank),
                gathered=[x.tolist() for x in peers.tp_gather(t)],
                mismatches=peers.tp_mismatches(t),
                same=peers.tp_mismatches(t[:1]),
                objects=peers.gather({"r": rank}),
            )
        )
    finally:
        dist.destroy_process_group()


def test_rank_collectives_on_gloo():
    """The collectives the checks rely on, in 4 real gloo processes: agreement is a MAX (and any
    rank's failure), sizing a MIN, and the TP-group byte comparison counts what differs."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    mp.start_processes(_collectives, args=(store.port, results), nprocs=4, join=True, start_method="spawn")
    got = sorted((results.get() for _ in range(4)), key=lambda r: r["rank"])
    for r in got:
        rank = r["rank"]
        assert r["ids"] == (rank % 2, rank // 2, [rank // 2 * 2, rank // 2 * 2 + 1])
        assert r["step"] == (9, True) and r["step_ok"] == (3, False)
        assert (r["min"], r["max"]) == (7, 10)
        group = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["gathered"] == [[7] + [10 * i + g for i in range(1, 6)] for g in group]
        assert r["mismatches"] == (0 if rank % 2 == 0 else 5) and r["same"] == 0
        assert r["objects"] == [{"r": i} for i in range(4)]
