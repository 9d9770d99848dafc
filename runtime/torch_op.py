"""The torch ops: `torch.ops.attn_prologue.qnorm_rope_kv_insert` and `...kv_rope_insert`.

Caller-owned schema (docs/op.md): `q_in, kv, q_out!, k_cache!, slot_mapping, positions,
cos_sin_cache, eps, block_size -> ()`, plus optional trailing arguments with defaults (cache format
and FP8 scales) so existing callers keep working. The mutated arguments (`Tensor(a!)`) are q_out and
k_cache: under torch.compile the call is auto_functionalized and re-inplaced. Implementations: CPU =
the reference, CUDA = the dispatcher, fake = nothing to compute (outputs are caller-owned).

The ops are defined with a plain `torch.library.Library` (schema strings and per-key kernels) rather
than `torch.library.custom_op`, whose Python wrapper costs about twice the dispatch per eager call;
the package-level functions still call the kernels directly in eager mode and go through torch.ops
only while compiling.

The CUDA kernels: where `attn-prologue build` built native/torch_ops.cpp for this torch, C++ (the
dispatcher reaches compiled code: the shape's native plan, as the one-call functions use it); else
the Python functions below. The C++ kernels take a miss or a refused call to `*_slow` (Python: the
one-call function, which validates and raises the typed error, and hands back the plan to cache).
"""

from __future__ import annotations

import collections
import ctypes
import warnings

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import native, ops, reference, validate
from .errors import AttnPrologueError, InputError
from .formats import get_format

NAMESPACE = "attn_prologue"
QKV_SCHEMA = (
    "qnorm_rope_kv_insert(Tensor q_in, Tensor kv, Tensor(a2!) q_out, Tensor(a3!) k_cache, Tensor slot_mapping, "
    'Tensor positions, Tensor cos_sin_cache, float eps, SymInt block_size, str cache_format="fp8_ds_mla", '
    'Tensor? kv_scale=None, Tensor? q_scale=None, str numerics="", bool apply_q_norm=True, '
    'bool apply_q_rope=True, str q_layout="head_major") -> ()'
)
KV_SCHEMA = (
    "kv_rope_insert(Tensor kv, Tensor(a1!) k_cache, Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache, "
    'SymInt block_size, str cache_format="fp8_ds_mla", Tensor? norm_weight=None, float eps=1e-06, '
    'Tensor? kv_scale=None, str numerics="", int compress_ratio=1) -> ()'
)
_library = torch.library.Library(NAMESPACE, "DEF")  # kept alive: dropping it unregisters the ops
_library.define(QKV_SCHEMA)
_library.define(KV_SCHEMA)
# what the C++ kernels call on a miss: the same arguments, the native plan's address (0: none) back
_library.define(
    QKV_SCHEMA.replace("qnorm_rope_kv_insert(", "qnorm_rope_kv_insert_slow(").replace("-> ()", "-> int")
)
_library.define(KV_SCHEMA.replace("kv_rope_insert(", "kv_rope_insert_slow(").replace("-> ()", "-> int"))
_pinned: dict = {}  # plans handed to the C++ kernels, by address: kept alive for the process
# the C++ kernels' calls that took the Python path, per op
SLOW_CALLS: collections.Counter = collections.Counter()


# The implementations take the schema's arguments in its order (the dispatcher passes them all).
# fmt: off
def _qkv_cpu(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla", kv_scale=None, q_scale=None, numerics="", apply_q_norm=True, apply_q_rope=True, q_layout="head_major"):
    """The PyTorch reference, after the validation the kernels get."""
    validate.check_qkv(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, q_scale=q_scale, kv_scale=kv_scale, q_layout=q_layout)
    num = get_format(cache_format).resolve_numerics(numerics)  # NumericsError before anything is written
    reference.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, kv_scale=kv_scale, q_scale=q_scale, numerics=num, apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout)


def _qkv_run(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla", kv_scale=None, q_scale=None, numerics="", apply_q_norm=True, apply_q_rope=True, q_layout="head_major"):
    """The one-call function on the schema's arguments; the shape's ShapeCalls."""
    return ops.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, kv_scale=kv_scale, q_scale=q_scale, numerics=numerics or None, apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout)


