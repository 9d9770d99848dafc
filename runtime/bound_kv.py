"""The bound KV-only op (`attn_prologue.bind_kv`): kv_rope_insert bound to one layer's cache."""

from __future__ import annotations

import torch

from . import ops, overlap, validate
from .binding import SlotWidthCalls, bind_device, check_bind_args, check_bound_tensor
from .dispatch import MAX_BUCKET_LOG2, Runtime, default_runtime
from .errors import InputError
from .formats import get_format
from .launch import LaunchConfig
from .ops import is_neg
from .variants import Op, Request


class BoundKvOp(SlotWidthCalls):
    """kv_rope_insert bound to one layer's cache: the KV-only call (DeepSeek-V4.1 on SM100), the
    compressed-cache writer (compress_ratio > 1) and, with norm_weight, the indexer-key writer (made by
    `bind_kv`, whose docstring says what each argument is)."""

    def __init__(
        self,
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
    ):
        io = check_bind_args(dtype, eps, head_dim=head_dim, rope_dim=rope_dim, block_size=block_size)
        device = bind_device(device, "bind_kv")
        validate.check_compress_ratio(cache_format, compress_ratio)
        fmt = get_format(cache_format)
        flags = fmt.numerics_flags(numerics)
        if fmt.needs_tensor_scale and kv_scale is None:
            raise InputError(f"cache format {cache_format} needs kv_scale")
        rt = runtime or default_runtime()
        op = Op.KV_NORM if norm_weight is not None else Op.KV
        self._request, self._config, self._rt = Request(op, head_dim, rope_dim, cache_format, io), config, rt
        self.device, self.block_size, self.cache_format, self.eps = (
            device,
            block_size,
            cache_format,
            float(eps),
        )
        self.head_dim, self.rope_dim, self.dtype = head_dim, rope_dim, dtype
        self.norm_weight, self.kv_scale, self.compress_ratio = norm_weight, kv_scale, compress_ratio
        # the caller's tensors (and the bound kv_scale), then what every call passes after them
        self._lead = ops.leading(("kv", "norm_weight", *ops.KV_TENSORS[1:]) if norm_weight is not None
                                 else ops.KV_TENSORS, kv_scale, None)  # fmt: skip
        self._values = dict(
            errors=rt.errors_buffer(device), block_size=block_size, checked=1 if checked else 0,
            numerics=flags, compress_ratio=compress_ratio, **({"eps": self.eps} if norm_weight is not None else {}),
        )  # fmt: skip
        self._calls_by_dtype: dict = {}
        self._launch_args = {"numerics": flags, "compress_ratio": compress_ratio}
        self._use_slot_dtype(torch.int64)  # binds (and self-tests) now: UnsupportedError early
        self._k_cache, self._k_range, self._fast = None, (0, 0), None
        self._fixed = tuple(overlap.byte_range(t) for t in (norm_weight, kv_scale) if t is not None)

    def __call__(self, kv, k_cache, slot_mapping, positions, cos_sin_cache) -> None:
        """Insert rows t < len(slot_mapping) (group-boundary rows only with compress_ratio > 1).
        Checked per call: M <= rows of kv and of positions, a cos_sin_cache with rows and the bound R,
        overlap between k_cache and every input; the whole argument list when k_cache or the slot-id
        dtype is not the last call's. The compiled function checks the rest. The native plan does the
        same in C."""
        fast = self._fast
        if fast is not None and fast(kv, k_cache, slot_mapping, positions, cos_sin_cache):
            return
        try:
            m = slot_mapping.shape[0]
            stale = (
                m > kv.shape[0]
                or m > positions.shape[0]
                or cos_sin_cache.shape[0]
                < 1  # a table without rows, or for another R: the full check says so
                or cos_sin_cache.shape[1] != self.rope_dim
                or k_cache is not self._k_cache
                or slot_mapping.dtype is not self._slot_dtype
                or not self._disjoint(kv, k_cache, slot_mapping, positions, cos_sin_cache)
                # a lazily negated view (k_cache: the object the last full check took)
                or is_neg(kv) or is_neg(slot_mapping) or is_neg(positions) or is_neg(cos_sin_cache)
            )  # fmt: skip
        except (AttributeError, TypeError, IndexError):  # not tensors of the ranks a call takes
            stale = True
        if stale:
            self._full_check(kv, k_cache, slot_mapping, positions, cos_sin_cache)
            m = slot_mapping.shape[0]
            self._use_slot_dtype(slot_mapping.dtype)
            plan = ops.native_plan(
                "bound_kv_plan", self._calls, self._slot_bits, self.rope_dim, k_cache,
                self._k_range, self.norm_weight, self.kv_scale, self._fixed,
            )  # fmt: skip
            self._fast = None if plan is None else plan.bound_kv
        if m == 0:
            return
        fn, tail = self._calls[min((m - 1).bit_length(), MAX_BUCKET_LOG2)]  # bucket_index(m), inlined
        norm = () if self.norm_weight is None else (self.norm_weight,)
        scale = () if self.kv_scale is None else (self.kv_scale,)
        try:
            fn(kv, *norm, k_cache, slot_mapping, positions, cos_sin_cache, *scale, *tail)
        except Exception as exc:
            self._full_check(kv, k_cache, slot_mapping, positions, cos_sin_cache)
            raise InputError(f"kernel argument check failed: {exc}") from exc

    def _disjoint(self, kv, k_cache, slot_mapping, positions, cos_sin_cache) -> bool:
        """The per-call overlap check: k_cache, at the range its full check computed while its
        data pointer is the same, is disjoint from kv, the ids, positions, cos_sin_cache and the bound
        norm weight and scale. False sends the call to the full check, which raises if they overlap."""
        try:
            k0, k1 = self._k_range
            ptr = ops.data_ptr
            if ptr(k_cache) != k0:
                return False
            kp, sp, pp, cp = ptr(kv), ptr(slot_mapping), ptr(positions), ptr(cos_sin_cache)
            inputs = (
                (kp, kp + (m - 1) * 2 * kv.stride()[0] + 2 * kv.shape[1] if (m := kv.shape[0]) else kp),
                (sp, sp + slot_mapping.nbytes),
                (pp, pp + 8 * positions.shape[0]),
                (cp, cp + cos_sin_cache.nbytes),
            )
            return overlap.disjoint(k0, k1, 0, 0, inputs + self._fixed)
        except (AttributeError, TypeError, ValueError, IndexError):
            return False

    def _full_check(self, kv, k_cache, slot_mapping, positions, cos_sin_cache) -> None:
        check_bound_tensor("kv", kv, (None, self.head_dim), self.dtype)
        check_bound_tensor("cos_sin_cache", cos_sin_cache, (None, self.rope_dim), torch.float32)
        validate.check_kv(
            kv, k_cache, slot_mapping, positions, cos_sin_cache, self.block_size, self.cache_format,
            norm_weight=self.norm_weight, eps=self.eps, kv_scale=self.kv_scale, compress_ratio=self.compress_ratio,
        )  # fmt: skip
        self._k_cache, self._k_range = k_cache, overlap.byte_range(k_cache)
