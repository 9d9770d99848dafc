"""What both bound ops (api.BoundOp, bound_kv.BoundKvOp) share: the device they bind to, the checks
of their sizes and scalars, and their calls per slot-id width."""

from __future__ import annotations

import torch

from . import validate
from .errors import InputError, UnsupportedError
from .variants import IoDtype


def bind_device(device, what: str) -> torch.device:
    """The CUDA device a bound op runs on (the current one when no index is given)."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise InputError(
            f"{what}() needs a CUDA device, got {device} (on CPU tensors call attn_prologue.qnorm_rope_kv_insert "
            "or kv_rope_insert, which run the PyTorch reference)"
        )
    if not torch.cuda.is_available():
        raise UnsupportedError(
            f"no CUDA device is available: {what}() needs an NVIDIA GPU (on CPU tensors call "
            "attn_prologue.qnorm_rope_kv_insert or kv_rope_insert, which run the PyTorch reference)"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_bind_args(dtype, eps, **sizes) -> IoDtype:
    """InputError unless every size is a positive int, eps a finite float >= 0 and dtype an I/O dtype
    (before a bind claims or compiles anything); the I/O dtype."""
    for name, value in sizes.items():
        validate.check_positive_int(name, value)
    validate.check_eps(eps)
    io = IoDtype.of_torch(dtype)
    if io is None:
        raise InputError(f"dtype must be bfloat16 or float16, got {dtype}")
    return io


def check_bound_tensor(name: str, t, shape: tuple, dtype) -> None:
    """InputError unless t has the rank, the sizes (None: any) and the dtype the op was bound for."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != len(shape)
        or any(want is not None and got != want for got, want in zip(t.shape, shape))
        or t.dtype != dtype
    ):
        want = ", ".join("*" if n is None else str(n) for n in shape)
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name} must be [{want}] {dtype} for this bound op, got {got}")


class SlotWidthCalls:
    """What both bound ops keep per slot-id width (int64, int32): per token-count bucket, the kernel
    and the arguments after the leading ones (`_lead`), from the launchers for `_request`."""

    def _use_slot_dtype(self, dtype) -> None:
        """Switch the calls to this slot-id width (int32 ids: kernels compiled for int32, built on first use)."""
        calls = self._calls_by_dtype.get(dtype)
        if calls is None:
            launchers = self._rt.launchers(
                self._request,
                self.device,
                config=self._config,
                slots32=dtype == torch.int32,
                **self._launch_args,
            )
            calls = self._calls_by_dtype[dtype] = [
                (la.fn, la.tail(self._lead, **self._values)) for la in launchers
            ]
        self._slot_dtype, self._calls = dtype, calls

    @property
    def _slot_bits(self) -> int:
        return 32 if self._slot_dtype is torch.int32 else 64
