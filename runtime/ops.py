"""Binding a variant to a device and calling it: validation, argument order, launch.

`Kernel` is the bound form of one (variant, config, target). Validation of the caller's tensors
happens in `check_*` functions before anything is written; a launch then costs one call of the
TVM-FFI function (torch tensors are passed as DLPack, on the current torch stream).
"""

from __future__ import annotations

import threading

import torch

from . import dispatch, selftest
from .errors import InputError, UnsupportedError
from .formats import get_format
from .kernel_cache import KernelCache, KernelKey
from .launch import LaunchConfig

IO_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
FP8 = torch.float8_e4m3fn

_default_cache: KernelCache | None = None
_errors_buffers: dict[int, torch.Tensor] = {}
_state_lock = threading.Lock()


def default_cache() -> KernelCache:
    global _default_cache
    if _default_cache is None:
        _default_cache = KernelCache()
    return _default_cache


def errors_buffer(device: torch.device) -> torch.Tensor:
    """Per-device int32[2] counters of rows skipped in checked mode: [kv rows, q tokens]."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    buf = _errors_buffers.get(idx)
    if buf is None:
        with _state_lock:
            buf = _errors_buffers.get(idx)
            if buf is None:
                buf = torch.zeros(2, dtype=torch.int32, device=torch.device("cuda", idx))
                _errors_buffers[idx] = buf
    return buf


_sm_counts: dict = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _sm_counts.get(idx)
    if n is None:
        n = _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def device_target(device: torch.device) -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(device)
    return dispatch.target_for_capability(major, minor)


class Kernel:
    """One compiled kernel bound to a target: `kernel(**arguments)` launches it."""

    def __init__(self, variant: str, config: LaunchConfig, target: str, cache: KernelCache | None = None):
        self.info = dispatch.variant_info(variant)
        self.config = config
        self.target = target
        self.key = KernelKey(variant, config, target)
        self.fn = (cache or default_cache()).load(self.key)
        self.signature = self.info.signature
        # persistent configs cap the grid at ctas_per_sm x SMs of the current device
        self.max_ctas = (
            config.ctas_per_sm * sm_count(torch.device("cuda", torch.cuda.current_device()))
            if config.ctas_per_sm
            else 0
        )

    def __call__(self, **arguments) -> None:
        arguments.setdefault("max_ctas", self.max_ctas)
        self.fn(*[arguments[name] for name in self.signature])

    def __repr__(self) -> str:
        return f"Kernel({self.info.name}, {self.config.key}, {self.target})"


# ---- validation ---------------------------------------------------------------------------------
def _fail(msg: str):
    raise InputError(msg)


def _check_cuda(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, expected {device} (all tensors must be on the same CUDA device)")


def _check_aligned(name: str, t: torch.Tensor, align: int) -> None:
    if t.data_ptr() % align:
        _fail(
            f"{name} data pointer must be {align}-byte aligned (got address % {align} = {t.data_ptr() % align})"
        )


def _check_rows(name: str, t: torch.Tensor, ndim: int, head_dim: int, dtype) -> None:
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(f"{name} dtype must be {dtype}, got {t.dtype}")
    if t.shape[-1] != head_dim:
        _fail(f"{name} last dim must be head_dim={head_dim}, got {t.shape[-1]}")
    if t.stride(-1) != 1 or (ndim == 3 and t.stride(1) != head_dim and t.shape[1] > 1):
        _fail(f"{name} must be contiguous within a row (strides {t.stride()}, need (*, {head_dim}, 1))")
    if t.shape[0] > 1 and t.stride(0) % 8:
        _fail(f"{name} row stride {t.stride(0)} must be a multiple of 8 elements (16 bytes)")
    _check_aligned(name, t, 16)


def check_common(
    *,
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size: int,
    cache_format: str,
    head_dim: int,
    rope_dim: int,
    io_dtype,
    device: torch.device,
    n_tokens: int,
    kv_scale=None,
    norm_weight=None,
) -> None:
    """Checks shared by every op; n_tokens is the row count positions must have."""
    fmt = get_format(cache_format)
    if not fmt.supports_head_dim(head_dim, rope_dim):
        raise UnsupportedError(
            f"cache format {cache_format} stores D={fmt.head_dim}/R={fmt.rope_dim} records, not "
            f"D={head_dim}/R={rope_dim}"
        )
    dispatch.require_shape(head_dim, rope_dim, cache_format)
    for name, t in (
        ("kv", kv),
        ("k_cache", k_cache),
        ("slot_mapping", slot_mapping),
        ("positions", positions),
        ("cos_sin_cache", cos_sin_cache),
    ):
        _check_cuda(name, t, device)
    _check_rows("kv", kv, 2, head_dim, io_dtype)
    if (
        slot_mapping.dtype != torch.int64
        or slot_mapping.dim() != 1
        or (slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1)
    ):
        _fail(
            f"slot_mapping must be a contiguous 1-D int64 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if (
        positions.dtype != torch.int64
        or positions.dim() != 1
        or (positions.numel() > 1 and positions.stride(0) != 1)
    ):
        _fail(
            f"positions must be a contiguous 1-D int64 tensor, got {positions.dtype} {tuple(positions.shape)}"
        )
    if positions.shape[0] != n_tokens:
        _fail(f"positions has {positions.shape[0]} rows, expected {n_tokens} (one per token)")
    m = slot_mapping.shape[0]
    if m > kv.shape[0]:
        _fail(f"slot_mapping has {m} rows but kv has only {kv.shape[0]} (need M <= rows of kv)")
    if m > n_tokens:
        _fail(f"slot_mapping has {m} rows, more than the {n_tokens} tokens")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        _fail(
            f"cos_sin_cache must be float32 [max_pos, {rope_dim}], got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.is_contiguous():
        _fail("cos_sin_cache must be contiguous")
    _check_aligned("cos_sin_cache", cos_sin_cache, 16)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        _fail(f"block_size must be a positive int, got {block_size!r}")
    if k_cache.dtype != torch.uint8 or k_cache.dim() != 2:
        _fail(
            f"k_cache must be a 2-D uint8 view [num_blocks, block_bytes], got {k_cache.dtype} {tuple(k_cache.shape)}"
        )
    if k_cache.shape[0] > 0 and (k_cache.stride(1) != 1 or (k_cache.shape[0] > 1 and k_cache.stride(0) % 16)):
        _fail(
            f"k_cache must have byte stride 1 and a block stride that is a multiple of 16, got strides {k_cache.stride()}"
        )
    need = fmt.block_bytes(head_dim, block_size)
    if k_cache.shape[1] < need:
        _fail(
            f"k_cache block holds {k_cache.shape[1]} bytes but block_size={block_size} {cache_format} tokens need {need} "
            f"({fmt.bytes_per_token(head_dim)} per token): block_size is inconsistent with the cache"
        )
    if k_cache.shape[0] > 1 and k_cache.stride(0) < need:
        _fail(f"k_cache block stride {k_cache.stride(0)} is smaller than the {need} bytes of a block")
    _check_aligned("k_cache", k_cache, 16)
    if fmt.needs_tensor_scale:
        if kv_scale is None:
            _fail(f"cache format {cache_format} needs kv_scale (a float32 CUDA tensor with one element)")
        _check_scale("kv_scale", kv_scale, device)
    elif kv_scale is not None:
        _fail(f"cache format {cache_format} takes no kv_scale")
    if norm_weight is not None:
        _check_cuda("norm_weight", norm_weight, device)
        if (
            norm_weight.dtype != io_dtype
            or norm_weight.shape != (head_dim,)
            or not norm_weight.is_contiguous()
        ):
            _fail(
                f"norm_weight must be a contiguous [{head_dim}] {io_dtype} tensor, got {norm_weight.dtype} {tuple(norm_weight.shape)}"
            )
        _check_aligned("norm_weight", norm_weight, 16)


def _check_scale(name: str, t, device) -> None:
    _check_cuda(name, t, device)
    if t.dtype != torch.float32 or t.numel() != 1:
        _fail(f"{name} must be a float32 tensor with one element, got {t.dtype} {tuple(t.shape)}")


def check_qkv(
    q_in,
    kv,
    q_out,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    eps,
    block_size,
    cache_format,
    *,
    q_scale=None,
    kv_scale=None,
):
    """Validate a qnorm_rope_kv_insert call; returns (device, io dtype name, H, P)."""
    if not isinstance(q_in, torch.Tensor):
        _fail(f"q_in must be a torch.Tensor, got {type(q_in).__name__}")
    device = q_in.device
    io = IO_DTYPES.get(q_in.dtype)
    if io is None:
        _fail(f"q_in dtype must be bfloat16 or float16, got {q_in.dtype}")
    if q_in.dim() != 3:
        _fail(f"q_in must be [N, H, D], got shape {tuple(q_in.shape)}")
    n, h, d = q_in.shape
    rope_dim = (
        cos_sin_cache.shape[-1]
        if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() == 2
        else -1
    )
    _check_rows("q_in", q_in, 3, d, q_in.dtype)
    _check_cuda("q_out", q_out, device)
    out_dtype = FP8 if q_scale is not None else q_in.dtype
    if q_out.dtype != out_dtype:
        hint = " (an FP8 q_out needs q_scale)" if q_out.dtype == FP8 else ""
        _fail(f"q_out dtype must be {out_dtype}, got {q_out.dtype}{hint}")
    if q_out.dim() != 3 or q_out.shape[2] != d:
        _fail(f"q_out must be [N', P, {d}], got shape {tuple(q_out.shape)}")
    if q_out.shape[0] < n:
        _fail(f"q_out has {q_out.shape[0]} rows, fewer than the {n} tokens of q_in")
    p = q_out.shape[1]
    if p < h:
        _fail(f"q_out has P={p} heads, fewer than the H={h} heads of q_in (need P >= H)")
    if (
        q_out.stride(2) != 1
        or (p > 1 and q_out.stride(1) != d)
        or (q_out.shape[0] > 1 and q_out.stride(0) % 16)
    ):
        _fail(f"q_out must be [N', P, D] with rows contiguous (strides {q_out.stride()})")
    _check_aligned("q_out", q_out, 16)
    if (
        q_out.untyped_storage().data_ptr() == q_in.untyped_storage().data_ptr()
        and q_out.numel()
        and q_in.numel()
    ):
        if p != h or q_out.data_ptr() != q_in.data_ptr() or q_out.stride() != q_in.stride():
            _fail("q_out may alias q_in only when it is the same tensor (in place, P == H)")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 2 or kv.shape[0] != n:
        _fail(
            f"kv must be [N, D] with one row per token: got {tuple(getattr(kv, 'shape', ()))} for {n} tokens of q_in"
        )
    if q_scale is not None:
        _check_scale("q_scale", q_scale, device)
    if not isinstance(eps, (float, int)) or not eps >= 0:
        _fail(f"eps must be a non-negative float, got {eps!r}")
    check_common(
        kv=kv,
        k_cache=k_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        block_size=block_size,
        cache_format=cache_format,
        head_dim=d,
        rope_dim=rope_dim,
        io_dtype=q_in.dtype,
        device=device,
        n_tokens=n,
        kv_scale=kv_scale,
    )
    return device, io, h, p


def check_kv(
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size,
    cache_format,
    *,
    norm_weight=None,
    eps=1e-6,
    kv_scale=None,
):
    if not isinstance(kv, torch.Tensor):
        _fail(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    io = IO_DTYPES.get(kv.dtype)
    if io is None:
        _fail(f"kv dtype must be bfloat16 or float16, got {kv.dtype}")
    if kv.dim() != 2:
        _fail(f"kv must be [M, D], got shape {tuple(kv.shape)}")
    rope_dim = (
        cos_sin_cache.shape[-1]
        if isinstance(cos_sin_cache, torch.Tensor) and cos_sin_cache.dim() == 2
        else -1
    )
    if not isinstance(eps, (float, int)) or not eps >= 0:
        _fail(f"eps must be a non-negative float, got {eps!r}")
    check_common(
        kv=kv,
        k_cache=k_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        block_size=block_size,
        cache_format=cache_format,
        head_dim=kv.shape[1],
        rope_dim=rope_dim,
        io_dtype=kv.dtype,
        device=kv.device,
        n_tokens=positions.shape[0] if isinstance(positions, torch.Tensor) and positions.dim() == 1 else -1,
        kv_scale=kv_scale,
        norm_weight=norm_weight,
    )
    return kv.device, io


# ---- one-call entry points ------------------------------------------------------------------------
# The hot path: the checks TVM-FFI cannot do (M <= N, N' >= N, P >= H, the cache block size, a uint8
# cache: it lets an int8 one through), a dict hit for the bound kernel, one call. TVM-FFI itself
# checks dtypes, ranks, D, strides, 16-byte alignment, devices and that q_in, kv and positions have
# the same row count (one symbolic token count in the compiled signature) before launching; when it
# (or the cheap checks) refuse a call, the full Python validation raises a typed InputError naming it.
_bound: dict[tuple, Kernel] = {}
MAX_BUCKET_LOG2 = 15  # token-count buckets 1, 2, 4, ... 32768 (larger counts use the last)
_tuning_table: dict | None = None


def tuning_table() -> dict:
    """(variant, bucket) -> {(heads, heads written): LaunchConfig} from the tuning database for this
    GPU (empty without one)."""
    global _tuning_table
    if _tuning_table is None:
        from . import tuning

        try:
            db = tuning.TuningDatabase.load(tuning.database_path())
            _tuning_table = db.table_for(tuning.current_environment()) if db.entries else {}
        except Exception as exc:  # a broken database never breaks serving
            import warnings

            warnings.warn(f"tuning database not used: {exc}", tuning.TuningDatabaseWarning)
            _tuning_table = {}
    return _tuning_table


def kernel_for(
    device: torch.device,
    *,
    op: str,
    q_out: str,
    head_dim: int,
    rope_dim: int,
    cache_format: str,
    io: str,
    config: LaunchConfig | None = None,
    conversions: str | None = None,
    n_tokens: int = 1,
    heads: int | None = None,
    written_heads: int | None = None,
) -> Kernel:
    """The kernel for a request: the variant from the dispatcher, the config from (in order) the
    caller, the tuning database entry of the token-count bucket (tuned at these Q heads and heads
    written, or the nearest), the arch's default."""
    from .tuning import bucket_of, heuristic_config, pick

    arch, target = device_target(device)
    name = dispatch.select_variant(
        arch=arch,
        op=op,
        head_dim=head_dim,
        rope_dim=rope_dim,
        cache_format=cache_format,
        io_dtype=io,
        q_out=q_out,
        conversions=conversions,
    )
    name = selftest.resolve(device, name, dispatch.default_config(arch), target)  # first use on this machine
    if config is None:
        bucket = min(bucket_of(n_tokens), 1 << MAX_BUCKET_LOG2)
        config = pick(tuning_table().get((name, bucket)), heads, written_heads) or heuristic_config(
            arch, bucket, dispatch.default_config(arch)
        )
    key = (device, name, config)
    k = _bound.get(key)
    if k is None:
        k = Kernel(name, config, target)
        _bound[key] = k
    return k


