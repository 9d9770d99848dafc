"""Plain SM copy kernels for the bandwidth ceiling: 128-bit loads and stores, each kind a structure
(`CopyKind`: threads per CTA, vectors per thread, where a thread's vectors lie, the grid). `bench`
times the kinds in COPY_KINDS and cudaMemcpy (torch's copy_) and takes the fastest as "the copy",
recording which one won: one vector per thread in 256-thread CTAs (`sm1`, the most CTAs) was the
fastest same-bytes copy on the H200 at T >= 2048 in issue 26's run, 4-5% ahead of four vectors per
thread (`sm`). `tools/profile_shape.py --copy-kinds` times any other structure, e.g. the one of a
kernel's Q pass (`t64_v4_row`: 2-warp CTAs, each warp moving two contiguous 1 KB rows), to tell what
of a kernel's distance to the copy its memory structure alone costs."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr, range_constexpr
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from ..device import kernel_lib as kl


@dataclass(frozen=True)
class CopyKind:
    """How an SM copy spreads the bytes. A chunk is one CTA's threads x vectors 16-byte vectors."""

    threads: int = 256  # per CTA
    vectors: int = 1  # 16-byte vectors each thread loads (all of them) before it stores them
    # True: each warp's vectors are one contiguous run (vector u of lane l at u * 32 + l), as a warp's
    # Q rows; False: a CTA's u-th vectors are one run, `threads` vectors after its (u-1)-th
    row: bool = False
    ctas_per_sm: int = 0  # k > 0: a grid of at most k x SMs CTAs, each looping over chunks

    def __post_init__(self):
        if self.threads not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"threads must be a power of two in 32..1024, got {self.threads}")
        if self.vectors not in (1, 2, 4, 8):
            raise ValueError(f"vectors must be 1, 2, 4 or 8, got {self.vectors}")
        if not 0 <= self.ctas_per_sm <= 32:
            raise ValueError(f"ctas_per_sm must be in 0..32, got {self.ctas_per_sm}")

    @property
    def key(self) -> str:
        return (
            f"t{self.threads}_v{self.vectors}"
            + ("_row" if self.row else "")
            + (f"_c{self.ctas_per_sm}" if self.ctas_per_sm else "")
        )

    @classmethod
    def from_key(cls, key: str) -> CopyKind:
        """A key of `key`'s form, or a name of COPY_KINDS."""
        if key in COPY_KINDS:
            return COPY_KINDS[key]
        m = re.fullmatch(r"t(\d+)_v(\d+)(_row)?(?:_c(\d+))?", key)
        if not m:
            raise ValueError(
                f"not a copy kind: {key!r}; kinds read t<threads>_v<vectors>[_row][_c<CTAs per SM>] "
                f"(e.g. t64_v4_row) or name one of {sorted(COPY_KINDS)}"
            )
        return cls(int(m.group(1)), int(m.group(2)), bool(m.group(3)), int(m.group(4) or 0))


COPY_KINDS = {"sm": CopyKind(256, 4), "sm1": CopyKind(256, 1)}  # the bench's yardsticks


class Copy:
    """`Copy(kind)(src, dst, max_ctas, stream)` copies src to dst (int32, length a multiple of 4); a
    persistent kind's grid is at most max_ctas CTAs (other kinds ignore it)."""

    def __init__(self, kind: CopyKind):
        self.kind = kind

    def vector_index(self, chunk: Int32, u: int, tidx: Int32) -> Int32:
        k = self.kind
        if const_expr(k.row):
            warp = chunk * (k.threads // 32) + tidx // 32
            return (warp * k.vectors + u) * 32 + tidx % 32
        return (chunk * k.vectors + u) * k.threads + tidx

    @cute.jit
    def copy_chunk(self, src: cute.Tensor, dst: cute.Tensor, n_vec: Int32, chunk: Int32, tidx: Int32):
        frags = [cute.make_rmem_tensor(4, Int32) for _ in range(self.kind.vectors)]
        for u in range_constexpr(self.kind.vectors):
            i = self.vector_index(chunk, u, tidx)
            if i < n_vec:
                kl.load_vector_into(frags[u], kl.base_address(src), Int64(i) * 16, Int32, True)
        for u in range_constexpr(self.kind.vectors):
            i = self.vector_index(chunk, u, tidx)
            if i < n_vec:
                kl.store_vector(frags[u], kl.base_address(dst), Int64(i) * 16, Int32, 16)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, n_vec: Int32, chunks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.kind.ctas_per_sm):
            for chunk in cutlass.range(bidx, chunks, cute.arch.grid_dim()[0]):
                self.copy_chunk(src, dst, n_vec, chunk, tidx)
        else:
            self.copy_chunk(src, dst, n_vec, bidx, tidx)

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        n_vec = src.shape[0] // 4
        per_chunk = self.kind.threads * self.kind.vectors
        chunks = (n_vec + per_chunk - 1) // per_chunk
        grid = chunks
        if const_expr(self.kind.ctas_per_sm):
            grid = cutlass.min(chunks, max_ctas)
        self.kernel(src, dst, n_vec, chunks).launch(
            grid=[grid, 1, 1], block=[self.kind.threads, 1, 1], stream=stream
        )


def compile_copy(target: str, kind: CopyKind, extra_options: str = ""):
    n = cute.sym_int32(divisibility=4)
    fake = make_fake_compact_tensor(Int32, (n,), assumed_align=16)
    fake2 = make_fake_compact_tensor(Int32, (cute.sym_int32(divisibility=4),), assumed_align=16)
    return cute.compile(
        Copy(kind),
        fake,
        fake2,
        Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--gpu-arch {target} --enable-tvm-ffi {extra_options}".strip(),
    )


@functools.cache
def compiled(target: str, kind: str = "sm"):
    """The compiled copy of one kind (a name of COPY_KINDS or a CopyKind key) for a target, once per process."""
    return compile_copy(target, CopyKind.from_key(kind))
