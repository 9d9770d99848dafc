"""What a pass of `simulate` runs per layer and step: each layer's op (on CUDA the bound op; on the
CPU the package's reference behind the bound op's contract, ReferenceOp) and a step's input rows,
padded to the token count the ranks agreed on."""

from __future__ import annotations

import torch

from ... import reference, validate
from ...api import bind
from ...scratch import ScratchPool
from .engine import CACHE_FORMAT, BlockAllocator, SimOptions, Step, step_slots_positions
from .harness import Arena

BF16 = torch.bfloat16


class ReferenceOp:
    """A bound op on CPU tensors: the kernels' argument checks, then the PyTorch reference writing
    a view of the pool's buffer claimed for H live heads, pads never written (zero-once)."""

    def __init__(self, opts: SimOptions, pool: ScratchPool, device):
        self.opts, self.pool, self.device = opts, pool, device
        for mb in range(opts.micro_batches):
            pool.claim(
                opts.heads,
                padded_heads=opts.padded_heads,
                head_dim=opts.head_dim,
                micro_batch=mb,
                device=device,
            )

    def __call__(self, q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, *, micro_batch: int = 0):
        o = self.opts
        q_out = self.pool.view(
            q_in.shape[0],
            padded_heads=o.padded_heads,
            head_dim=o.head_dim,
            micro_batch=micro_batch,
            device=self.device,
        )
        args = (
            q_in,
            kv,
            q_out,
            k_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            o.eps,
            o.block_size,
            CACHE_FORMAT,
        )
        validate.check_qkv(*args)
        reference.qnorm_rope_kv_insert(*args, write_pad_heads=False)
        return q_out


def layer_ops(opts: SimOptions, pool: ScratchPool, device) -> list:
    if device.type != "cuda":
        return [ReferenceOp(opts, pool, device) for _ in range(opts.layers)]
    return [
        bind(
            num_heads=opts.heads,
            padded_heads=opts.padded_heads,
            head_dim=opts.head_dim,
            rope_dim=opts.rope_dim,
            cache_format=CACHE_FORMAT,
            dtype=BF16,
            block_size=opts.block_size,
            pool=pool,
            micro_batches=opts.micro_batches,
            eps=opts.eps,
            device=device,
        )
        for _ in range(opts.layers)
    ]


class StepInputs:
    """Step si's rows in the arena: the rank's real tokens first, then pad rows up to the agreed N
    (position 0, and no slot: slot_mapping holds the real rows only, so len(slot_mapping) < N)."""

    def __init__(self, arena: Arena, step: Step | None, n: int, alloc: BlockAllocator):
        self.real = step.num_tokens if step is not None else 0
        if step is not None:
            slots_cpu, pos_cpu = step_slots_positions(step, alloc)
            arena.slots[: self.real].copy_(slots_cpu)
            arena.positions[: self.real].copy_(pos_cpu)
        arena.positions[self.real : n].zero_()
        self.slots, self.positions = arena.slots[: self.real], arena.positions[:n]
        self.q, self.kv = arena.q[:n], arena.kv[:n]
        self.kind = step.kind if step is not None else "pad"
