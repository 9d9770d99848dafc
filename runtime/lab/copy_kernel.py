"""A plain SM copy kernel for the bandwidth ceiling: 128-bit loads and stores, 4 vectors in flight
per thread. `bench` takes the faster of this and cudaMemcpy (torch's copy_) as "the copy"."""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32, Int64, range_constexpr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..device import kernel_lib as kl

THREADS = 256
UNROLL = 4


@cute.kernel
def _copy(src: cute.Tensor, dst: cute.Tensor, n_vec: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    frags = [cute.make_rmem_tensor(4, Int32) for _ in range(UNROLL)]
    for u in range_constexpr(UNROLL):
        i = (bidx * UNROLL + u) * THREADS + tidx
        if i < n_vec:
            kl.load_vector_into(frags[u], kl.base_address(src), Int64(i) * 16, Int32, True)
    for u in range_constexpr(UNROLL):
        i = (bidx * UNROLL + u) * THREADS + tidx
        if i < n_vec:
            kl.store_vector(frags[u], kl.base_address(dst), Int64(i) * 16, Int32, 16)


@cute.jit
def _launch(src: cute.Tensor, dst: cute.Tensor, stream: cuda.CUstream):
    n_vec = src.shape[0] // 4
    per_cta = THREADS * UNROLL
    _copy(src, dst, n_vec).launch(
        grid=[(n_vec + per_cta - 1) // per_cta, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@functools.cache
def compiled(target: str):
    n = cute.sym_int32(divisibility=4)
    fake = make_fake_compact_tensor(Int32, (n,), assumed_align=16)
    fake2 = make_fake_compact_tensor(Int32, (cute.sym_int32(divisibility=4),), assumed_align=16)
    return cute.compile(
        _launch,
        fake,
        fake2,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--gpu-arch {target} --enable-tvm-ffi",
    )
