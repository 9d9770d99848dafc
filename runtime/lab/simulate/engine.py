"""The engine model of `simulate`, pure Python and CPU tensors (tested without a GPU): the options,
prompt lengths, the chunked-prefill scheduler, the paged-cache block allocator and its slot
mappings, the needles (cache entries checked after the schedule) and the memory arithmetic."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

import torch

from ...errors import AttnPrologueError, InputError

CACHE_FORMAT = "fp8_ds_mla"
HEAD_DIM = 512
ROPE_DIM = 64


class SimulationError(AttnPrologueError, RuntimeError):
    """The simulated engine cannot run the requested schedule (for example: the KV cache is too small)."""


@dataclass
class SimOptions:
    max_num_batched_tokens: int = 32768
    padded_heads: int = 64
    heads: int = 16
    layers: int = 43
    block_size: int = 64
    micro_batches: int = 2
    kv_fraction: float = 0.90
    memory_budget_bytes: int | None = None  # cap on what the simulation may use (None: the whole GPU)
    seqs: int = 8
    prompt_len: int = 30000
    prompt_jitter: float = 0.05  # prompt lengths are uniform in prompt_len * [1 - jitter, 1 + jitter]
    decode_steps: int = 32
    needles: int = 64
    allocating: bool = True
    seed: int = 0
    eps: float = 1e-6
    json_path: str | None = None
    progress: bool = True
    device: str | None = None  # default: the current CUDA device; "cpu": the PyTorch reference path
    # across ranks (ranks.py): TP shards query_heads over tp ranks (heads = query_heads / tp), DP
    # splits the sequences over dp groups. query_heads None: one rank simulated alone (heads as given)
    tp: int = 1
    dp: int = 1
    query_heads: int | None = None
    backend: str | None = None  # torch.distributed backend (None: nccl with a GPU per rank, else gloo)
    timeout_s: float = 600.0  # how long a collective waits for the other ranks

    @property
    def head_dim(self) -> int:
        return HEAD_DIM

    @property
    def rope_dim(self) -> int:
        return ROPE_DIM


def on_cpu(opts: SimOptions) -> bool:
    """Whether the run is the CPU reference path (device "cpu") rather than the kernels."""
    return opts.device is not None and torch.device(opts.device).type == "cpu"


def check_options(opts: SimOptions) -> None:
    """Refuse options no rank can run (InputError), before any process or memory is taken."""
    for name in ("tp", "dp", "heads", "padded_heads", "layers", "seqs", "micro_batches"):
        if getattr(opts, name) <= 0:
            raise InputError(f"{name} must be positive, got {getattr(opts, name)}")
    if opts.query_heads is not None:
        if opts.query_heads % opts.tp:
            raise InputError(
                f"query_heads={opts.query_heads} is not divisible by tp={opts.tp}: TP shards whole heads"
            )
        if opts.heads * opts.tp != opts.query_heads:
            raise InputError(f"heads={opts.heads} per rank x tp={opts.tp} != query_heads={opts.query_heads}")
    elif opts.tp * opts.dp > 1:
        raise InputError("tp x dp > 1 needs query_heads (the model's query heads, sharded over TP)")
    if opts.padded_heads < opts.heads:
        raise InputError(f"padded_heads={opts.padded_heads} < heads={opts.heads} (live heads per rank)")
    if not 0 < opts.kv_fraction < 1:
        raise InputError(f"kv_fraction must be in (0, 1), got {opts.kv_fraction}")
    if opts.backend not in (None, "gloo", "nccl"):
        raise InputError(f"backend must be gloo or nccl, got {opts.backend!r}")
    cpu = on_cpu(opts)
    if cpu and opts.backend == "nccl":
        raise InputError("the nccl backend needs CUDA tensors: use gloo with device cpu")
    if cpu and opts.memory_budget_bytes is not None:
        raise InputError("a memory budget caps the CUDA caching allocator: it cannot be enforced on the CPU")


def dp_sequences(seqs: int, dp: int, dp_rank: int) -> list[int]:
    """The sequences DP group `dp_rank` serves: round robin, as a load balancer hands out requests."""
    return list(range(dp_rank, seqs, dp))


def prompt_lengths(seqs: int, prompt_len: int, jitter: float = 0.05, seed: int = 0) -> list[int]:
    """Prompt lengths of `seqs` sequences, about prompt_len each (deterministic for a seed)."""
    rng = random.Random(f"prompts-{seed}")
    lo = max(1, int(round(prompt_len * (1 - jitter))))
    hi = max(lo, int(round(prompt_len * (1 + jitter))))
    return [rng.randint(lo, hi) for _ in range(seqs)]


@dataclass(frozen=True)
class Chunk:
    """`length` tokens of sequence `seq` at positions [start, start + length)."""

    seq: int
    start: int
    length: int


@dataclass(frozen=True)
class Step:
    kind: str  # "prefill" or "decode"
    chunks: tuple

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


def build_schedule(prompt_lens: list[int], max_num_batched_tokens: int, decode_steps: int) -> list[Step]:
    """Chunked prefill, first come first served: each step takes up to max_num_batched_tokens prompt
    tokens, finishing one sequence's prompt and continuing with the next one's in the same step (a
    step mixes chunks of several sequences). Then `decode_steps` steps of one token per sequence."""
    if max_num_batched_tokens <= 0:
        raise SimulationError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
    if decode_steps > 0 and len(prompt_lens) > max_num_batched_tokens:
        raise SimulationError(
            f"{len(prompt_lens)} sequences do not fit one decode step of {max_num_batched_tokens} tokens"
        )
    done = [0] * len(prompt_lens)
    steps = []
    while any(d < p for d, p in zip(done, prompt_lens)):
        budget = max_num_batched_tokens
        chunks = []
        for s, p in enumerate(prompt_lens):
            if budget == 0:
                break
            if done[s] < p:
                take = min(p - done[s], budget)
                chunks.append(Chunk(s, done[s], take))
                done[s] += take
                budget -= take
        steps.append(Step("prefill", tuple(chunks)))
    for k in range(decode_steps):
        steps.append(Step("decode", tuple(Chunk(s, p + k, 1) for s, p in enumerate(prompt_lens))))
    return steps


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Paged-cache block tables: blocks come from a free list as sequences grow; slot = block * bs + offset.

    With a seed the free list is shuffled, so a sequence's blocks are scattered over the cache (as
    in an engine that has been serving for a while)."""

    def __init__(self, num_blocks: int, block_size: int, seed: int | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks))
        if seed is not None:
            random.Random(f"blocks-{seed}").shuffle(self._free)
        self._free.reverse()  # pop() from the end hands out the list's first entries first
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ensure(self, seq: int, num_tokens: int) -> None:
        """Make sequence `seq` hold at least num_tokens tokens."""
        table = self.tables.setdefault(seq, [])
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need > len(self._free):
            raise SimulationError(
                f"out of KV-cache blocks: sequence {seq} needs {need} more, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        for _ in range(max(0, need)):
            table.append(self._free.pop())

    def table(self, seq: int) -> list[int]:
        return self.tables.get(seq, [])

    def slot(self, seq: int, pos: int) -> int:
        table = self.tables.get(seq, [])
        b = pos // self.block_size
        if pos < 0 or b >= len(table):
            raise SimulationError(
                f"position {pos} of sequence {seq} has no block (table holds {len(table)} blocks)"
            )
        return table[b] * self.block_size + pos % self.block_size

    def free(self, seq: int) -> None:
        self._free.extend(reversed(self.tables.pop(seq, [])))


def step_slots_positions(step: Step, alloc: BlockAllocator) -> tuple[torch.Tensor, torch.Tensor]:
    """Grow the block tables for a step and return its slot mapping and positions (CPU int64 [N])."""
    bs = alloc.block_size
    slots, positions = [], []
    for c in step.chunks:
        alloc.ensure(c.seq, c.start + c.length)
        pos = torch.arange(c.start, c.start + c.length, dtype=torch.int64)
        table = torch.tensor(alloc.table(c.seq), dtype=torch.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        positions.append(pos)
    if not slots:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty.clone()
    return torch.cat(slots), torch.cat(positions)


@dataclass(frozen=True, order=True)
class Needle:
    seq: int
    pos: int
    layer: int


def select_needles(
    prompt_lens: list[int], decode_steps: int, layers: int, k: int, seed: int = 0, decode_share: float = 0.125
) -> list[Needle]:
    """k distinct (sequence, position, layer) triples drawn uniformly over the whole schedule, picked
    before it runs. A `decode_share` of them (at least one when there are decode steps) comes from
    decode tokens, which uniform sampling would almost never hit."""
    rng = random.Random(f"needles-{seed}")
    seqs = len(prompt_lens)
    n_prefill = sum(prompt_lens) * layers
    n_decode = seqs * decode_steps * layers
    k = max(0, min(k, n_prefill + n_decode))
    k_dec = 0
    if n_decode and k:
        k_dec = min(n_decode, max(1, int(round(k * decode_share))))
    k_pre = min(k - k_dec, n_prefill)
    k_dec = min(n_decode, k - k_pre)
    starts = [0]
    for p in prompt_lens:
        starts.append(starts[-1] + p)
    out = []
    for idx in rng.sample(range(n_prefill), k_pre) if k_pre else []:
        token, layer = divmod(idx, layers)
        s = bisect.bisect_right(starts, token) - 1
        out.append(Needle(s, token - starts[s], layer))
    for idx in rng.sample(range(n_decode), k_dec) if k_dec else []:
        token, layer = divmod(idx, layers)
        s, j = divmod(token, decode_steps)
        out.append(Needle(s, prompt_lens[s] + j, layer))
    return sorted(out)


def locate_needles(
    schedule: list[Step], needles: list[Needle]
) -> dict[int, dict[int, list[tuple[int, int]]]]:
    """{step index: {layer: [(needle index, row in the step's token batch)]}}."""
    where = {}
    for i, nd in enumerate(needles):
        found = False
        for si, step in enumerate(schedule):
            row0 = 0
            for c in step.chunks:
                if c.seq == nd.seq and c.start <= nd.pos < c.start + c.length:
                    where.setdefault(si, {}).setdefault(nd.layer, []).append((i, row0 + nd.pos - c.start))
                    found = True
                    break
                row0 += c.length
            if found:
                break
        if not found:
            raise SimulationError(f"needle {nd} is not in the schedule")
    return where


def max_position(prompt_lens: list[int], decode_steps: int) -> int:
    """Rows of the cos/sin cache: one per position of the longest sequence."""
    return max(prompt_lens) + decode_steps


def padded_q_bytes(opts: SimOptions, n_tokens: int | None = None) -> int:
    """Bytes of one [N, P, D] bf16 Q tensor (N = max_num_batched_tokens by default)."""
    n = opts.max_num_batched_tokens if n_tokens is None else n_tokens
    return n * opts.padded_heads * opts.head_dim * 2


def pool_bytes(opts: SimOptions) -> int:
    return opts.micro_batches * padded_q_bytes(opts)


def input_arena_bytes(opts: SimOptions) -> int:
    """Bytes of the model buffers the simulation allocates besides the pool and the KV cache: the
    q/kv input arena, slot and position ids, the cos/sin cache and the needle copies."""
    t, h, p, d = opts.max_num_batched_tokens, opts.heads, opts.padded_heads, opts.head_dim
    max_pos = max_position(
        prompt_lengths(opts.seqs, opts.prompt_len, opts.prompt_jitter, opts.seed), opts.decode_steps
    )
    k = opts.needles
    return (
        t * h * d * 2
        + t * d * 2
        + 2 * t * 8
        + max_pos * opts.rope_dim * 4
        + k * (h * d * 2 + d * 2 + p * d * 2)
    )


def allocating_failure_budget(opts: SimOptions, margin: float = 0.5) -> int:
    """A memory budget under which the allocating op cannot get its padded Q tensor: the KV cache,
    sized at kv_fraction of what is left after the input buffers, leaves a headroom of at most
    margin * padded_q_bytes (+ allocator rounding), less than one [max_tokens, P, D] tensor. The
    pool mode, which reserved the pool first, still fits under the same budget if the schedule's KV
    cache does (run() checks that)."""
    if not 0 < margin < 1:
        raise ValueError("margin must be in (0, 1)")
    return int(input_arena_bytes(opts) + margin * padded_q_bytes(opts) / (1.0 - opts.kv_fraction))


@dataclass(frozen=True)
class Plan:
    """What a run plays, fixed before it starts: one DP group's sequences (all of them with dp=1;
    sequence numbers in the schedule and the needles index prompt_lens, seq_ids maps them back)."""

    prompt_lens: list[int]
    schedule: list[Step]
    needles: list[Needle]
    where: dict[int, dict[int, list[tuple[int, int]]]]  # locate_needles(schedule, needles)
    max_pos: int  # over every group's sequences: all ranks hold the same cos/sin table
    needed_blocks: int  # KV-cache blocks the schedule's sequences need at their longest
    seq_ids: tuple[int, ...] = ()  # the global sequence of each prompt
    # tokens per step once every DP group's batch is padded to the largest (what the ranks' all_reduce
    # MAX must agree on; the run checks it did); steps past this group's schedule have no real tokens
    padded_tokens: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.schedule)


def make_plan(opts: SimOptions, dp_rank: int = 0) -> Plan:
    everyone = prompt_lengths(opts.seqs, opts.prompt_len, opts.prompt_jitter, opts.seed)
    groups = [dp_sequences(opts.seqs, opts.dp, d) for d in range(opts.dp)]
    schedules = [
        build_schedule([everyone[s] for s in g], opts.max_num_batched_tokens, opts.decode_steps)
        for g in groups
    ]
    ids = groups[dp_rank]
    prompts, schedule = [everyone[s] for s in ids], schedules[dp_rank]
    needles = select_needles(prompts, opts.decode_steps, opts.layers, opts.needles, opts.seed)
    steps = max(len(sc) for sc in schedules)
    padded = tuple(max(sc[i].num_tokens if i < len(sc) else 0 for sc in schedules) for i in range(steps))
    return Plan(
        prompt_lens=prompts,
        schedule=schedule,
        needles=needles,
        where=locate_needles(schedule, needles),
        max_pos=max_position(everyone, opts.decode_steps),
        needed_blocks=sum(blocks_for(p + opts.decode_steps, opts.block_size) for p in prompts),
        seq_ids=tuple(ids),
        padded_tokens=padded,
    )
