"""`simulate`: play a serving engine on one GPU and check the op under load (docs/simulate.md).

1. Profile: reserve the padded-Q scratch pool for max_num_batched_tokens (two micro-batches).
2. Size a paged fp8_ds_mla KV cache for every layer that fills `kv_fraction` of the memory still
   free after the pool and the input activations (one tensor, split into per-layer views).
3. Run a schedule: chunked prefills of several long prompts (a step mixes chunks of several
   sequences), then decode steps; every layer's bound op runs with real slot mappings from a block
   table; micro-batches alternate between steps.
4. Check: no allocation after the pool is locked, no OOM, needle recall (sampled cache entries
   decoded after the schedule, compared bit for bit with the reference), q_out and pad heads.
5. The same schedule with the old allocating op (a fresh [N, P, D] Q tensor per layer call) under
   the same memory budget, the KV cache sized without the pool: it runs out of memory, or the
   extra memory it needed is measured.

Across ranks (`--tp N --dp N`, distributed.py): every rank does 1-5 for its DP group's sequences
and its TP shard of the query heads, with every step padded to the largest token count of any rank
(an all_reduce MAX, as engines do for DP attention) and the KV cache sized alike on every rank
(all_reduce MIN); then it checks its cache bytes against the other ranks of its TP group and its
needles against a one-process run with every query head. On the CPU (device "cpu", gloo) the same
program runs the PyTorch reference instead of the kernels, without the allocating mode.

engine.py is the engine model (options, prompt lengths, scheduler, block allocator, slot mappings,
needles, memory arithmetic): it needs no GPU and is tested on the CPU. harness.py, layers.py and
passes.py run it, checks.py checks what the pool pass wrote, ranks.py holds what ranks agree on,
report.py writes the result document and the table;
`run(SimOptions(...))` does it all for one process, distributed.py starts and joins the ranks.
"""

from __future__ import annotations

from .distributed import (
    NO_MULTICAST,
    keep_multicast_off,
    run_in_process,
    run_spawned,
    run_torchrun,
    torchrun_env,
)
from .engine import (
    BlockAllocator,
    Chunk,
    Needle,
    Plan,
    SimOptions,
    SimulationError,
    Step,
    allocating_failure_budget,
    blocks_for,
    build_schedule,
    check_options,
    dp_sequences,
    input_arena_bytes,
    locate_needles,
    make_plan,
    max_position,
    padded_q_bytes,
    pool_bytes,
    prompt_lengths,
    select_needles,
    step_slots_positions,
)
from .harness import MEM_KEYS, in_reservation
from .ranks import Ranks, Solo
from .report import ranks_summary, summary
from .runner import run

__all__ = [
    "MEM_KEYS",
    "NO_MULTICAST",
    "Ranks",
    "Solo",
    "BlockAllocator",
    "Chunk",
    "Needle",
    "Plan",
    "SimOptions",
    "SimulationError",
    "Step",
    "allocating_failure_budget",
    "blocks_for",
    "build_schedule",
    "check_options",
    "dp_sequences",
    "in_reservation",
    "keep_multicast_off",
    "input_arena_bytes",
    "locate_needles",
    "max_position",
    "padded_q_bytes",
    "make_plan",
    "pool_bytes",
    "prompt_lengths",
    "ranks_summary",
    "run",
    "run_in_process",
    "run_spawned",
    "run_torchrun",
    "select_needles",
    "step_slots_positions",
    "summary",
    "torchrun_env",
]