def kernels_by_bucket(device, **request) -> list:
    """(kernel function, max_ctas) for every token-count bucket (index = ceil(log2(n)))."""
    return [
        (k.fn, k.max_ctas)
        for k in (kernel_for(device, n_tokens=1 << i, **request) for i in range(MAX_BUCKET_LOG2 + 1))
    ]


_fast_qkv: dict[tuple, tuple] = {}


def _bind_qkv(q_in, cos_sin_cache, cache_format, fp8_out, config, conversions, written_heads=None):
    device = q_in.device
    fns = kernels_by_bucket(
        device,
        heads=q_in.shape[1],
        written_heads=written_heads,
        op="qkv",
        q_out="fp8" if fp8_out else "io",
        head_dim=q_in.shape[2],
        rope_dim=cos_sin_cache.shape[1],
        cache_format=cache_format,
        io=IO_DTYPES[q_in.dtype],
        config=config,
        conversions=conversions,
    )
    fmt = get_format(cache_format)
    return fns, errors_buffer(device), fmt.bytes_per_token(q_in.shape[2]), fmt.needs_tensor_scale


def qnorm_rope_kv_insert(
    q_in,
    kv,
    q_out,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    eps,
    block_size,
    cache_format="fp8_ds_mla",
    *,
    kv_scale=None,
    q_scale=None,
    write_pad_heads=True,
    checked=False,
    config=None,
    conversions=None,
) -> None:
    """Validate, pick the variant for this device and launch it (CUDA tensors)."""
    try:
        n, h, d = q_in.shape
        n_out, p, _ = q_out.shape
        nwh = p if write_pad_heads else h
        key = (
            q_in.get_device(),
            q_in.dtype,
            cache_format,
            d,
            h,
            nwh,
            cos_sin_cache.shape[1],
            q_scale is not None,
            config,
            conversions,
        )
        fns, errors, bpt, needs_scale = _fast_qkv[key]
        ok = (
            slot_mapping.shape[0] <= n
            and n_out >= n
            and p >= h
            and block_size > 0
            and k_cache.shape[1] >= block_size * bpt
            and eps >= 0
            and k_cache.dtype is torch.uint8  # the compiled function accepts an int8 cache (same width)
            and (kv_scale is not None) == needs_scale
            and (p == h or q_out.data_ptr() != q_in.data_ptr())
        )
    except (KeyError, AttributeError, TypeError, ValueError, IndexError):
        ok = False
    if not ok:
        check_qkv(
            q_in,
            kv,
            q_out,
            k_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            eps,
            block_size,
            cache_format,
            q_scale=q_scale,
            kv_scale=kv_scale,
        )
        # valid input: the try block computed the key; only the kernels for it were missing
        if key not in _fast_qkv:
            _fast_qkv[key] = _bind_qkv(
                q_in, cos_sin_cache, cache_format, q_scale is not None, config, conversions, nwh
            )
        fns, errors, bpt, needs_scale = _fast_qkv[key]
    if n == 0:
        return
    fn, max_ctas = fns[min((n - 1).bit_length(), MAX_BUCKET_LOG2)]
    out = q_out if q_scale is None else q_out.view(torch.uint8)
    try:
        if kv_scale is None:
            if q_scale is None:
                fn(
                    q_in,
                    kv,
                    out,
                    k_cache,
                    slot_mapping,
                    positions,
                    cos_sin_cache,
                    errors,
                    eps,
                    block_size,
                    nwh,
                    1 if checked else 0,
                    max_ctas,
                )
            else:
                fn(
                    q_in,
                    kv,
                    out,
                    k_cache,
                    slot_mapping,
                    positions,
                    cos_sin_cache,
                    q_scale,
                    errors,
                    eps,
                    block_size,
                    nwh,
                    1 if checked else 0,
                    max_ctas,
                )
        elif q_scale is None:
            fn(
                q_in,
                kv,
                out,
                k_cache,
                slot_mapping,
                positions,
                cos_sin_cache,
                kv_scale,
                errors,
                eps,
                block_size,
                nwh,
                1 if checked else 0,
                max_ctas,
            )
        else:
            fn(
                q_in,
                kv,
                out,
                k_cache,
                slot_mapping,
                positions,
                cos_sin_cache,
                kv_scale,
                q_scale,
                errors,
                eps,
                block_size,
                nwh,
                1 if checked else 0,
                max_ctas,
            )
    except Exception as exc:  # TVM-FFI refused an argument before launching: say precisely which
        check_qkv(
            q_in,
            kv,
            q_out,
            k_cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            eps,
            block_size,
            cache_format,
            q_scale=q_scale,
            kv_scale=kv_scale,
        )
        raise InputError(f"kernel argument check failed: {exc}") from exc


