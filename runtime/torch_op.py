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

The fake implementations check what fake tensors still show while torch.compile traces: which
storage each argument is a view of, its offset and strides, so the overlap rules (overlap.py) hold
under every backend, also where the compiled graph runs the op on copies of the written buffers
(aot_eager) or cannot run it at all (inductor, on inputs aliased across dtypes). Called eagerly on
real meta tensors they refuse (nothing would be written).

The CPU implementations count the rows they skip as the kernels' checked mode does (docs/op.md):
into the process-wide CPU counters, `Runtime.errors_buffer("cpu")`.

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

from . import dispatch, native, ops, overlap, reference, validate
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


class TracedInputError(InputError, IndexError):
    """An InputError found while torch.compile traces the op (fake tensors). Also an IndexError: dynamo
    re-raises that as it is from fake-tensor propagation and wraps every other exception in an untyped
    TorchRuntimeError (torch 2.13, torch/_dynamo/utils.py run_node and convert_frame.py)."""


def reference_qkv(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla",
                  *, kv_scale=None, q_scale=None, numerics="", apply_q_norm=True, apply_q_rope=True,
                  q_layout="head_major", write_pad_heads=True) -> None:  # fmt: skip
    """The CPU form of qnorm_rope_kv_insert: the validation the kernels get, the PyTorch reference,
    and the count of skipped rows."""
    validate.check_qkv(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format,
                       q_scale=q_scale, kv_scale=kv_scale, q_layout=q_layout)  # fmt: skip
    num = get_format(cache_format).resolve_numerics(numerics)  # NumericsError before anything is written
    reference.qnorm_rope_kv_insert(
        q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, kv_scale=kv_scale,
        q_scale=q_scale, numerics=num, apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout,
        write_pad_heads=write_pad_heads,
    )  # fmt: skip
    count_skipped(slots, positions, k_cache, cos_sin, block_size, q_tokens=q_in.shape[0])


def reference_kv(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", *,
                 norm_weight=None, eps=1e-6, kv_scale=None, numerics="", compress_ratio=1) -> None:  # fmt: skip
    """The CPU form of kv_rope_insert (as reference_qkv)."""
    validate.check_kv(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight,
                      eps=eps, kv_scale=kv_scale, compress_ratio=compress_ratio)  # fmt: skip
    num = get_format(cache_format).resolve_numerics(numerics)
    reference.kv_rope_insert(kv, k_cache, slots, positions, cos_sin, block_size, cache_format,
                             norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, numerics=num,
                             compress_ratio=compress_ratio)  # fmt: skip
    count_skipped(slots, positions, k_cache, cos_sin, block_size, q_tokens=0)


def count_skipped(slots, positions, k_cache, cos_sin, block_size, *, q_tokens: int) -> None:
    """What the kernels count in checked mode: errors[0] += KV rows with a slot >= 0 not written (slot
    past the cache, or position outside cos_sin_cache), errors[1] += Q tokens (of the first q_tokens)
    written as zeros (position outside cos_sin_cache)."""
    safe, _, pos_ok = reference.in_bounds(slots, positions, k_cache, cos_sin, block_size)
    errors = dispatch.CPU_ERRORS
    errors[0] += int(((slots >= 0) & (safe < 0)).sum())
    if q_tokens:
        errors[1] += int((~pos_ok[:q_tokens]).sum())


def lazy_bits_kernel(op: torch._ops.OpOverload):
    """op's kernel at the Negative and Conjugate dispatch keys, which a call reaches only when an argument
    is a lazily negated or conjugated view: refuse it, as the validation of the kernel path does (torch's
    own fallback would resolve an input by a copy, and fails untyped on a written argument)."""
    names = [a.name for a in op._schema.arguments]

    def kernel(*args):
        for name, t in zip(names, args):
            if isinstance(t, Tensor) and (t.is_neg() or t.is_conj()):
                validate.refuse_lazy_view(name, t)

    return kernel


def check_traced(check, **tensors) -> None:
    """What a fake implementation checks: real meta tensors are refused (called eagerly, it would be
    a silent no-op); on fake tensors `check(**tensors)` (overlap.check_qkv / check_kv) runs, its
    InputError raised as a TracedInputError."""
    refuse_meta(**tensors)
    try:
        check(**tensors)
    except InputError as exc:
        raise TracedInputError(str(exc)) from None


