"""`simulate`: play a serving engine on one GPU and check the op under load (spec/op.md sections 5-6).

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

The pure parts (prompt lengths, scheduler, block allocator, slot mappings, needle selection) need no
GPU and are tested on the CPU; `run(SimOptions(...))` does the rest on the current CUDA device.
"""

from __future__ import annotations

import bisect
import datetime
import gc
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import AttnPrologueError
from ..formats import get_format

CACHE_FORMAT = "fp8_ds_mla"
HEAD_DIM = 512
ROPE_DIM = 64
MEM_KEYS = ("allocation.all.allocated", "segment.all.allocated", "num_alloc_retries", "num_ooms")


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
    command: str | None = None
    progress: bool = True
    device: str | None = None  # default: the current CUDA device

    @property
    def head_dim(self) -> int:
        return HEAD_DIM

    @property
    def rope_dim(self) -> int:
        return ROPE_DIM


# =====================================================================================================
# Pure parts (no GPU)
# =====================================================================================================
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


# =====================================================================================================
# GPU parts
# =====================================================================================================
def _mem_stats(device) -> dict:
    s = torch.cuda.memory_stats(device)
    return {k: int(s.get(k, 0)) for k in MEM_KEYS}


def _gib(b) -> str:
    return f"{b / 2**30:.2f} GiB"


