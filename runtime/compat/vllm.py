"""vLLM's DeepSeek-V4 prologue schemas on top of attn_prologue (docs/vllm.md).

    pool = attn_prologue.ScratchPool()
    pool.reserve(max_tokens=max_num_batched_tokens, padded_heads=128, head_dim=512, micro_batches=1)
    pool.lock()
    vllm_ops = attn_prologue.compat.vllm.register("_C", pool=pool)   # keep it; close() unregisters
    q_padded = torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert(
        q, kv, k_cache, slot_mapping, positions, cos_sin_cache, 128, 1e-6, 64, True, False, True, False)

`register` defines two ops under the engine's namespace: the fused Q+KV op under vLLM's name in one
of three schemas (FORMS), and the KV-only op. Each has a CPU implementation (validation, then the
PyTorch reference), a CUDA one (the kernels) and a fake one (torch.compile traces it without a
graph break), and a plain Python callable (`.qkv`, `.kv_insert`) that calls the implementation
directly in eager mode and the registered op while compiling. Call it after the engine's own
library has loaded (`import vllm._C`): one loading later fails to define the same names, so a
namespace no library has defined yet is refused unless `new_namespace=True` (registration.py).

Where vLLM's allocating form returns a new q_padded, ours returns a view of the pool's buffer for
(device, micro-batch, dtype, P, D): nothing is allocated per call, and the view is valid until the
next call on that micro-batch. The cache format follows the cache's dtype (`_cache_format`); the
parity choices follow the registration's `numerics` (`numerics_by_format`): by default vLLM's preset
("preset=vllm") for the formats it has an entry for and the format's defaults for the others.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops, overlap
from ..errors import InputError, ScratchError, UnsupportedError
from ..formats import FORMATS, get_format
from ..parity import Numerics, NumericsError
from ..presets import PRESETS
from ..scratch import ScratchPool
from ..torch_op import check_traced, lazy_bits_kernel, reference_kv, reference_qkv
from .registration import Registration, check_names

QKV_NAME = "fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert"
KV_NAME = "fused_deepseek_v4_kv_rope_insert"

# The schemas, written from their argument lists. One name, three argument orders: an engine
# registers the one its code calls.
FORMS = {
    # vLLM upstream: allocates and returns q_padded; q_head_padded == 0 is the KV-only call
    "allocating": (
        "(Tensor q, Tensor kv, Tensor(a!) k_cache, Tensor slot_mapping, Tensor positions, "
        "Tensor cos_sin_cache, int q_head_padded, float eps, int block_size, bool apply_q_norm, "
        "bool kv_mxfp8, bool apply_q_rope, bool is_q_interleaved) -> Tensor"
    ),
    # vLLM issue #51743: caller-owned q_out, second
    "q_out_second": (
        "(Tensor q_in, Tensor(a!) q_out, Tensor kv, Tensor(b!) k_cache, Tensor slot_mapping, "
        "Tensor position_ids, Tensor cos_sin_cache, float eps, int cache_block_size) -> ()"
    ),
    # an earlier caller-owned form (a vLLM fork's) and attn_prologue's own order: caller-owned q_out, third
    "q_out_third": (
        "(Tensor q_in, Tensor kv, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor slot_mapping, "
        "Tensor positions, Tensor cos_sin_cache, float eps, int block_size) -> ()"
    ),
}
# vLLM #56441: the KV-only insert
KV_SCHEMA = (
    "(Tensor kv, Tensor(a!) cache, Tensor slots, Tensor positions, Tensor cos_sin_cache, int block_size, "
    "Tensor? fp8_scale, bool kv_mxfp8) -> ()"
)
PAD_HEADS = ("written", "zero_once")
# register()'s default numerics: vLLM's CUDA op's preset ("preset=vllm") for each format it has an
# entry for (fp8_ds_mla, mxfp8), the format's defaults for every other one (bf16, fp8_tensor and any
# cache_format of a caller-owned form: no preset covers vLLM's writers of those)
VLLM_NUMERICS = "vllm"
# the uint8 records the ops write by their arguments alone (kv_mxfp8 picks one): an explicit numerics
# must hold for these (and for a caller-owned form's cache_format) when register() is called
PACKED = ("fp8_ds_mla", "mxfp8")

# every registration made and not closed: a dropped torch.library.Library unregisters its ops (and a
# later override of them would lose its schema), and an engine may well not keep what register() returns
_LIVE: set[VllmOps] = set()


# ---- argument checks of the plain callables (the dispatcher does these for torch.ops calls) ------
@dataclass(frozen=True)
class _Arg:
    name: str
    kind: str  # "Tensor", "Optional[Tensor]", "int", "float" or "bool", as parse_schema spells it


def _spec(schema: str) -> tuple[_Arg, ...]:
    return tuple(_Arg(a.name, str(a.type)) for a in torch._C.parse_schema("compat::spec" + schema).arguments)


_ACCEPTS = {
    "Tensor": lambda v: isinstance(v, Tensor),
    "Optional[Tensor]": lambda v: v is None or isinstance(v, Tensor),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


def _bind(what: str, spec: tuple[_Arg, ...], args: tuple, kwargs: dict) -> tuple:
    """The arguments in schema order, or an InputError naming what is missing, extra or mistyped."""
    if kwargs or len(args) != len(spec):
        if len(args) > len(spec):
            raise InputError(f"{what} takes {len(spec)} arguments, got {len(args)} positional")
        missing = object()
        values = list(args) + [missing] * (len(spec) - len(args))
        index = {a.name: i for i, a in enumerate(spec)}
        for k, v in kwargs.items():
            i = index.get(k)
            if i is None:
                raise InputError(f"{what} has no argument {k!r}; its arguments: {', '.join(index)}")
            if values[i] is not missing:
                raise InputError(f"{what} got argument {k!r} twice")
            values[i] = v
        if any(v is missing for v in values):
            absent = [a.name for a, v in zip(spec, values) if v is missing]
            raise InputError(f"{what} is missing arguments: {', '.join(absent)}")
        args = tuple(values)
    for a, v in zip(spec, args):
        if not _ACCEPTS[a.kind](v):
            raise InputError(f"{what}: {a.name} must be {a.kind}, got {type(v).__name__}")
    return args


# ---- the parity choices per format ---------------------------------------------------------------
def numerics_by_format(numerics, form: str, cache_format: str) -> dict[str, Numerics | None]:
    """Format name -> the numerics its calls pass (None: the format's defaults), for every format.

    VLLM_NUMERICS (the default): Numerics(preset="vllm") where that preset has an entry, None elsewhere;
    never refused. Anything else (a Numerics, its string form, or None / "" for the format defaults)
    applies as given to every format, checked now against the formats the ops write by their
    arguments alone (PACKED, and a caller-owned form's cache_format): NumericsError before anything
    is registered. A format reached only through the cache's dtype or fp8_scale (bf16, fp8_tensor)
    that lacks a choice given raises NumericsError at that call, before anything is written."""
    if isinstance(numerics, str) and numerics == VLLM_NUMERICS:
        vllm = Numerics(preset="vllm")
        covered = PRESETS["vllm"].formats
        return {name: vllm if name in covered else None for name in FORMATS}
    n = Numerics.of(numerics)  # NumericsError for a misspelling or another type
    if n is not None and n.preset is None and not n.given():
        n = None  # "" or Numerics(): the format defaults, as None
    for name in PACKED + ((cache_format,) if form != "allocating" else ()):
        try:
            get_format(name).resolve_numerics(n)
        except NumericsError as exc:
            raise NumericsError(
                f"register(numerics={numerics!r}): the ops of form {form!r} write {name} records, and {exc}"
            ) from None
    return dict.fromkeys(FORMATS, n)


# ---- the cache: format and byte pages from its dtype ---------------------------------------------
def _cache_format(
    cache: Tensor, packed: str, *, kv_mxfp8: bool, fp8_scale: Tensor | None
) -> tuple[str, Tensor]:
    """(our format, the cache as [num_blocks, page_bytes] uint8). uint8 holds packed records: fp8_scale
    given means per-tensor FP8 (`fp8_tensor`), else `packed` (what kv_mxfp8 or the registration
    picks). A bfloat16 cache is the unquantized `bf16` format; a float8_e4m3fn one is `fp8_tensor` and
    needs fp8_scale. MXFP8's block scales leave no place for a per-tensor scale: that is refused."""
    if not isinstance(cache, Tensor):
        raise InputError(f"k_cache must be a torch.Tensor, got {type(cache).__name__}")
    dt = cache.dtype
    if kv_mxfp8 and (fp8_scale is not None or dt is not torch.uint8):
        raise UnsupportedError(
            "kv_mxfp8=True writes MXFP8 records (block scales) into a uint8 cache: no format of ours "
            f"takes a per-tensor fp8_scale or a {dt} cache with it"
        )
    if dt is torch.uint8:
        fmt = "fp8_tensor" if fp8_scale is not None else packed
    elif dt is torch.bfloat16 and fp8_scale is None:
        fmt = "bf16"
    elif dt is torch.float8_e4m3fn and fp8_scale is not None:
        fmt = "fp8_tensor"
    elif dt is torch.float8_e4m3fn:
        raise InputError("a float8_e4m3fn cache holds per-tensor FP8 values: it needs fp8_scale")
    elif dt is torch.bfloat16:
        raise InputError("a bfloat16 cache is unquantized: it takes no fp8_scale")
    else:
        raise InputError(f"the cache must be uint8 (packed records), bfloat16 or float8_e4m3fn, got {dt}")
    if dt is torch.uint8 and cache.dim() == 2:
        return fmt, cache
    # a page per row of bytes: [num_blocks, ...] with each page's elements contiguous (a view, no copy)
    if cache.dim() < 2:
        raise InputError(
            f"the cache must be [num_blocks, ...] with a page per block, got {tuple(cache.shape)}"
        )
    try:
        b = cache.view(torch.uint8)
        return fmt, b.view(cache.shape[0], math.prod(b.shape[1:]))
    except RuntimeError as exc:
        raise InputError(
            f"the cache {tuple(cache.shape)} (strides {cache.stride()}) cannot be read as one row of bytes "
            f"per block without a copy: {exc}"
        ) from None


# ---- the two calls every form makes: CUDA = the kernels, CPU = validation + the reference -------
def _qkv(on_cuda, q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, fmt, numerics, *,
         write_pad_heads=True, apply_q_norm=True, apply_q_rope=True, q_layout="head_major") -> None:  # fmt: skip
    if on_cuda:
        ops.qnorm_rope_kv_insert(
            q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, fmt,
            write_pad_heads=write_pad_heads, numerics=numerics, apply_q_norm=apply_q_norm,
            apply_q_rope=apply_q_rope, q_layout=q_layout,
        )  # fmt: skip
        return
    reference_qkv(
        q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, fmt, numerics=numerics,
        apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout,
        write_pad_heads=write_pad_heads,
    )  # fmt: skip


def _kv(on_cuda, kv, cache, slots, positions, cos_sin, block_size, fmt, kv_scale, numerics) -> None:
    if on_cuda:
        ops.kv_rope_insert(kv, cache, slots, positions, cos_sin, block_size, fmt, kv_scale=kv_scale,
                           numerics=numerics)  # fmt: skip
        return
    reference_kv(kv, cache, slots, positions, cos_sin, block_size, fmt, kv_scale=kv_scale, numerics=numerics)


# ---- q_padded of the allocating form: views of the pool ------------------------------------------
class _Scratch:
    """Hands out [N, P, D] views of the pool's buffers, claimed once per buffer. With pad_heads
    "written" every call writes all P heads, so the view may be written by its reader (inductor
    reuses an op's output buffer for in-place pointwise work) without breaking the next call;
    "zero_once" writes the live heads only, which needs readers that never write the view."""

    def __init__(self, pool: ScratchPool | None, micro_batch, pad_heads: str):
        self.pool, self.micro_batch = pool, micro_batch
        self.writes_pads = pad_heads == "written"
        self._views: dict[tuple, dict[int, Tensor]] = {}  # (device, dtype, P, D, H, layout, mb) -> n -> view

    def invalidate(self, reason: str) -> None:
        """The pool retired a buffer we claimed: forget every view (the next call claims again)."""
        self._views.clear()

    def view(self, q: Tensor, p: int, layout: str) -> Tensor:
        if q.dim() != 3:
            raise InputError(f"q must be [N, H, D], got shape {tuple(q.shape)}")
        n, h, d = q.shape
        if p < h:
            raise InputError(f"q_head_padded={p} is smaller than the {h} heads of q (need P >= H, or 0)")
        mb = self.micro_batch() if callable(self.micro_batch) else self.micro_batch
        key = (q.device, q.dtype, p, d, h, layout, mb)
        views = self._views.get(key)
        v = None if views is None else views.get(n)
        return v if v is not None else self._claim(key, n)

    def _claim(self, key: tuple, n: int) -> Tensor:
        if self.pool is None:
            raise ScratchError(
                "the allocating form writes q_padded into a ScratchPool: register(..., pool=pool) with "
                "a pool reserved for it (only q_head_padded=0, the KV-only call, needs none)"
            )
        device, dtype, p, d, h, layout, mb = key
        where = dict(padded_heads=p, head_dim=d, dtype=dtype, micro_batch=mb, device=device)
        kind = dict(writes_pads=True) if self.writes_pads else dict(q_layout=layout)
        # ScratchError when none is reserved, or when it is claimed for another H, layout or kind
        t = self.pool.claim(h, owner=self, **kind, **where)
        v = self.pool.view(n, **where)  # grows before lock() (we are told), ScratchError after it
        if v.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            self.pool.claim(h, owner=self, **kind, **where)  # the grown buffer: claim it too
        self._views.setdefault(key, {})[n] = v
        return v


# ---- registration ---------------------------------------------------------------------------------
class VllmOps:
    """What `register` returns: the plain callables `qkv` (the registered form) and `kv_insert`, the
    registered ops (`qkv_op`, `kv_op`), `numerics_for(cache_format)` (the parity choices that format's
    calls pass), and `close()` to unregister them."""

    def __init__(self, namespace, form, pool, micro_batch, pad_heads, cache_format, qkv_name, kv_name,
                 numerics: dict[str, Numerics | None], kv_only: bool = False):  # fmt: skip
        self.namespace, self.form, self.pool, self.cache_format = namespace, form, pool, cache_format
        self._numerics = numerics  # numerics_by_format: format -> the object its calls pass (one per format)
        self._scratch = _Scratch(pool, micro_batch, pad_heads)
        self._empty: dict[tuple, Tensor] = {}
        self._registration: Registration | None = None
        impls = {
            "allocating": self._allocating,
            "q_out_second": self._q_out_second,
            "q_out_third": self._q_out_third,
        }
        self._parts = {  # part -> (name, schema, implementation, fake); kv_only: the KV-only op alone
            **({} if kv_only else {"qkv": (qkv_name, FORMS[form], impls[form], _FAKES[form])}),
            "kv": (kv_name, KV_SCHEMA, self._kv_only, _fake_kv),
        }
        self.qkv = None if kv_only else self._plain("qkv")
        self.kv_insert = self._plain("kv")
        self.qkv_op = self.kv_op = None

    # the forms, in their schema's argument order after `on_cuda`
    # (trailing defaults as vLLM's schemas have them: behind vLLM's own op, torch hands a Python kernel
    # only the arguments that differ from the schema's defaults at the end of the list)
    def _allocating(self, on_cuda, q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_head_padded,
                    eps, block_size, apply_q_norm=True, kv_mxfp8=False, apply_q_rope=True,
                    is_q_interleaved=False):  # fmt: skip
        fmt, pages = _cache_format(
            k_cache, "mxfp8" if kv_mxfp8 else "fp8_ds_mla", kv_mxfp8=kv_mxfp8, fp8_scale=None
        )
        if q_head_padded == 0:  # no Q: q is not read
            _kv(on_cuda, kv, pages, slot_mapping, positions, cos_sin_cache, block_size, fmt, None,
                self._numerics[fmt])  # fmt: skip
            return self._no_q(kv)
        if q_head_padded < 0:
            raise InputError(f"q_head_padded must be >= 0, got {q_head_padded}")
        layout = "interleaved" if is_q_interleaved else "head_major"
        q_out = self._scratch.view(q, q_head_padded, layout)
        _qkv(on_cuda, q, kv, q_out, pages, slot_mapping, positions, cos_sin_cache, eps, block_size, fmt,
             self._numerics[fmt], write_pad_heads=self._scratch.writes_pads, apply_q_norm=apply_q_norm,
             apply_q_rope=apply_q_rope, q_layout=layout)  # fmt: skip
        return q_out

    def _no_q(self, kv: Tensor) -> Tensor:
        """The KV-only call's q_padded: [N, 0, D], made once per (device, dtype, N, D) so that later
        calls create nothing at all (it has no element to write)."""
        key = (kv.device, kv.dtype, kv.shape[0], kv.shape[1])
        out = self._empty.get(key)
        if out is None:
            out = self._empty[key] = kv.new_empty((kv.shape[0], 0, kv.shape[1]))
        return out

    def _q_out_second(self, on_cuda, q_in, q_out, kv, k_cache, slot_mapping, position_ids, cos_sin_cache,
                      eps, cache_block_size):  # fmt: skip
        fmt, pages = _cache_format(k_cache, self.cache_format, kv_mxfp8=False, fp8_scale=None)
        _qkv(on_cuda, q_in, kv, q_out, pages, slot_mapping, position_ids, cos_sin_cache, eps,
             cache_block_size, fmt, self._numerics[fmt])  # fmt: skip

    def _q_out_third(self, on_cuda, q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache,
                     eps, block_size):  # fmt: skip
        fmt, pages = _cache_format(k_cache, self.cache_format, kv_mxfp8=False, fp8_scale=None)
        _qkv(on_cuda, q_in, kv, q_out, pages, slot_mapping, positions, cos_sin_cache, eps, block_size, fmt,
             self._numerics[fmt])  # fmt: skip

    def _kv_only(self, on_cuda, kv, cache, slots, positions, cos_sin_cache, block_size, fp8_scale=None,
                 kv_mxfp8=False):  # fmt: skip
        fmt, pages = _cache_format(
            cache, "mxfp8" if kv_mxfp8 else "fp8_ds_mla", kv_mxfp8=kv_mxfp8, fp8_scale=fp8_scale
        )
        numerics = self._numerics[fmt]
        _kv(on_cuda, kv, pages, slots, positions, cos_sin_cache, block_size, fmt, fp8_scale, numerics)

    def numerics_for(self, cache_format: str) -> Numerics | None:
        """The parity choices this registration's calls pass for a cache format (None: its defaults)."""
        get_format(cache_format)  # UnknownFormatError for a name that is no format
        return self._numerics[cache_format]

    def _plain(self, part: str) -> Callable:
        name, schema, impl, _ = self._parts[part]
        spec, what = _spec(schema), f"{self.namespace}::{name}"

        def call(*args, **kwargs):
            if torch.compiler.is_compiling():  # traced: the registered op (its fake gives the shapes)
                return getattr(self, f"{part}_op")(*args, **kwargs)
            values = _bind(what, spec, args, kwargs)
            # like the dispatcher: any CUDA tensor argument selects the kernels
            return impl(any(isinstance(v, Tensor) and v.is_cuda for v in values), *values)

        call.__name__, call.__qualname__ = name, name
        call.__doc__ = f"{what}{schema} (attn_prologue.compat.vllm, form {self.form!r})"
        call.__signature__ = inspect.Signature(  # what help() shows: the schema's argument names
            [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in spec]
        )
        return call

    def _register(self, override: bool) -> None:
        self._registration = Registration(self.namespace)
        for part, (name, schema, impl, fake) in self._parts.items():
            kernels = {
                "CPU": lambda *a, _impl=impl: _impl(False, *a),
                "CUDA": lambda *a, _impl=impl: _impl(True, *a),
            }
            self._registration.add(name, schema, kernels, fake, override=override)
            lazy = lazy_bits_kernel(getattr(getattr(torch.ops, self.namespace), name).default)
            self._registration.add_kernels(name, {"Negative": lazy, "Conjugate": lazy})
            setattr(self, f"{part}_op", getattr(getattr(torch.ops, self.namespace), name))

    def close(self) -> None:
        """Unregister our kernels (an op this registration overrode gets the kernels it had before back;
        one another registration of the same name uses stays defined)."""
        if self._registration is not None:
            self._registration.close()
        _LIVE.discard(self)


# The fake implementations (what torch.compile traces with; refuse real meta tensors): the overlap
# rules on the fake tensors' storages, in each form's argument order, and the allocating form's output.
def _fake_allocating(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_head_padded, *_):
    inputs = dict(kv=kv, slot_mapping=slot_mapping, positions=positions, cos_sin_cache=cos_sin_cache)
    if q_head_padded != 0:  # (q is not read by the KV-only call)
        inputs["q"] = q
    check_traced(
        lambda k_cache, **ins: overlap.check_disjoint({"k_cache": k_cache}, ins), k_cache=k_cache, **inputs
    )
    if q_head_padded == 0:
        return kv.new_empty((kv.shape[0], 0, kv.shape[1]))
    return q.new_empty((q.shape[0], q_head_padded, q.shape[2]))


def _fake_q_out_second(q_in, q_out, kv, k_cache, slot_mapping, position_ids, cos_sin_cache, *_):
    check_traced(overlap.check_qkv, q_in=q_in, kv=kv, q_out=q_out, k_cache=k_cache, slot_mapping=slot_mapping,
                 positions=position_ids, cos_sin_cache=cos_sin_cache, kv_scale=None, q_scale=None)  # fmt: skip


def _fake_q_out_third(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, *_):
    _fake_q_out_second(q_in, q_out, kv, k_cache, slot_mapping, positions, cos_sin_cache)


def _fake_kv(kv, cache, slots, positions, cos_sin_cache, block_size, fp8_scale, *_):
    check_traced(overlap.check_kv, kv=kv, norm_weight=None, k_cache=cache, slot_mapping=slots,
                 positions=positions, cos_sin_cache=cos_sin_cache, kv_scale=fp8_scale)  # fmt: skip


_FAKES = {
    "allocating": _fake_allocating,
    "q_out_second": _fake_q_out_second,
    "q_out_third": _fake_q_out_third,
}


def register(
    namespace: str,
    *,
    form: str = "allocating",
    pool: ScratchPool | None = None,
    micro_batch: int | Callable[[], int] = 0,
    pad_heads: str = "written",
    cache_format: str = "fp8_ds_mla",
    override: bool = False,
    new_namespace: bool = False,
    qkv_name: str = QKV_NAME,
    kv_name: str = KV_NAME,
    numerics: Numerics | str | None = VLLM_NUMERICS,
    kv_only: bool = False,
) -> VllmOps:
    """Define `{namespace}::{qkv_name}` in the schema FORMS[form] and `{namespace}::{kv_name}` (the
    KV-only op), with CPU, CUDA and fake implementations; returns their plain callables.

    pool: the ScratchPool the allocating form writes q_padded into (reserve it for the P, D, dtype
    and micro-batches the engine calls with); micro_batch: the pool micro-batch index, or a callable
    returning the current one (two micro-batches in flight need two buffers). pad_heads: "written"
    (every call writes the pads; safe whatever reads the view) or "zero_once" (live heads only; the
    view must never be written, also not by a compiled graph reusing its buffer). cache_format: what
    the caller-owned forms write into a uint8 cache (their schemas have no format argument).
    override: the names already exist (the engine's own ops): run ours behind their schema, which
    must take the same argument types in the same order. new_namespace: the namespace is one of
    your own that no library defines; without it, register refuses a namespace no library has
    defined yet (call it after the engine's library has loaded: one loading later fails to define
    the same names). numerics: the KV path's parity choices for every call (numerics_by_format): by
    default VLLM_NUMERICS, vLLM's CUDA op's preset for fp8_ds_mla and mxfp8 and the format's
    defaults for every format that preset has no entry for; a Numerics or its string form (None or
    "": the format defaults) applies as given, NumericsError now for a choice the packed formats lack.
    kv_only: register the KV-only op alone (the fused op's name is left as it is; `qkv` is None).
    RegistrationError for a reserved namespace (torch's or ours), a name that is not an identifier,
    or a taken name."""
    if form not in FORMS:
        raise InputError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if pad_heads not in PAD_HEADS:
        raise InputError(f"pad_heads must be one of {', '.join(PAD_HEADS)}, got {pad_heads!r}")
    get_format(cache_format)  # UnknownFormatError now rather than at the first call
    if pool is not None and not isinstance(pool, ScratchPool):
        raise InputError(f"pool must be an attn_prologue.ScratchPool, got {type(pool).__name__}")
    if not isinstance(micro_batch, int) and not callable(micro_batch):
        raise InputError(f"micro_batch must be an int or a callable returning one, got {micro_batch!r}")
    by_format = numerics_by_format(numerics, form, cache_format)  # NumericsError: nothing registered
    check_names(namespace, (kv_name,) if kv_only else (qkv_name, kv_name), new_namespace=new_namespace)
    out = VllmOps(namespace, form, pool, micro_batch, pad_heads, cache_format, qkv_name, kv_name, by_format,
                  kv_only)  # fmt: skip
    try:
        out._register(override)
    except BaseException:
        out.close()  # nothing half-registered stays behind
        raise
    _LIVE.add(out)
    return out
