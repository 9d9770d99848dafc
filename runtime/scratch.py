"""The padded-Q scratch pool (docs/serving.md).

One buffer per (device, micro-batch, dtype, P, D), shared by all layers, sized for the largest batch
the scheduler can form and reserved during the memory-profiling run before the KV cache is sized.
Buffers are zeroed once at reservation ("zero-once"): kernels bound to them write only the live
heads, so pad heads stay zero without being written on every call. After `lock()` a request that
does not fit is a ScratchError, never an allocation. P == H needs no scratch (Q is written in place).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from .dispatch import Runtime, default_runtime
from .errors import ScratchError


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    live_heads: int | None = None  # the H whose kernels write it (zero-once: pads [H, P) stay zero)
    # the Q layout of those kernels: which elements are live differs between layouts, so a zero-once
    # buffer serves one (H, layout)
    q_layout: str | None = None
    # claimed by writers that store every head [0, P) on every call (pads as zeros): any H, any
    # layout, but never zero-once as well (their views may be written by whoever reads them)
    pads_written: bool = False
    views: dict = field(default_factory=dict)
    # bound ops writing this buffer: told when it is retired (released, or replaced by a larger one)
    claimants: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def retire(self, why: str) -> None:
        for op in list(self.claimants):
            op.invalidate(f"its scratch buffer was {why}; bind the layer again")
        self.claimants.clear()


class ScratchPool:
    """Reserve at profile time, lock, then hand out views without allocating.

    >>> pool = ScratchPool()
    >>> pool.reserve(max_tokens=8192, padded_heads=64, head_dim=512, dtype=torch.bfloat16, device="cuda")
    >>> pool.lock()
    >>> q_out = pool.view(n_tokens, padded_heads=64, head_dim=512, dtype=torch.bfloat16, micro_batch=0)
    """

    def __init__(self):
        self._buffers: dict[tuple, _Buffer] = {}
        self._locked = False
        self._lock = threading.Lock()

    @staticmethod
    def _key(device, micro_batch: int, dtype: torch.dtype, padded_heads: int, head_dim: int) -> tuple:
        """The buffer's key; ScratchError for what no buffer can be keyed by (checked before anything)."""
        for name, value, least in (("padded_heads", padded_heads, 1), ("head_dim", head_dim, 1),
                                   ("micro_batch", micro_batch, 0)):  # fmt: skip
            if type(value) is not int or value < least:
                raise ScratchError(f"{name} must be an int >= {least}, got {value!r}")
        if not isinstance(dtype, torch.dtype):
            raise ScratchError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        try:
            device = torch.device(device) if device is not None else torch.device("cuda")
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ScratchError(f'device must be a CUDA device or "cpu", got {device!r} ({exc})') from None
        if device.type not in ("cuda", "cpu"):
            raise ScratchError(
                f'the scratch pool serves CUDA devices and "cpu" (the CPU functions), not {device}'
            )
        if device.type == "cuda" and device.index is None:
            if not torch.cuda.is_available():
                raise ScratchError(
                    'no CUDA device is available for the pool\'s default device: pass device="cpu" for '
                    "buffers the CPU functions (the PyTorch reference) write, or reserve on a GPU"
                )
            device = torch.device("cuda", torch.cuda.current_device())
        return (device, micro_batch, dtype, padded_heads, head_dim)

    def reserve(
        self,
        *,
        max_tokens: int,
        padded_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        micro_batches: int = 2,
        device=None,
        runtime: Runtime | None = None,
    ) -> int:
        """Allocate (zeroed) buffers for `micro_batches` micro-batches; returns the bytes added. On a
        CUDA device it also has the runtime make what a first bind there needs (error counters, the
        self-test's buffers, under 2 MB), so binds after lock() allocate nothing."""
        sizes = dict(
            max_tokens=max_tokens, padded_heads=padded_heads, head_dim=head_dim, micro_batches=micro_batches
        )
        if any(type(v) is not int or v <= 0 for v in sizes.values()):
            raise ScratchError(
                "reserve needs positive int sizes, got " + ", ".join(f"{k}={v!r}" for k, v in sizes.items())
            )
        added = 0
        with self._lock:
            if self._locked:
                raise ScratchError("the scratch pool is locked: reserve everything before lock()")
            dev = self._key(device, 0, dtype, padded_heads, head_dim)[0]
            if dev.type == "cuda" and not (
                torch.cuda.is_available() and dev.index < torch.cuda.device_count()
            ):
                raise ScratchError(
                    f'no CUDA device {dev} here: reserve on a GPU this process sees, or on "cpu"'
                )
            if dev.type == "cuda":
                (runtime or default_runtime()).prepare(dev)
            made = {}  # every buffer is allocated before any is replaced: a failure changes nothing
            for mb in range(micro_batches):
                key = self._key(dev, mb, dtype, padded_heads, head_dim)
                buf = self._buffers.get(key)
                if buf is None or buf.tensor.shape[0] < max_tokens:
                    try:
                        made[key] = torch.zeros((max_tokens, padded_heads, head_dim), dtype=dtype, device=dev)
                    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                        raise ScratchError(
                            f"could not allocate {max_tokens} x {padded_heads} x {head_dim} {dtype} on {dev} "
                            f"({str(exc).splitlines()[0]}): reserve fewer tokens or micro-batches"
                        ) from None
            for key, t in made.items():
                buf = self._buffers.get(key)
                if buf is not None:
                    buf.retire(f"replaced by a larger one ({max_tokens} tokens)")
                    added -= buf.tensor.numel() * buf.tensor.element_size()
                self._buffers[key] = (
                    _Buffer(t, buf.live_heads, buf.q_layout, buf.pads_written) if buf else _Buffer(t)
                )
                added += t.numel() * t.element_size()
        return added

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by the pool: subtract them before sizing the KV cache."""
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self._buffers.values())

    @property
    def locked(self) -> bool:
        return self._locked

    def lock(self) -> None:
        """From now on nothing is allocated: views of a size that does not fit raise ScratchError.
        Waits for a reserve() in progress on another thread."""
        with self._lock:
            self._locked = True

    def capacity(
        self, *, padded_heads: int, head_dim: int, dtype=torch.bfloat16, micro_batch: int = 0, device=None
    ) -> int:
        buf = self._buffers.get(self._key(device, micro_batch, dtype, padded_heads, head_dim))
        return 0 if buf is None else buf.tensor.shape[0]

    def buffer(
        self, *, padded_heads: int, head_dim: int, dtype=torch.bfloat16, micro_batch: int = 0, device=None
    ) -> torch.Tensor:
        key = self._key(device, micro_batch, dtype, padded_heads, head_dim)
        buf = self._buffers.get(key)
        if buf is None:
            have = (
                ", ".join(
                    f"(mb={k[1]}, {k[2]}, P={k[3]}, D={k[4]}, {k[0]})" for k in sorted(self._buffers, key=str)
                )
                or "none"
            )
            raise ScratchError(
                f"no scratch reserved for micro_batch={micro_batch}, dtype={dtype}, P={padded_heads}, "
                f"D={head_dim} on {key[0]}; reserved: {have}"
            )
        return buf.tensor

    def claim(
        self,
        live_heads: int,
        *,
        padded_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        micro_batch: int = 0,
        device=None,
        owner=None,
        q_layout: str = "head_major",
        writes_pads: bool = False,
    ) -> torch.Tensor:
        """Bind a live-head count and Q layout to the buffer reserved for (micro_batch, dtype,
        padded_heads, head_dim, device) (zero-once): every kernel writing it must use the same H and
        layout, or the pad elements would keep another writer's values instead of zeros.
        `writes_pads=True` claims it instead for writers that store all P heads on every call (pads
        as zeros): any H and layout, but then no zero-once claim. `owner` (a bound op) is told through
        `owner.invalidate(reason)` when the buffer is released or replaced. Returns the buffer."""
        k = self._key(device, micro_batch, dtype, padded_heads, head_dim)  # (typed checks first)
        if type(live_heads) is not int or not 0 < live_heads <= padded_heads:
            raise ScratchError(
                f"live_heads must be an int in [1, padded_heads={padded_heads}], got {live_heads!r}"
            )
        self.buffer(
            padded_heads=padded_heads, head_dim=head_dim, dtype=dtype, micro_batch=micro_batch, device=device
        )
        buf = self._buffers[k]
        if writes_pads:
            if buf.live_heads is not None:
                raise ScratchError(
                    f"scratch buffer {k} is zero-once for H={buf.live_heads} ({buf.q_layout}); a writer of "
                    "every head cannot share it (its readers may write its pads): reserve another P or pool"
                )
            buf.pads_written = True
        else:
            if buf.pads_written:
                raise ScratchError(
                    f"scratch buffer {k} is claimed by writers of every head (pads rewritten per call), "
                    f"so it cannot be zero-once for H={live_heads}: reserve another P or pool"
                )
            if buf.live_heads is not None and (buf.live_heads, buf.q_layout) != (live_heads, q_layout):
                raise ScratchError(
                    f"scratch buffer {k} already serves H={buf.live_heads} live heads ({buf.q_layout}); a "
                    f"zero-once buffer cannot also serve H={live_heads} ({q_layout}) (reserve another P, "
                    "or use write-zeros mode)"
                )
            buf.live_heads, buf.q_layout = live_heads, q_layout
        if owner is not None:
            buf.claimants.add(owner)
        return buf.tensor

    def claim_micro_batches(self, live_heads: int, micro_batches: int, **claim) -> list[torch.Tensor]:
        """claim() of micro-batches 0 .. micro_batches - 1 (the other arguments as claim's), all or
        none: when one is refused, the buffers already claimed are left as they were."""
        if type(micro_batches) is not int or micro_batches < 1:
            raise ScratchError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        was = []  # (buffer, live_heads, q_layout, pads_written, owner among its claimants) before
        owner = claim.get("owner")
        try:
            out = []
            for mb in range(micro_batches):
                key = self._key(claim.get("device"), mb, claim.get("dtype", torch.bfloat16),
                                claim["padded_heads"], claim["head_dim"])  # fmt: skip
                buf = self._buffers.get(key)
                if buf is not None:
                    was.append((buf, buf.live_heads, buf.q_layout, buf.pads_written, owner in buf.claimants))
                out.append(self.claim(live_heads, micro_batch=mb, **claim))
            return out
        except BaseException:
            for buf, heads, layout, pads, claimed in was:
                buf.live_heads, buf.q_layout, buf.pads_written = heads, layout, pads
                if owner is not None and not claimed:
                    buf.claimants.discard(owner)
            raise

    def view(
        self,
        n_tokens: int,
        *,
        padded_heads: int,
        head_dim: int,
        dtype=torch.bfloat16,
        micro_batch: int = 0,
        device=None,
    ) -> torch.Tensor:
        """q_out for n_tokens rows: a view of the reserved buffer (cached per size, no allocation)."""
        if type(n_tokens) is not int or n_tokens < 0:
            raise ScratchError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
        key = self._key(device, micro_batch, dtype, padded_heads, head_dim)
        buf = self._buffers.get(key)
        if buf is None or buf.tensor.shape[0] < n_tokens:
            if self._locked or buf is None:
                cap = 0 if buf is None else buf.tensor.shape[0]
                raise ScratchError(
                    f"{n_tokens} tokens do not fit the locked scratch pool (capacity {cap} tokens for micro_batch="
                    f"{micro_batch}, {dtype}, P={padded_heads}, D={head_dim}); reserve max_num_batched_tokens at profile time"
                )
            self.reserve(
                max_tokens=n_tokens,
                padded_heads=padded_heads,
                head_dim=head_dim,
                dtype=dtype,
                micro_batches=micro_batch + 1,
                device=key[0],
            )
            buf = self._buffers[key]
        v = buf.views.get(n_tokens)
        if v is None:
            v = buf.tensor[:n_tokens]
            buf.views[n_tokens] = v
        return v

    def release(self) -> None:
        """Drop every buffer (unlocks)."""
        with self._lock:
            for b in self._buffers.values():
                b.retire("released")
            self._buffers.clear()
            self._locked = False