def _fmt_time(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    return f"{int(s // 60)}m{s % 60:04.1f}s"


class _Budget:
    """The memory budget: a cap on the caching allocator (set_per_process_memory_fraction), so a
    request beyond it is a real torch.cuda.OutOfMemoryError, and free memory as an engine sees it."""

    def __init__(self, budget_bytes: int | None, device):
        self.device = device
        self.limit = None
        if budget_bytes is not None:
            gc.collect()
            torch.cuda.empty_cache()
            total = torch.cuda.mem_get_info(device)[1]
            self.limit = torch.cuda.memory_reserved(device) + int(budget_bytes)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit / total), device)

    def restore(self) -> None:
        if self.limit is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def free_for_kv(self) -> int:
        """torch.cuda.mem_get_info's free memory (after returning cached blocks), capped by the budget."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        if self.limit is not None:
            free = min(free, self.limit - torch.cuda.memory_reserved(self.device))
        return max(0, int(free))

    def headroom(self) -> int:
        """What one more allocation could get now (free device memory plus cached blocks, capped)."""
        alloc = torch.cuda.memory_allocated(self.device)
        h = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) - alloc
        if self.limit is not None:
            h = min(h, self.limit - alloc)
        return max(0, int(h))


class _Arena:
    """Fixed-size model buffers allocated before the pool is locked; steps use views of them."""

    def __init__(self, opts: SimOptions, max_pos: int, device):
        t, h, p, d, r = (
            opts.max_num_batched_tokens,
            opts.heads,
            opts.padded_heads,
            opts.head_dim,
            opts.rope_dim,
        )
        bf16 = torch.bfloat16
        self.q = torch.empty((t, h, d), dtype=bf16, device=device)
        self.kv = torch.empty((t, d), dtype=bf16, device=device)
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros((t,), dtype=torch.int64, device=device)
        # real RoPE angles (theta 10000), float32 [max_pos, R]: R/2 cos columns then R/2 sin columns
        inv_freq = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64, device=device) / r)
        ang = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat((ang.cos(), ang.sin()), dim=1).to(torch.float32).contiguous()
        del inv_freq, ang
        k = max(1, opts.needles)
        self.needle_q = torch.zeros((k, h, d), dtype=bf16, device=device)
        self.needle_kv = torch.zeros((k, d), dtype=bf16, device=device)
        self.needle_qout = torch.full((k, p, d), float("nan"), dtype=bf16, device=device)


class _Progress:
    def __init__(self, label: str, steps: int, tokens: int, enabled: bool):
        self.label, self.steps, self.tokens, self.enabled = label, steps, tokens, enabled
        self.t0 = time.perf_counter()
        self.last = -1.0

    def update(self, k: int, tokens_done: int, step: Step) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        el = now - self.t0
        if k != self.steps and k != 1 and now - self.last < 1.0 and self.steps > 60:
            return
        self.last = now
        eta = el * (self.tokens - tokens_done) / max(1, tokens_done)
        print(
            f"[{self.label}] step {k}/{self.steps} {step.kind:7s} N={step.num_tokens:6d}  tokens {tokens_done}/{self.tokens}"
            f"  elapsed {_fmt_time(el)}  ETA {_fmt_time(eta)}",
            flush=True,
        )


def _size_kv(opts: SimOptions, budget: _Budget, needed_blocks: int, label: str) -> dict:
    fmt = get_format(CACHE_FORMAT)
    block_bytes = fmt.block_bytes(opts.head_dim, opts.block_size)
    free = budget.free_for_kv()
    num_blocks = int(opts.kv_fraction * free) // (opts.layers * block_bytes)
    info = dict(
        free_bytes=free,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        kv_bytes=num_blocks * block_bytes * opts.layers,
        capacity_tokens=num_blocks * opts.block_size,
    )
    if opts.progress:
        print(
            f"[{label}] KV cache: {opts.kv_fraction:.2f} x {_gib(free)} free -> {num_blocks} blocks x "
            f"{opts.block_size} = {info['capacity_tokens']} tokens per layer, {opts.layers} layers, "
            f"{_gib(info['kv_bytes'])} ({needed_blocks} blocks needed by the schedule)",
            flush=True,
        )
    if num_blocks < needed_blocks:
        raise SimulationError(
            f"[{label}] the KV cache holds {num_blocks} blocks but the schedule needs {needed_blocks}: "
            f"lower --seqs/--prompt-len or raise --memory-budget-gb/--kv-fraction"
        )
    return info


def _fill_inputs(q, kv, gen) -> None:
    q.normal_(generator=gen)
    kv.normal_(generator=gen)


def _pool_pass(
    opts: SimOptions, schedule, needles, where, prompt_lens, max_pos, needed_blocks, device
) -> dict:
    import attn_prologue as ap

    budget = _Budget(opts.memory_budget_bytes, device)
    pool = ap.ScratchPool()
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _pool_pass_body(
            opts, schedule, needles, where, prompt_lens, max_pos, needed_blocks, device, budget, pool
        )
    finally:
        pool.release()
        gc.collect()
        torch.cuda.empty_cache()
        budget.restore()


def _pool_pass_body(
    opts, schedule, needles, where, prompt_lens, max_pos, needed_blocks, device, budget, pool
) -> dict:
    import attn_prologue as ap

    from .. import codecs, reference

    fmt = get_format(CACHE_FORMAT)
    h, p, d, bs, L = opts.heads, opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = {}
    # 1. profile: reserve the scratch pool, then the model's other buffers
    reserved = pool.reserve(
        max_tokens=opts.max_num_batched_tokens,
        padded_heads=p,
        head_dim=d,
        dtype=torch.bfloat16,
        micro_batches=opts.micro_batches,
        device=device,
    )
    res["reserved_bytes"] = int(pool.reserved_bytes)
    if opts.progress:
        print(
            f"[pool] scratch pool: reserved {reserved} bytes ({_gib(reserved)}) = {opts.micro_batches} micro-batches x "
            f"{opts.max_num_batched_tokens} tokens x P={p} x D={d} x 2",
            flush=True,
        )
    arena = _Arena(opts, max_pos, device)
    pool.lock()
    bound = [
        ap.bind(
            num_heads=h,
            padded_heads=p,
            head_dim=d,
            rope_dim=opts.rope_dim,
            cache_format=CACHE_FORMAT,
            dtype=torch.bfloat16,
            block_size=bs,
            pool=pool,
            micro_batches=opts.micro_batches,
            eps=opts.eps,
            device=device,
        )
        for _ in range(L)
    ]
    # warm-up on a one-block dummy cache (every row skipped): loads every token-count bucket the schedule uses
    gen = torch.Generator(device=device)
    gen.manual_seed(opts.seed)
    _fill_inputs(arena.q, arena.kv, gen)
    dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
    for n in sorted({s.num_tokens for s in schedule}):
        for mb in range(opts.micro_batches):
            bound[0](
                arena.q[:n],
                arena.kv[:n],
                dummy,
                arena.slots[:n],
                arena.positions[:n],
                arena.cos_sin,
                micro_batch=mb,
            )
    torch.cuda.synchronize(device)
    del dummy
    # 2. size the KV cache in what is left
    kv_info = _size_kv(opts, budget, needed_blocks, "pool")
    res["kv"] = kv_info
    nb = kv_info["num_blocks"]
    kv_all = torch.empty((L, nb, kv_info["block_bytes"]), dtype=torch.uint8, device=device)
    caches = [kv_all[layer] for layer in range(L)]
    for layer, b in enumerate(bound):  # bind each layer to its cache (the full check runs once, here)
        for mb in range(opts.micro_batches):
            b(
                arena.q[:1],
                arena.kv[:1],
                caches[layer],
                arena.slots[:1],
                arena.positions[:1],
                arena.cos_sin,
                micro_batch=mb,
            )
    torch.cuda.synchronize(device)
    gen.manual_seed(opts.seed)
    alloc = BlockAllocator(nb, bs, seed=opts.seed)
    total_tokens = sum(s.num_tokens for s in schedule)

    # 3. the schedule: nothing may allocate from here on
    stats0 = _mem_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    planned = torch.cuda.memory_allocated(device)
    prog = _Progress("pool", len(schedule), total_tokens, opts.progress)
    oom = None
    done = 0
    t0 = time.perf_counter()
    si = layer = 0
    try:
        for si, step in enumerate(schedule):
            n = step.num_tokens
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            slots, positions = arena.slots[:n], arena.positions[:n]
            slots.copy_(slots_cpu)
            positions.copy_(pos_cpu)
            q, kv = arena.q[:n], arena.kv[:n]
            mb = si % opts.micro_batches
            hits = where.get(si, {})
            for layer in range(L):
                _fill_inputs(q, kv, gen)
                out = bound[layer](q, kv, caches[layer], slots, positions, arena.cos_sin, micro_batch=mb)
                for ni, row in hits.get(layer, ()):
                    arena.needle_q[ni].copy_(q[row])
                    arena.needle_kv[ni].copy_(kv[row])
                    arena.needle_qout[ni].copy_(out[row])
            torch.cuda.synchronize(device)
            done += n
            prog.update(si + 1, done, step)
    except torch.cuda.OutOfMemoryError as exc:
        oom = dict(
            step=si + 1, layer=layer, message=str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
        )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats1 = _mem_stats(device)
    peak = torch.cuda.max_memory_allocated(device)
    res.update(
        tokens=done,
        tokens_scheduled=total_tokens,
        steps=len(schedule),
        prefill_steps=sum(1 for s in schedule if s.kind == "prefill"),
        decode_steps=sum(1 for s in schedule if s.kind == "decode"),
        layer_calls=len(schedule) * L,
        seconds=seconds,
        oom=oom,
        memory_before=stats0,
        memory_after=stats1,
        allocations_after_lock={k: stats1[k] - stats0[k] for k in MEM_KEYS},
        planned_bytes=int(planned),
        peak_bytes=int(peak),
        unplanned_peak_bytes=int(peak - planned),
        headroom_bytes=budget.headroom(),
    )
    res["no_allocation_after_lock"] = all(stats1[k] == stats0[k] for k in MEM_KEYS)

    # 4. checks (allocation is allowed again)
    if needles and oom is None:
        res.update(
            _check_needles(
                opts, needles, prompt_lens, arena, kv_all, alloc, nb, fmt, codecs, reference, device
            )
        )
    else:
        res.update(
            recall=0,
            needles=len(needles),
            needle_parts={},
            mismatches=[],
            decode_needles=0,
            q_exact=0,
            q_close=0,
            needle_pads_zero=0,
        )
    pads = True
    if p > h:
        for mb in range(opts.micro_batches):
            buf = pool.buffer(padded_heads=p, head_dim=d, dtype=torch.bfloat16, micro_batch=mb, device=device)
            for r0 in range(0, buf.shape[0], 256):  # in slices: no large temporary under a tight budget
                pads = pads and not bool(buf[r0 : r0 + 256, h:].view(torch.int16).any())
    res["pool_pads_zero"] = pads
    res["block_tables"] = {"blocks_used": nb - alloc.num_free, "blocks_needed": needed_blocks}
    return res


def _check_needles(
    opts, needles, prompt_lens, arena, kv_all, alloc, nb, fmt, codecs, reference, device
) -> dict:
    h, d, bs, L = opts.heads, opts.head_dim, opts.block_size, opts.layers
    k = len(needles)
    pos = torch.tensor([nd.pos for nd in needles], dtype=torch.int64, device=device)
    # slots in the [L * num_blocks, block_bytes] view of the whole cache
    gslots = torch.tensor(
        [(nd.layer * nb + alloc.table(nd.seq)[nd.pos // bs]) * bs + nd.pos % bs for nd in needles],
        dtype=torch.int64,
        device=device,
    )
    flat = kv_all.view(L * nb, kv_all.shape[2])
    got_d, got_s = codecs.read_records(flat, fmt, d, bs, gslots)
    vals = reference.kv_values(arena.needle_kv[:k], pos, arena.cos_sin)
    want_d, want_s = codecs.encode_tokens(fmt, vals)
    nq, tail = fmt.dims(d)
    nope = (got_d[:, :nq] == want_d[:, :nq]).all(1)
    rope = (got_d[:, nq:] == want_d[:, nq:]).all(1)
    scale = (got_s == want_s).all(1)
    exact = nope & rope & scale
    mism = [
        dict(
            seq=needles[i].seq,
            pos=needles[i].pos,
            layer=needles[i].layer,
            nope_ok=bool(nope[i]),
            rope_ok=bool(rope[i]),
            scale_ok=bool(scale[i]),
        )
        for i in range(k)
        if not bool(exact[i])
    ]
    # q_out of the needles' rows, captured right after their layer's call
    want_q = reference.q_values(arena.needle_q[:k], pos, arena.cos_sin, opts.eps).to(torch.bfloat16)
    got_q = arena.needle_qout[:k, :h]
    q_exact = (got_q.view(torch.int16) == want_q.view(torch.int16)).flatten(1).all(1)
    q_close = torch.isclose(got_q.float(), want_q.float(), rtol=1e-2, atol=1e-2).flatten(1).all(1)
    if arena.needle_qout.shape[1] > h:
        pads = (arena.needle_qout[:k, h:].view(torch.int16) == 0).flatten(1).all(1)
    else:
        pads = torch.ones(k, dtype=torch.bool, device=device)
    return dict(
        recall=int(exact.sum()),
        needles=k,
        needle_parts=dict(nope_e4m3=int(nope.sum()), rope_bf16=int(rope.sum()), scale_ue8m0=int(scale.sum())),
        mismatches=mism[:10],
        decode_needles=sum(1 for nd in needles if nd.pos >= prompt_lens[nd.seq]),
        q_exact=int(q_exact.sum()),
        q_close=int(q_close.sum()),
        needle_pads_zero=int(pads.sum()),
    )


def _allocating_pass(opts: SimOptions, schedule, max_pos, needed_blocks, device) -> dict:
    budget = _Budget(opts.memory_budget_bytes, device)
    try:  # the body's tensors are freed when it returns, before the cleanup below
        return _allocating_pass_body(opts, schedule, max_pos, needed_blocks, device, budget)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        budget.restore()


def _allocating_pass_body(opts, schedule, max_pos, needed_blocks, device, budget) -> dict:
    import attn_prologue as ap

    fmt = get_format(CACHE_FORMAT)
    p, d, bs, L = opts.padded_heads, opts.head_dim, opts.block_size, opts.layers
    res: dict = dict(padded_q_bytes_max=padded_q_bytes(opts))
    arena = _Arena(opts, max_pos, device)  # the same model buffers; no pool
    gen = torch.Generator(device=device)
    gen.manual_seed(opts.seed)
    _fill_inputs(arena.q, arena.kv, gen)
    dummy = torch.empty((1, fmt.block_bytes(d, bs)), dtype=torch.uint8, device=device)
    q_tmp = torch.empty((1, p, d), dtype=torch.bfloat16, device=device)
    ap.qnorm_rope_kv_insert(
        arena.q[:1],
        arena.kv[:1],
        q_tmp,
        dummy,
        arena.slots[:1],
        arena.positions[:1],
        arena.cos_sin,
        opts.eps,
        bs,
    )
    torch.cuda.synchronize(device)
    del dummy, q_tmp
    kv_info = _size_kv(opts, budget, needed_blocks, "allocating")
    res["kv"] = kv_info
    nb = kv_info["num_blocks"]
    kv_all = torch.empty((L, nb, kv_info["block_bytes"]), dtype=torch.uint8, device=device)
    caches = [kv_all[layer] for layer in range(L)]
    alloc = BlockAllocator(nb, bs, seed=opts.seed)
    total_tokens = sum(s.num_tokens for s in schedule)
    torch.cuda.synchronize(device)
    stats0 = _mem_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    planned = torch.cuda.memory_allocated(device)
    headroom = budget.headroom()
    prog = _Progress("allocating", len(schedule), total_tokens, opts.progress)
    oom = None
    done = 0
    t0 = time.perf_counter()
    si = layer = n = 0
    try:
        for si, step in enumerate(schedule):
            n = step.num_tokens
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            slots, positions = arena.slots[:n], arena.positions[:n]
            slots.copy_(slots_cpu)
            positions.copy_(pos_cpu)
            q, kv = arena.q[:n], arena.kv[:n]
            for layer in range(L):
                _fill_inputs(q, kv, gen)
                q_out = torch.empty(
                    (n, p, d), dtype=torch.bfloat16, device=device
                )  # what the old op did per call
                ap.qnorm_rope_kv_insert(
                    q, kv, q_out, caches[layer], slots, positions, arena.cos_sin, opts.eps, bs
                )
                del q_out  # attention has consumed it
            torch.cuda.synchronize(device)
            done += n
            prog.update(si + 1, done, step)
    except torch.cuda.OutOfMemoryError as exc:
        msg = str(exc).splitlines()[0] if str(exc) else "OutOfMemoryError"
        oom = dict(
            step=si + 1,
            steps=len(schedule),
            layer=layer,
            tokens=n,
            requested_bytes=padded_q_bytes(opts, n),
            message=msg,
        )
        if opts.progress:
            print(
                f"[allocating] torch.cuda.OutOfMemoryError at step {si + 1}/{len(schedule)}, layer {layer}: "
                f"a [{n}, {p}, {d}] Q tensor ({_gib(padded_q_bytes(opts, n))}) with {_gib(headroom)} of headroom",
                flush=True,
            )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    stats1 = _mem_stats(device)
    extra = int(peak - planned)
    res.update(
        outcome="oom" if oom else "fit",
        oom=oom,
        tokens=done,
        seconds=seconds,
        planned_bytes=int(planned),
        peak_bytes=int(peak),
        unplanned_peak_bytes=extra,
        headroom_bytes=int(headroom),
        allocations={k: stats1[k] - stats0[k] for k in MEM_KEYS},
    )
    if oom:
        # what it needed beyond what the engine had left, measured at the failing request
        res["needed_beyond_budget_bytes"] = int(extra + oom["requested_bytes"] - headroom)
        res["exceeded_budget"] = True
    else:
        res["needed_beyond_budget_bytes"] = int(extra - headroom)
        res["exceeded_budget"] = extra > headroom
        # the largest kv_fraction under which the measured extra would still have fit
        free = kv_info["free_bytes"]
        res["max_kv_fraction_that_fits"] = max(0.0, 1.0 - extra / free) if free else 0.0
    return res


def run(opts: SimOptions) -> dict:
    """Run the simulation on the current CUDA device; returns (and optionally writes) the results."""
    from ..jit import compiler

    if not torch.cuda.is_available():
        raise SimulationError("simulate needs a CUDA GPU")
    if opts.padded_heads < opts.heads:
        raise SimulationError(f"padded_heads={opts.padded_heads} < heads={opts.heads}")
    if not 0 < opts.kv_fraction < 1:
        raise SimulationError(f"kv_fraction must be in (0, 1), got {opts.kv_fraction}")
    device = torch.device(opts.device) if opts.device else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prompts = prompt_lengths(opts.seqs, opts.prompt_len, opts.prompt_jitter, opts.seed)
    schedule = build_schedule(prompts, opts.max_num_batched_tokens, opts.decode_steps)
    needles = select_needles(prompts, opts.decode_steps, opts.layers, opts.needles, opts.seed)
    where = locate_needles(schedule, needles)
    max_pos = max_position(prompts, opts.decode_steps)
    needed_blocks = sum(blocks_for(p + opts.decode_steps, opts.block_size) for p in prompts)

    if opts.progress:
        print(
            f"simulate on {torch.cuda.get_device_name(device)}: {opts.seqs} sequences, prompts {min(prompts)}..{max(prompts)} "
            f"tokens, {len(schedule)} steps ({sum(s.kind == 'prefill' for s in schedule)} prefill, {opts.decode_steps} decode), "
            f"{opts.layers} layers, H={opts.heads} P={opts.padded_heads} D={opts.head_dim}, max_num_batched_tokens="
            f"{opts.max_num_batched_tokens}, {len(needles)} needles"
            + (
                f", memory budget {_gib(opts.memory_budget_bytes)}"
                if opts.memory_budget_bytes is not None
                else ""
            ),
            flush=True,
        )
    results = {
        "device": torch.cuda.get_device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dsl": compiler.dsl_versions(),
        "command": opts.command or f"attn_prologue.simulate.run({opts!r})",
        "options": asdict(opts),
        "prompt_lens": prompts,
        "max_position": max_pos,
    }
    t0 = time.perf_counter()
    results["pool"] = _pool_pass(opts, schedule, needles, where, prompts, max_pos, needed_blocks, device)
    results["allocating"] = (
        _allocating_pass(opts, schedule, max_pos, needed_blocks, device) if opts.allocating else None
    )
    results["seconds"] = time.perf_counter() - t0
    pr = results["pool"]
    results["passed"] = bool(
        pr["oom"] is None
        and pr["no_allocation_after_lock"]
        and pr["recall"] == pr["needles"]
        and pr["q_close"] == pr["needles"]
        and pr["needle_pads_zero"] == pr["needles"]
        and pr["pool_pads_zero"]
        and pr["tokens"] == pr["tokens_scheduled"]
    )
    al = results["allocating"]
    results["summary"] = {
        "reserved_bytes": pr["reserved_bytes"],
        "kv_capacity_tokens": pr["kv"]["capacity_tokens"],
        "tokens_processed": pr["tokens"],
        "layer_calls": pr["layer_calls"],
        "seconds": round(pr["seconds"], 3),
        "recall": f"{pr['recall']}/{pr['needles']}",
        "q_out_close": f"{pr['q_close']}/{pr['needles']}",
        "pads_zero": pr["pool_pads_zero"] and pr["needle_pads_zero"] == pr["needles"],
        "allocations_after_lock": pr["allocations_after_lock"],
        "oom": pr["oom"],
        "allocating_outcome": None if al is None else al["outcome"],
        "allocating_oom_at": None
        if al is None or not al["oom"]
        else {k: al["oom"][k] for k in ("step", "layer", "tokens")},
        "allocating_unplanned_peak_bytes": None if al is None else al["unplanned_peak_bytes"],
        "allocating_headroom_bytes": None if al is None else al["headroom_bytes"],
        "passed": results["passed"],
    }
    if opts.progress:
        print()
        print(summary(results), flush=True)
    if opts.json_path:
        Path(opts.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json_path).write_text(json.dumps(results, indent=1, default=str))
        if opts.progress:
            print(f"\nresults written to {opts.json_path}")
    return results


def summary(results: dict) -> str:
    """The end-of-run table."""
    pr, al = results["pool"], results.get("allocating")
    o = results["options"]
    rows = [
        ("device", results["device"]),
        ("scratch pool reserved", f"{pr['reserved_bytes']} B ({_gib(pr['reserved_bytes'])})"),
        (
            "KV cache (pool mode)",
            f"{pr['kv']['num_blocks']} blocks, {pr['kv']['capacity_tokens']} tokens/layer, "
            f"{o['layers']} layers, {_gib(pr['kv']['kv_bytes'])} of {_gib(pr['kv']['free_bytes'])} free",
        ),
        (
            "schedule",
            f"{pr['steps']} steps ({pr['prefill_steps']} prefill, {pr['decode_steps']} decode), "
            f"{pr['layer_calls']} layer calls",
        ),
        (
            "tokens processed",
            f"{pr['tokens']}/{pr['tokens_scheduled']} ({pr['tokens'] * o['layers']} token-layers)",
        ),
        (
            "time",
            f"{pr['seconds']:.2f}s ({pr['tokens'] * o['layers'] / max(pr['seconds'], 1e-9):,.0f} token-layers/s, "
            f"random inputs included)",
        ),
        (
            "allocations after lock",
            ", ".join(f"{k.split('.')[0]} {v:+d}" for k, v in pr["allocations_after_lock"].items())
            + (" (none)" if pr["no_allocation_after_lock"] else " (ALLOCATED)"),
        ),
        ("unplanned peak memory", f"{pr['unplanned_peak_bytes']} B"),
        ("OOM", "none" if pr["oom"] is None else f"step {pr['oom']['step']} layer {pr['oom']['layer']}"),
        (
            "needle recall (bit-exact)",
            f"{pr['recall']}/{pr['needles']}"
            + (
                f"  (e4m3 {pr['needle_parts'].get('nope_e4m3')}, rope {pr['needle_parts'].get('rope_bf16')}, "
                f"scales {pr['needle_parts'].get('scale_ue8m0')})"
                if pr["needle_parts"]
                else ""
            ),
        ),
        (
            "q_out of needles",
            f"{pr['q_close']}/{pr['needles']} within 1e-2, {pr['q_exact']}/{pr['needles']} bit-exact",
        ),
        (
            "pad heads zero",
            f"needles {pr['needle_pads_zero']}/{pr['needles']}, pool buffers "
            f"{'yes' if pr['pool_pads_zero'] else 'NO'}",
        ),
    ]
    if al is None:
        rows.append(("allocating mode", "skipped"))
    else:
        rows.append(
            (
                "KV cache (allocating)",
                f"{al['kv']['num_blocks']} blocks, {al['kv']['capacity_tokens']} tokens/layer, "
                f"{_gib(al['kv']['kv_bytes'])} of {_gib(al['kv']['free_bytes'])} free",
            )
        )
        if al["oom"]:
            oo = al["oom"]
            rows.append(
                (
                    "allocating mode",
                    f"torch.cuda.OutOfMemoryError at step {oo['step']}/{oo['steps']}, layer "
                    f"{oo['layer']} (N={oo['tokens']}, needed {_gib(oo['requested_bytes'])}, "
                    f"headroom {_gib(al['headroom_bytes'])})",
                )
            )
        else:
            rows.append(
                (
                    "allocating mode",
                    f"fit: measured peak beyond the planned memory {_gib(al['unplanned_peak_bytes'])}"
                    f" (headroom {_gib(al['headroom_bytes'])}; fails for kv-fraction > "
                    f"{al['max_kv_fraction_that_fits']:.3f})",
                )
            )
    rows.append(("verdict", "PASS" if results.get("passed") else "FAIL"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
