"""The one-call functions' and bound ops' hot paths on CPU tensors, with the compiled kernel replaced by
a Python function: everything up to the kernel call runs as on CUDA (key, cheap checks, overlap check,
full validation on a refusal), so the wiring is testable and measurable without a GPU. With
`native=True` the stand-in is a TVM-FFI function, so the C fast path (native/) is what runs.

The stub kernel writes one byte of each buffer a real kernel writes (q_out and k_cache), so a call
that should have been refused shows up as changed bytes, and counts its calls."""

from __future__ import annotations

import ctypes
import importlib.metadata
import re
from contextlib import contextmanager

import pytest
import torch
from attn_prologue import api, dispatch
from attn_prologue.scratch import ScratchPool


class StubKernel:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors[0].dim() == 3:  # qkv: q_in, kv, q_out, k_cache, ...
            q_out, k_cache = tensors[2], tensors[3]
            q_out[0, 0, 0] += 1
        else:  # kv-only: kv, [norm_weight,] k_cache, ...
            k_cache = next(t for t in tensors if t.dtype == torch.uint8)
        k_cache[0, 0] += 1


class FfiStubKernel:
    """The stub as a TVM-FFI function, so a shape's native plan (native/fastpath.h) is made and calls
    it from C with DLTensor arguments: the C checks then run as they do on CUDA. It writes the same
    bytes as StubKernel (through the pointers it is given) and records each call's arguments."""

    def __init__(self):
        import tvm_ffi

        require_python_stand_in()
        self.calls = 0
        self.args: list[list] = []  # per call: (data_ptr, shape, strides, dtype) per tensor, scalars as given
        self.fn = tvm_ffi.convert(self._call)

    def _call(self, *args):
        self.calls += 1
        # the arguments are views valid only during the call: read them now
        seen = [(_data_ptr(a), tuple(a.shape), tuple(a.strides), str(a.dtype)) if hasattr(a, "strides") else a
                for a in args]  # fmt: skip
        self.args.append(seen)
        tensors = [a for a in seen if isinstance(a, tuple)]
        if len(tensors[0][1]) == 3:  # qkv: q_in, kv, q_out, k_cache, ...
            written = (tensors[2], tensors[3])
        else:
            written = (next(t for t in tensors if t[3] == "uint8"),)
        for ptr, *_ in written:
            byte = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8))
            byte[0] = (byte[0] + 1) & 0xFF


def require_python_stand_in() -> None:
    """Skip the calling test where tvm-ffi cannot call FfiStubKernel. Seen with 0.1.11 (vLLM's and
    SGLang's pin): a Python function called from C with DLTensor* arguments, as a native plan calls its
    kernel, dies in TVMFFITensorToDLPackVersioned before any Python runs. Compiled kernels take
    DLTensor* in C and are not affected (the GPU suite runs the native path on such a version)."""
    version = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version("apache-tvm-ffi"))[:3])
    if version < (0, 1, 13):
        pytest.skip("tvm-ffi < 0.1.13 cannot call a Python stand-in kernel with DLTensor* arguments")


def _data_ptr(tensor) -> int:
    """A TVM-FFI tensor argument's address: `data_ptr()` where tvm-ffi has it (0.1.13 on), else through
    DLPack (0.1.11's Tensor has none)."""
    if hasattr(tensor, "data_ptr"):
        return tensor.data_ptr()
    return torch.from_dlpack(tensor).data_ptr()


class StubLauncher:
    def __init__(self, kernel):
        self.fn = getattr(kernel, "fn", kernel)

    def tail(self, leading, **values) -> tuple:
        return ()


class StubRuntime(dispatch.Runtime):
    """Resolves every request to `kernel` on CPU (no kernel cache, no device facts)."""

    def __init__(self, kernel=None, *, native: bool = False):
        super().__init__()
        self.kernel = kernel or (FfiStubKernel() if native else StubKernel())

    def launchers(self, request, device=None, **_):
        return (StubLauncher(self.kernel),) * (dispatch.MAX_BUCKET_LOG2 + 1)

    def errors_buffer(self, device=None):
        return torch.zeros(2, dtype=torch.int32)


class _CpuPool:
    """A ScratchPool whose buffers live on the CPU whatever device a bound op names."""

    def __init__(
        self, max_tokens: int, padded_heads: int, head_dim: int, micro_batches: int, dtype=torch.bfloat16
    ):
        self.pool = ScratchPool()
        self.pool.reserve(
            max_tokens=max_tokens,
            padded_heads=padded_heads,
            head_dim=head_dim,
            dtype=dtype,
            micro_batches=micro_batches,
            device="cpu",
        )
        self.pool.lock()
        self.locked = True

    def claim(self, live_heads, **key):
        return self.pool.claim(live_heads, **dict(key, device="cpu"))

    def claim_micro_batches(self, live_heads, micro_batches, **key):
        return self.pool.claim_micro_batches(live_heads, micro_batches, **dict(key, device="cpu"))

    def view(self, n, **key):
        return self.pool.view(n, **dict(key, device="cpu"))

    def buffer(self, **key):
        return self.pool.buffer(**dict(key, device="cpu"))

    def release(self) -> None:
        self.pool.release()


@contextmanager
def _cuda_claimed():
    """bind() refuses to start without CUDA; the stub runtime never touches a device."""
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = real


def stub_bind(*, runtime: StubRuntime, max_tokens: int = 0, micro_batches: int = 1, **kwargs) -> api.BoundOp:
    """A bound op on CPU tensors: with padded_heads > num_heads its scratch is a CPU pool's buffer
    (returned as op.pool.buffer(...)), else Q is written in place."""
    h = kwargs["num_heads"]
    p = kwargs.get("padded_heads") or h
    pool = None
    if p != h:
        pool = _CpuPool(max_tokens, p, kwargs.get("head_dim", 512), micro_batches)
    with _cuda_claimed():
        return api.bind(device="cuda:0", runtime=runtime, pool=pool, micro_batches=micro_batches, **kwargs)


def stub_bind_kv(*, runtime: StubRuntime, **kwargs) -> api.BoundKvOp:
    """A bound KV-only op on CPU tensors."""
    with _cuda_claimed():
        return api.bind_kv(device="cuda:0", runtime=runtime, **kwargs)
