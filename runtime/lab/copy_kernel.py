"""Plain SM copy kernels for the bandwidth ceiling: 128-bit loads and stores, 256-thread CTAs, with
1 or 4 vectors per thread (one vector per thread, the most CTAs, was the fastest same-bytes copy on
the H200 at T >= 2048 in issue 26's run). `bench` times every kind in COPY_KINDS and cudaMemcpy
(torch's copy_) and takes the fastest as "the copy", recording which one won."""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Int32, Int64, range_constexpr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..device import kernel_lib as kl

THREADS = 256
COPY_KINDS = {"sm": 4, "sm1": 1}  # SM copy kind -> 16-byte vectors per thread


class Copy:
    """`Copy(vectors)(src, dst, stream)` copies src to dst (int32, length a multiple of 4): each
    thread loads its `vectors` 16-byte vectors (one CTA's are THREADS apart), then stores them."""

    def __init__(self, vectors: int):
        self.vectors = vectors

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, n_vec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        frags = [cute.make_rmem_tensor(4, Int32) for _ in range(self.vectors)]
        for u in range_constexpr(self.vectors):
            i = (bidx * self.vectors + u) * THREADS + tidx
            if i < n_vec:
                kl.load_vector_into(frags[u], kl.base_address(src), Int64(i) * 16, Int32, True)
        for u in range_constexpr(self.vectors):
            i = (bidx * self.vectors + u) * THREADS + tidx
            if i < n_vec:
                kl.store_vector(frags[u], kl.base_address(dst), Int64(i) * 16, Int32, 16)

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, stream: cuda.CUstream):
        n_vec = src.shape[0] // 4
        per_cta = THREADS * self.vectors
        self.kernel(src, dst, n_vec).launch(
            grid=[(n_vec + per_cta - 1) // per_cta, 1, 1], block=[THREADS, 1, 1], stream=stream
        )


def compile_copy(target: str, vectors: int, extra_options: str = ""):
    n = cute.sym_int32(divisibility=4)
    fake = make_fake_compact_tensor(Int32, (n,), assumed_align=16)
    fake2 = make_fake_compact_tensor(Int32, (cute.sym_int32(divisibility=4),), assumed_align=16)
    return cute.compile(
        Copy(vectors),
        fake,
        fake2,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--gpu-arch {target} --enable-tvm-ffi {extra_options}".strip(),
    )


@functools.cache
def compiled(target: str, kind: str = "sm"):
    """The compiled copy of one kind (COPY_KINDS) for a target, once per process."""
    return compile_copy(target, COPY_KINDS[kind])
