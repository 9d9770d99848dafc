"""The serving API: reserve scratch at profile time, bind once per layer, call per step.

    pool = attn_prologue.ScratchPool()
    pool.reserve(max_tokens=max_num_batched_tokens, padded_heads=64, head_dim=512, micro_batches=2)
    ... size the KV cache with pool.reserved_bytes already taken ...
    pool.lock()
    op = attn_prologue.bind(num_heads=16, padded_heads=64, block_size=64, pool=pool)   # per layer
    q_out = op(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch=mb)  # per step

A bound op writes only the live heads into its zero-once scratch buffer, allocates nothing, and
its per-call Python path is a few integer checks, the overlap check and one kernel call
(CUDA-graph capturable).
"""

from __future__ import annotations

import sys

import torch

from . import ops, overlap, validate
from .binding import SlotWidthCalls, bind_device, check_bind_args, check_bound_tensor
from .bound_kv import BoundKvOp
from .dispatch import MAX_BUCKET_LOG2, Runtime, default_runtime
from .errors import InputError, ScratchError
from .formats import get_format
from .launch import LaunchConfig
from .ops import is_neg
from .scratch import ScratchPool
from .variants import INTERLEAVED_PADDED_HEADS, Op, QLayout, QOut, Request, q_flags


class BoundOp(SlotWidthCalls):
    """qnorm_rope_kv_insert bound to one layer's shapes, device, cache format and scratch (made by
    `bind`, whose docstring says what each argument is)."""

    def __init__(
        self,
        *,
        num_heads: int,
        padded_heads: int | None = None,
        head_dim: int = 512,
        rope_dim: int = 64,
        cache_format: str = "fp8_ds_mla",
        dtype: torch.dtype = torch.bfloat16,
        block_size: int,
        pool: ScratchPool | None = None,
        micro_batches: int = 1,
        eps: float = 1e-6,
        kv_scale: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
        checked: bool = True,
        numerics=None,
        apply_q_norm: bool = True,
        apply_q_rope: bool = True,
        q_layout: str = "head_major",
        device=None,
        config: LaunchConfig | None = None,
        runtime: Runtime | None = None,
    ):
        p = num_heads if padded_heads is None else padded_heads
        io = check_bind_args(dtype, eps, num_heads=num_heads, padded_heads=p, head_dim=head_dim, rope_dim=rope_dim,
                             block_size=block_size, micro_batches=micro_batches)  # fmt: skip
        if p < num_heads:
            raise InputError(f"padded_heads={p} is smaller than num_heads={num_heads}")
        device = bind_device(device, "bind")
        fmt = get_format(cache_format)
        flags = fmt.numerics_flags(numerics)  # the KV path's parity choices (NumericsError if it lacks one)
        if fmt.needs_tensor_scale and kv_scale is None:
            raise InputError(f"cache format {cache_format} needs kv_scale")
        q8 = q_scale is not None
        rt = runtime or default_runtime()
        layout = validate.check_q_layout(q_layout)
        if layout is QLayout.INTERLEAVED and p not in INTERLEAVED_PADDED_HEADS:
            raise InputError(
                f"the interleaved Q layout takes padded_heads in {INTERLEAVED_PADDED_HEADS}, got {p}"
            )
        if layout is QLayout.INTERLEAVED and pool is None:
            raise ScratchError(
                "an interleaved q_out needs a ScratchPool (it cannot be written in place of q_in)"
            )
        request = Request(
            Op.QKV, head_dim, rope_dim, cache_format, io, QOut.FP8 if q8 else QOut.IO, q_layout=layout
        )
        self._request, self._config, self._rt = request, config, rt
        self._launch_args, self._lead = {"heads": num_heads, "numerics": flags}, ops.QKV_TENSORS
        self.errors = rt.errors_buffer(device)
        self.h, self.p, self.head_dim, self.rope_dim = num_heads, p, head_dim, rope_dim
        self.block_size, self.eps = block_size, float(eps)
        self.cache_format, self.dtype, self.device = cache_format, dtype, device
        self.checked = 1 if checked else 0
        self.kv_scale, self.q_scale = kv_scale, q_scale
        self.bytes_per_token = fmt.bytes_per_token(head_dim)
        self.q_layout = layout
        # what every call passes after the caller's tensors, by name
        self._values = dict(
            errors=self.errors, eps=self.eps, block_size=block_size, n_write_heads=num_heads,
            checked=self.checked, numerics=flags, q_flags=q_flags(apply_q_norm, apply_q_rope),
            **{n: t for n, t in zip(ops.SCALES, (kv_scale, q_scale)) if t is not None},
        )  # fmt: skip
        self._calls_by_dtype: dict = {}
        self._use_slot_dtype(torch.int64)  # binds (and self-tests) now: UnsupportedError before any claim
        self.in_place = pool is None
        if self.in_place:
            if p != num_heads:
                raise ScratchError(
                    f"padded_heads={p} > num_heads={num_heads} needs a ScratchPool (Q cannot be padded in place)"
                )
            if q8:
                raise ScratchError("an FP8 q_out needs a ScratchPool (FP8 Q cannot be written in place)")
            self.buffers = []
            self.capacity = sys.maxsize
        else:
            self.buffers = pool.claim_micro_batches(  # all or none: a refused bind holds no claim
                num_heads,
                micro_batches,
                owner=self,  # told (invalidate) when the pool retires the buffer
                q_layout=layout.value,  # the live elements of a zero-once buffer depend on it
                padded_heads=p,
                head_dim=head_dim,
                dtype=torch.float8_e4m3fn if q8 else dtype,
                device=device,
            )
            if q8:
                self.buffers = [b.view(torch.uint8) for b in self.buffers]
            self.capacity = min(b.shape[0] for b in self.buffers)
            self.pool = pool
        # micro-batch -> (kernel's q_out, the views returned per token count, the buffer's byte range)
        self._out = {mb: (b, {}, overlap.byte_range(b)) for mb, b in enumerate(self.buffers)}
        # what the last full check accepted: k_cache (and its byte range), cos_sin_cache (and its and
        # the scales' byte ranges, checked there against every buffer this op writes)
        self._k_cache, self._k_range, self._cos_sin_cache, self._fixed = None, (0, 0), None, ()
        self._q_row, self._kv_row = 2 * num_heads * head_dim, 2 * head_dim  # bytes of a q_in row, a kv row
        self._invalid: str | None = None
        self._fast = None  # the native plan's call (native/fastpath.h), made after each full check

    def invalidate(self, reason: str) -> None:
        """The pool retired a buffer this op writes: drop it (so reserved_bytes is what is held) and
        refuse every later call with a ScratchError saying why."""
        self._invalid = reason
        self.capacity = -1  # every call now takes the full check, which raises
        self.buffers, self._out, self._fast = [], {}, None

    def __call__(self, q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, *, micro_batch: int = 0):
        """Run the op; returns q_out: [N, P, D] (a scratch view), or q_in itself when written in place.

        Checked here per call: M <= N, N fits the scratch, the micro-batch, overlap between what the
        call writes and its inputs, and (when k_cache or cos_sin_cache is not the one of the last call)
        the whole argument list. The compiled function checks the rest (dtypes, shapes, strides,
        alignment, device, equal row counts of q_in, kv and positions). The native plan does the
        per-call checks and the call in C; what it refuses (or n == 0) takes the Python path."""
        fast = self._fast
        if fast is not None:
            out = fast(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch)
            if out is not False:
                return out if out is not True else self._view(q_in.shape[0], micro_batch)
        return self._call(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch)

    def _call(self, q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch):
        """__call__ in Python: the same checks as the native plan's, and the full check when needed."""
        try:
            shape = q_in.shape
            n, m = shape[0], slot_mapping.shape[0]
            stale = (
                m > n
                or n > self.capacity
                or shape[1] != self.h  # more heads than bound would write over the zero-once pads
                or k_cache is not self._k_cache
                or slot_mapping.dtype is not self._slot_dtype
                or cos_sin_cache is not self._cos_sin_cache
                or (n and not self._disjoint(q_in, kv, k_cache, slot_mapping, positions, n, m, micro_batch))
                # a lazily negated view (k_cache and cos_sin_cache: the objects the last full check took)
                or is_neg(q_in) or is_neg(kv) or is_neg(slot_mapping) or is_neg(positions)
            )  # fmt: skip
        except (AttributeError, TypeError, IndexError):  # not tensors of the ranks a call takes
            stale = True
        if stale:
            self._full_check(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch)
            n = q_in.shape[0]
            self._use_slot_dtype(slot_mapping.dtype)
            self._fast = self._native_call()
        if self.in_place:
            out, views = q_in, None
        else:
            try:
                out, views, _ = self._out[micro_batch]
            except (KeyError, TypeError):
                self._check_micro_batch(micro_batch)
                raise
        if n == 0:  # (the kernel's view of an FP8 q_out is uint8: hand back the caller's dtype)
            return out[:0].view(torch.float8_e4m3fn) if self.q_scale is not None else out[:0]
        fn, tail = self._calls[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(n), inlined
        try:
            fn(q_in, kv, out, k_cache, slot_mapping, positions, cos_sin_cache, *tail)
        except Exception as exc:
            self._full_check(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch)
            raise InputError(f"kernel argument check failed: {exc}") from exc
        if views is None:
            return out
        v = views.get(n)
        return v if v is not None else self._view(n, micro_batch)

    def _view(self, n: int, micro_batch: int) -> torch.Tensor:
        """The q_out view returned for n tokens, made once per (micro-batch, n)."""
        views = self._out[micro_batch][1]
        v = views.get(n)
        if v is None:
            v = views[n] = self.pool.view(
                n,
                padded_heads=self.p,
                head_dim=self.head_dim,
                dtype=torch.float8_e4m3fn if self.q_scale is not None else self.dtype,
                micro_batch=micro_batch,
                device=self.device,
            )
        return v

    def _native_call(self):
        """The native plan's call for the state the last full check accepted (None without the module)."""
        outs = tuple(self._out[mb] for mb in range(len(self.buffers)))
        plan = ops.native_plan(
            "bound_qkv_plan", self._calls, self.h, self.capacity, self.in_place, self._q_row, self._kv_row,
            self._slot_bits, self._k_cache, self._k_range, self._cos_sin_cache,
            outs, self._fixed,
        )  # fmt: skip
        return None if plan is None else plan.bound_qkv

    def _disjoint(self, q_in, kv, k_cache, slot_mapping, positions, n, m, micro_batch) -> bool:
        """The per-call overlap check (n >= 1): what this call writes (the micro-batch's scratch buffer,
        or q_in in place; k_cache, at the range its full check computed while its data pointer is the
        same) is disjoint from every input. False sends the call to the full check, which raises if
        they overlap."""
        try:
            k0, k1 = self._k_range
            ptr = ops.data_ptr
            if ptr(k_cache) != k0:
                return False
            qi, kp, sp, pp = ptr(q_in), ptr(kv), ptr(slot_mapping), ptr(positions)
            q_end = qi + (n - 1) * 2 * q_in.stride()[0] + self._q_row
            inputs = (
                (kp, kp + (n - 1) * 2 * kv.stride()[0] + self._kv_row),
                (sp, sp + slot_mapping.nbytes),
                (pp, pp + 8 * n),
            )
            if self.in_place:
                return overlap.disjoint(qi, q_end, k0, k1, inputs + self._fixed)
            w0, w1 = self._out[micro_batch][2]
            return overlap.disjoint(w0, w1, k0, k1, inputs + ((qi, q_end),))
        except (KeyError, AttributeError, TypeError, ValueError, IndexError):
            return False

    def _check_micro_batch(self, micro_batch) -> None:
        if not isinstance(micro_batch, int) or not 0 <= micro_batch < max(1, len(self.buffers)):
            raise InputError(
                f"micro_batch={micro_batch!r} but {len(self.buffers)} micro-batch buffers are bound"
            )

    def _full_check(self, q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch):
        if self._invalid is not None:
            raise ScratchError(f"this bound op can no longer be called: {self._invalid}")
        self._check_micro_batch(micro_batch)
        check_bound_tensor("q_in", q_in, (None, self.h, self.head_dim), self.dtype)
        check_bound_tensor("cos_sin_cache", cos_sin_cache, (None, self.rope_dim), torch.float32)
        n = q_in.shape[0]
        if self.in_place:
            q_out = q_in
        else:
            if n > self.capacity:
                raise ScratchError(
                    f"{n} tokens exceed the {self.capacity} reserved in the scratch pool (locked: "
                    f"{self.pool.locked}); reserve max_num_batched_tokens at profile time"
                )
            q_out = self.buffers[micro_batch][: max(n, 1)]
            if self.q_scale is not None:
                q_out = q_out.view(torch.float8_e4m3fn)
        validate.check_qkv(
            q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, self.eps, self.block_size,
            self.cache_format, q_scale=self.q_scale, kv_scale=self.kv_scale, q_layout=self.q_layout,
        )  # fmt: skip
        fixed = {"cos_sin_cache": cos_sin_cache, "kv_scale": self.kv_scale, "q_scale": self.q_scale}
        for b in self.buffers:  # every micro-batch's: the per-call check does not look at these again
            overlap.check_disjoint({"q_out": b}, fixed)
        self._k_cache, self._k_range = k_cache, overlap.byte_range(k_cache)
        self._cos_sin_cache = cos_sin_cache
        self._fixed = tuple(overlap.byte_range(t) for t in fixed.values() if t is not None)


def bind(
    *,
    num_heads: int,
    padded_heads: int | None = None,
    head_dim: int = 512,
    rope_dim: int = 64,
    cache_format: str = "fp8_ds_mla",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int,
    pool: ScratchPool | None = None,
    micro_batches: int = 1,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    checked: bool = True,
    numerics=None,
    apply_q_norm: bool = True,
    apply_q_rope: bool = True,
    q_layout: str = "head_major",
    device=None,
    config: LaunchConfig | None = None,
    runtime: Runtime | None = None,
) -> BoundOp:
    """Bind qnorm_rope_kv_insert to one layer (once per layer, at startup); call the result per step:
    `q_out = op(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch=0)` (docs/op.md §3).

    num_heads: H, the query heads of q_in. padded_heads: P >= H, the heads of q_out (None: H). With a
    `pool`, q_out is a [N, P, D] view of the pool's zero-once buffer for this (P, D, dtype, device),
    one per micro-batch (`micro_batches` of them); without one, Q is written in place into q_in (needs
    P == H and no q_scale). head_dim, rope_dim: D and R. cache_format: the KV cache's format
    (attn_prologue.FORMATS); block_size: tokens per cache page. dtype: the I/O dtype (bfloat16 or
    float16). eps: the RMSNorm epsilon. kv_scale: the fp8_tensor format's one-element float32 scale;
    q_scale: one-element float32, makes q_out float8_e4m3fn (the pool then holds an FP8 buffer).
    checked: range-check slots and positions per row (counted in `op.errors`). numerics: the KV
    path's parity choices (formats.Numerics or its string form; None: the format's defaults).
    apply_q_norm / apply_q_rope False skip that Q step; q_layout "interleaved": FlashMLA's
    chunk-interleaved q_out (P in 64, 128; needs a pool). device: a CUDA device (None: the current
    one). config: force one LaunchConfig for every token count; runtime: a dispatch.Runtime instead
    of the process-wide one.

    Resolves the variant, loads its kernels (and runs a first-use self-test where it has one) and
    claims the pool's buffers now: InputError / UnsupportedError / ScratchError here, before any
    call. The call allocates nothing and is CUDA-graph capturable after its first eager call."""
    return BoundOp(
        num_heads=num_heads, padded_heads=padded_heads, head_dim=head_dim, rope_dim=rope_dim,
        cache_format=cache_format, dtype=dtype, block_size=block_size, pool=pool, micro_batches=micro_batches,
        eps=eps, kv_scale=kv_scale, q_scale=q_scale, checked=checked, numerics=numerics,
        apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout, device=device, config=config,
        runtime=runtime,
    )  # fmt: skip


def bind_kv(
    *,
    head_dim: int = 512,
    rope_dim: int = 64,
    cache_format: str = "fp8_ds_mla",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_scale: torch.Tensor | None = None,
    compress_ratio: int = 1,
    checked: bool = True,
    numerics=None,
    device=None,
    config: LaunchConfig | None = None,
    runtime: Runtime | None = None,
) -> BoundKvOp:
    """Bind kv_rope_insert to one layer's cache; call the result per step:
    `op(kv, k_cache, slot_mapping, positions, cos_sin_cache)` (docs/op.md §2, `kv_rope_insert`).

    head_dim, rope_dim: D and R; cache_format, block_size, dtype, kv_scale, checked, numerics, device,
    config, runtime: as for `bind`. norm_weight: a [D] tensor in the I/O dtype: a weighted RMSNorm
    (with `eps`) before RoPE (the indexer-key writer). compress_ratio r > 1: the compressed-cache
    writer: only rows with (positions[t] + 1) % r == 0 are inserted, rotated at positions[t] // r * r.
    Resolves and loads the kernels now (InputError / UnsupportedError here)."""
    return BoundKvOp(
        head_dim=head_dim, rope_dim=rope_dim, cache_format=cache_format, dtype=dtype, block_size=block_size,
        norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, compress_ratio=compress_ratio, checked=checked,
        numerics=numerics, device=device, config=config, runtime=runtime,
    )  # fmt: skip