def _qkv_cuda(*args, **kwargs):
    _qkv_run(*args, **kwargs)


def _qkv_slow(*args, **kwargs):
    SLOW_CALLS["qnorm_rope_kv_insert"] += 1
    return _plan_address(_qkv_run(*args, **kwargs))


def _qkv_fake(q_in, *_):
    refuse_meta(q_in)


def _kv_cpu(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, numerics="", compress_ratio=1):
    validate.check_kv(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, compress_ratio=compress_ratio)
    num = get_format(cache_format).resolve_numerics(numerics)
    reference.kv_rope_insert(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, numerics=num, compress_ratio=compress_ratio)


def _kv_run(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, numerics="", compress_ratio=1):
    return ops.kv_rope_insert(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, numerics=numerics or None, compress_ratio=compress_ratio)


def _kv_cuda(*args, **kwargs):
    _kv_run(*args, **kwargs)


def _kv_slow(*args, **kwargs):
    SLOW_CALLS["kv_rope_insert"] += 1
    return _plan_address(_kv_run(*args, **kwargs))


def _kv_fake(kv, *_):
    refuse_meta(kv)
# fmt: on


def _plan_address(shape) -> int:
    plan = getattr(shape, "native", None)
    if plan is None:
        return 0
    return _pinned.setdefault(plan.address(), plan).address()


for _name, _cpu, _cuda, _slow, _fake in (
    ("qnorm_rope_kv_insert", _qkv_cpu, _qkv_cuda, _qkv_slow, _qkv_fake),
    ("kv_rope_insert", _kv_cpu, _kv_cuda, _kv_slow, _kv_fake),
):
    _library.impl(_name, _cpu, "CPU")
    _library.impl(f"{_name}_slow", _slow, "CUDA")
    for _op in (_name, f"{_name}_slow"):  # not differentiable: autograd passes through (no boxed fallback)
        _library.impl(_op, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_library)


def _python_cuda_kernels() -> torch.library.Library:
    """The Python CUDA kernels (kept alive: dropping the library unregisters them)."""
    lib = torch.library.Library(NAMESPACE, "IMPL")
    lib.impl("qnorm_rope_kv_insert", _qkv_cuda, "CUDA")
    lib.impl("kv_rope_insert", _kv_cuda, "CUDA")
    return lib


_python_cuda = _python_cuda_kernels()  # until the C++ ones replace them


def load_native_kernels(*, build: bool = False):
    """Replace the Python CUDA kernels with the C++ ones (native/torch_ops.cpp) if they are built for
    this torch, or (build=True) after building them; their path, or None (Python kernels stay). The
    Python kernels are unregistered only once the library is verified (loading it over them would make
    torch warn that it overrides them), and registered again if it then does not load."""
    global _python_cuda
    if _python_cuda is None or not native.enabled():
        return None
    if build:
        native.build("torch_ops")
    found = native.verified("torch_ops")
    if found is None:
        return None
    _python_cuda._destroy()
    try:
        handle = native.load_verified(found, lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    except BaseException:
        _python_cuda = _python_cuda_kernels()
        raise
    _python_cuda = None
    torch.ops.loaded_libraries.add(found[0])  # (what torch.ops.load_library records)
    native.use_tensor_reader(handle)
    return found[0]


def cuda_kernels() -> str:
    """Which CUDA kernels the torch ops have: "C++" or "Python"."""
    return "Python" if _python_cuda is not None else "C++"


def refuse_meta(t: Tensor) -> None:
    """The fake implementation traces (outputs are caller-owned: nothing to compute). Called eagerly
    on real meta tensors it would be a silent no-op that looks like success: refuse that."""
    if t.device.type == "meta" and not is_fake(t):
        raise InputError(
            "attn_prologue ops need CPU or CUDA tensors, got meta tensors (nothing would be written)"
        )


try:  # the C++ CUDA kernels, where `attn-prologue build` built them for this torch
    load_native_kernels()
except (AttnPrologueError, OSError, RuntimeError) as _exc:  # e.g. an untrusted entry: import anyway
    warnings.warn(
        f"attn_prologue: the C++ torch-op kernels were not loaded ({_exc}); the Python ones serve",
        native.NativeUnavailableWarning,
        stacklevel=2,
    )
