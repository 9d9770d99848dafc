"""The one-call functions' and bound ops' hot paths on CPU tensors, with the compiled kernel replaced by
a Python function: everything up to the kernel call runs as on CUDA (key, cheap checks, overlap check,
full validation on a refusal), so the wiring is testable and measurable without a GPU.

The stub kernel writes one byte of each buffer a real kernel writes (q_out and k_cache), so a call
that should have been refused shows up as changed bytes, and counts its calls."""

from __future__ import annotations

from contextlib import contextmanager

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


class StubLauncher:
    def __init__(self, fn):
        self.fn = fn

    def tail(self, leading, **values) -> tuple:
        return ()


class StubRuntime(dispatch.Runtime):
    """Resolves every request to `kernel` on CPU (no kernel cache, no device facts)."""

    def __init__(self, kernel=None):
        super().__init__()
        self.kernel = kernel or StubKernel()

    def launchers(self, request, device=None, **_):
        return (StubLauncher(self.kernel),) * (dispatch.MAX_BUCKET_LOG2 + 1)

    def errors_buffer(self, device=None):
        return torch.zeros(2, dtype=torch.int32)


class _CpuPool:
    """A ScratchPool whose buffers live on the CPU whatever device a bound op names."""

    def __init__(self, max_tokens: int, padded_heads: int, head_dim: int, micro_batches: int):
        self.pool = ScratchPool()
        self.pool.reserve(
            max_tokens=max_tokens,
            padded_heads=padded_heads,
            head_dim=head_dim,
            micro_batches=micro_batches,
            device="cpu",
        )
        self.pool.lock()
        self.locked = True

    def claim(self, live_heads, **key):
        return self.pool.claim(live_heads, **dict(key, device="cpu"))

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