# The implementations take the schema's arguments in its order (the dispatcher passes them all).
# fmt: off
def _qkv_cpu(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla", kv_scale=None, q_scale=None, numerics="", apply_q_norm=True, apply_q_rope=True, q_layout="head_major"):
    reference_qkv(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, kv_scale=kv_scale, q_scale=q_scale, numerics=numerics, apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout)


def _qkv_run(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla", kv_scale=None, q_scale=None, numerics="", apply_q_norm=True, apply_q_rope=True, q_layout="head_major"):
    """The one-call function on the schema's arguments; the shape's ShapeCalls."""
    return ops.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format, kv_scale=kv_scale, q_scale=q_scale, numerics=numerics or None, apply_q_norm=apply_q_norm, apply_q_rope=apply_q_rope, q_layout=q_layout)


def _qkv_cuda(*args, **kwargs):
    _qkv_run(*args, **kwargs)


def _qkv_slow(*args, **kwargs):
    SLOW_CALLS["qnorm_rope_kv_insert"] += 1
    return _plan_address(_qkv_run(*args, **kwargs))


def _qkv_fake(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, block_size, cache_format="fp8_ds_mla", kv_scale=None, q_scale=None, *_):
    check_traced(overlap.check_qkv, q_in=q_in, kv=kv, q_out=q_out, k_cache=k_cache, slot_mapping=slots, positions=positions, cos_sin_cache=cos_sin, kv_scale=kv_scale, q_scale=q_scale)


def _kv_cpu(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, numerics="", compress_ratio=1):
    reference_kv(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, numerics=numerics, compress_ratio=compress_ratio)


def _kv_run(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, numerics="", compress_ratio=1):
    return ops.kv_rope_insert(kv, k_cache, slots, positions, cos_sin, block_size, cache_format, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale, numerics=numerics or None, compress_ratio=compress_ratio)


def _kv_cuda(*args, **kwargs):
    _kv_run(*args, **kwargs)


def _kv_slow(*args, **kwargs):
    SLOW_CALLS["kv_rope_insert"] += 1
    return _plan_address(_kv_run(*args, **kwargs))


def _kv_fake(kv, k_cache, slots, positions, cos_sin, block_size, cache_format="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, *_):
    check_traced(overlap.check_kv, kv=kv, norm_weight=norm_weight, k_cache=k_cache, slot_mapping=slots, positions=positions, cos_sin_cache=cos_sin, kv_scale=kv_scale)
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
    for _key in ("Negative", "Conjugate"):
        _library.impl(_name, lazy_bits_kernel(getattr(torch.ops.attn_prologue, _name).default), _key)
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
        native.reader_of(handle)  # (NativeBuildError before the Python kernels are gone for good)
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


def refuse_meta(**tensors) -> None:
    """The fake implementations trace (outputs are caller-owned: nothing to compute). Called eagerly
    on real meta tensors (any argument: the dispatcher picks the meta kernel for a mix) they would be
    a silent no-op that looks like success: refuse that, naming the argument."""
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.device.type == "meta" and not is_fake(t):
            raise InputError(
                f"{name} is a meta tensor: attn_prologue ops take CPU or CUDA tensors (a meta tensor holds "
                "no data: nothing would be written)"
            )


def _refusing_bool_scalars(name: str, block_at: int, eps_at: int, eps_default: float) -> None:
    """torch.ops.attn_prologue.<name>(...) refuses a bool or float block_size and a bool eps (InputError):
    the schema would convert True to 1 (or 1.0) before any kernel sees it. The packet's own __call__ is
    replaced (its class swapped for a subclass), so a call costs two type checks more."""
    packet = getattr(torch.ops.attn_prologue, name)

    class Checked(type(packet)):
        def __call__(self, /, *args, **kwargs):
            n = len(args)
            ops.check_scalar_types(
                args[eps_at] if n > eps_at else kwargs.get("eps", eps_default),
                args[block_at] if n > block_at else kwargs.get("block_size", 1),
            )
            return self._op(*args, **kwargs)

    packet.__class__ = Checked


_refusing_bool_scalars("qnorm_rope_kv_insert", block_at=8, eps_at=7, eps_default=0.0)
_refusing_bool_scalars("kv_rope_insert", block_at=5, eps_at=8, eps_default=1e-6)


try:  # the C++ CUDA kernels, where `attn-prologue build` built them for this torch
    load_native_kernels()
except (AttnPrologueError, OSError, RuntimeError) as _exc:  # e.g. an untrusted entry: import anyway
    warnings.warn(
        f"attn_prologue: the C++ torch-op kernels were not loaded ({_exc}); the Python ones serve",
        native.NativeUnavailableWarning,
        stacklevel=2,
    )
