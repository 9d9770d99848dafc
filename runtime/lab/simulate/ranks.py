"""The ranks of a `simulate` run and what they agree on (torch.distributed).

Rank r is TP rank r % tp of DP group r // tp (TP innermost, so a TP group is a block of
consecutive ranks, as engines lay them out on a node). The scheduler's numbers (tokens per step, KV
blocks) travel as CPU tensors over a gloo group, as engines keep such metadata off the GPU; the
cache and Q bytes the checks compare travel over the run's backend (nccl, or gloo, which takes
CUDA tensors for broadcast and all_reduce: what ranks sharing one GPU use). Collectives are only
broadcast and all_reduce, the two every backend supports on every device.

`Solo` is the one-process world (every collective is the identity), so the passes have one form.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ...errors import InputError


class Solo:
    """One rank alone: TP rank 0 of DP group 0 of a world of one."""

    rank, world, tp, dp, tp_rank, dp_rank = 0, 1, 1, 1, 0, 0
    tp_ranks = (0,)  # the ranks of this TP group, in TP order

    def agree_step(self, real_tokens: int, failed: bool) -> tuple[int, bool]:
        """(tokens every rank runs this step, whether some rank failed): the largest real count."""
        return real_tokens, failed

    def min(self, value: int) -> int:
        return value

    def max(self, value: int) -> int:
        return value

    def barrier(self) -> None:
        pass

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        return [obj]

    def tp_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t` of every rank of this TP group, in TP order (same shape and dtype on each)."""
        return [t]

    def tp_mismatches(self, t: torch.Tensor) -> int:
        """Elements of `t` that differ from the TP group's first rank's `t` (0 on that rank)."""
        return 0

    def generators(self, device, seed: int) -> tuple[torch.Generator, torch.Generator]:
        """(Q's generator, KV's generator), seeded. One rank: one generator draws both."""
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        return g, g


ALONE = Solo()


class Ranks(Solo):
    """This process's rank in an initialized default process group of tp x dp ranks."""

    def __init__(self, tp: int, dp: int, timeout_s: float):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != tp * dp:
            raise InputError(f"the process group has {self.world} ranks, tp x dp = {tp * dp}")
        self.tp, self.dp = tp, dp
        self.tp_rank, self.dp_rank = self.rank % tp, self.rank // tp
        timeout = datetime.timedelta(seconds=timeout_s)
        # every rank creates every group, in the same order (torch.distributed requires it)
        self.cpu = (
            dist.group.WORLD
            if dist.get_backend() == "gloo"
            else dist.new_group(backend="gloo", timeout=timeout)
        )
        self.tp_ranks = [self.dp_rank * tp + j for j in range(tp)]
        for d in range(dp):
            g = dist.new_group([d * tp + j for j in range(tp)], timeout=timeout)
            if d == self.dp_rank:
                self.tp_group = g
        self._step = torch.zeros(2, dtype=torch.int64)  # made once: a step allocates nothing

    def agree_step(self, real_tokens: int, failed: bool) -> tuple[int, bool]:
        # DP attention: every rank's batch is padded to the largest, so all run the same N
        self._step[0], self._step[1] = real_tokens, int(failed)
        dist.all_reduce(self._step, op=dist.ReduceOp.MAX, group=self.cpu)
        return int(self._step[0]), bool(self._step[1])

    def _reduce(self, value: int, op) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.cpu)
        return int(t[0])

    def min(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MIN)

    def max(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MAX)

    def barrier(self) -> None:
        dist.barrier(group=self.cpu)

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def tp_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for j, src in enumerate(
            self.tp_ranks
        ):  # an all_gather made of broadcasts (gloo has no CUDA all_gather)
            buf = t.clone() if j == self.tp_rank else torch.empty_like(t)
            dist.broadcast(buf, src=src, group=self.tp_group)
            out.append(buf)
        return out

    def tp_mismatches(self, t: torch.Tensor) -> int:
        buf = t.clone() if self.tp_rank == 0 else torch.empty_like(t)
        dist.broadcast(buf, src=self.tp_ranks[0], group=self.tp_group)
        return int((buf != t).sum())

    def generators(self, device, seed: int) -> tuple[torch.Generator, torch.Generator]:
        # TP ranks of a DP group draw the same KV rows (MLA's latent KV is not sharded) and each its
        # own Q heads: the model's full-head Q is the concatenation of the TP ranks' shards
        q, kv = torch.Generator(device=device), torch.Generator(device=device)
        q.manual_seed(seed + 1_000_003 * (1 + self.rank))
        kv.manual_seed(seed + 1_000_003 * (1 + self.world + self.dp_rank))
        return q, kv