def kv_rope_insert(
    kv,
    k_cache,
    slot_mapping,
    positions,
    cos_sin_cache,
    block_size,
    cache_format="fp8_ds_mla",
    *,
    norm_weight=None,
    eps=1e-6,
    kv_scale=None,
    checked=False,
    config=None,
    conversions=None,
) -> None:
    device, io = check_kv(
        kv,
        k_cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        block_size,
        cache_format,
        norm_weight=norm_weight,
        eps=eps,
        kv_scale=kv_scale,
    )
    if slot_mapping.shape[0] == 0:
        return
    op = "kv_norm" if norm_weight is not None else "kv"
    k = kernel_for(
        device,
        op=op,
        q_out="io",
        head_dim=kv.shape[1],
        rope_dim=cos_sin_cache.shape[1],
        cache_format=cache_format,
        io=io,
        config=config,
        conversions=conversions,
        n_tokens=slot_mapping.shape[0],
    )
    k(
        kv=kv,
        norm_weight=norm_weight,
        k_cache=k_cache,
        slot_mapping=slot_mapping,
        positions=positions,
        cos_sin_cache=cos_sin_cache,
        kv_scale=kv_scale,
        errors=errors_buffer(device),
        eps=float(eps),
        block_size=block_size,
        checked=int(bool(checked)),
    )
