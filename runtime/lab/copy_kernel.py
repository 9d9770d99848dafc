"""Plain SM copy kernels for the bandwidth ceiling: 128-bit loads and stores, each kind a structure
(`CopyKind`: threads per CTA, vectors per thread, where a thread's vectors lie, the grid). `bench`
times the kinds in COPY_KINDS and cudaMemcpy (torch's copy_) and takes the fastest as "the copy",
recording which one won: one vector per thread in 256-thread CTAs (`sm1`, the most CTAs) was the
fastest same-bytes copy on the H200 at T >= 2048 in issue 26's run, 4-5% ahead of four vectors per
thread (`sm`). `tools/profile_shape.py --copy-kinds` times any other structure, e.g. the one of a
kernel's Q pass (`t64_v4_row`: 2-warp CTAs, each warp moving two contiguous 1 KB rows), to tell what
of a kernel's distance to the copy its memory structure alone costs. A `_qi` kind stores in the chunk-
interleaved Q layout instead (`qi_indices`), so that what that layout's stores cost the memory system
is timed without any of the op's own work."""

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
    # True (row kinds only): dst is src in the chunk-interleaved Q layout of QI_HEADS heads of
    # QI_ROW_VECTORS vectors a token, a warp's vectors its vectors / 2 adjacent heads (qi_indices)
    qi: bool = False

    def __post_init__(self):
        if self.threads not in (32, 64, 128, 256, 512, 1024):
            raise ValueError(f"threads must be a power of two in 32..1024, got {self.threads}")
        if self.vectors not in (1, 2, 4, 8):
            raise ValueError(f"vectors must be 1, 2, 4 or 8, got {self.vectors}")
        if not 0 <= self.ctas_per_sm <= 32:
            raise ValueError(f"ctas_per_sm must be in 0..32, got {self.ctas_per_sm}")
        if self.qi and not (self.row and self.vectors >= 2):
            raise ValueError(
                "an interleaved (_qi) copy kind needs whole rows a warp: _row and 2, 4 or 8 vectors"
            )

    @property
    def key(self) -> str:
        return (
            f"t{self.threads}_v{self.vectors}"
            + ("_row" if self.row else "")
            + ("_qi" if self.qi else "")
            + (f"_c{self.ctas_per_sm}" if self.ctas_per_sm else "")
        )

    @classmethod
    def from_key(cls, key: str) -> CopyKind:
        """A key of `key`'s form, or a name of COPY_KINDS."""
        if key in COPY_KINDS:
            return COPY_KINDS[key]
        m = re.fullmatch(r"t(\d+)_v(\d+)(_row)?(_qi)?(?:_c(\d+))?", key)
        if not m:
            raise ValueError(
                f"not a copy kind: {key!r}; kinds read t<threads>_v<vectors>[_row[_qi]][_c<CTAs per SM>] "
                f"(e.g. t64_v4_row, t64_v4_row_qi) or name one of {sorted(COPY_KINDS)}"
            )
        threads, vectors, row, qi, ctas = m.groups()
        return cls(int(threads), int(vectors), bool(row), int(ctas or 0), bool(qi))


COPY_KINDS = {"sm": CopyKind(256, 4), "sm1": CopyKind(256, 1)}  # the bench's yardsticks

# The interleaved copy's token: the bench's Q shape, 64 heads of 512 bf16 values (64 vectors a row)
QI_HEADS = 64
QI_ROW_VECTORS = 64
QI_TOKEN_VECTORS = QI_HEADS * QI_ROW_VECTORS


def qi_indices(warp, store, lane, rows: int):
    """(src, dst) vector indices of a warp's store `store` (0 .. 2 * rows - 1) at `lane` in an
    interleaved copy whose warps hold `rows` adjacent heads each (warp w: rows w * rows ..): the stores
    of KernelBase.store_rows_interleaved, lane L writing half L % 2 of its chunk's 32-byte piece of head
    h0 + L // 2 % rows, so that each store instruction writes runs of rows x 32 bytes. The piece of
    chunk c of head h of token t (its vectors 2c, 2c + 1) lands at
    t * QI_TOKEN_VECTORS + c * QI_HEADS * 2 + h * 2. Plain arithmetic: the kernel calls it on Int32, the
    CPU tests on torch tensors."""
    r0 = warp * rows
    c = store * (16 // rows) + lane // (2 * rows)
    k = lane // 2 % rows
    half = lane % 2
    src = (r0 + k) * QI_ROW_VECTORS + 2 * c + half
    dst = r0 // QI_HEADS * QI_TOKEN_VECTORS + c * (QI_HEADS * 2) + (r0 % QI_HEADS + k) * 2 + half
    return src, dst


class Copy:
    """`Copy(kind)(src, dst, max_ctas, stream)` copies src to dst (int32, length a multiple of 4); a
    persistent kind's grid is at most max_ctas CTAs (other kinds ignore it). A `_qi` kind copies the
    whole tokens of src interleaved and the rest (under a token) straight."""

    def __init__(self, kind: CopyKind):
        self.kind = kind

    @cute.jit
    def vector_indices(self, chunk: Int32, u: int, tidx: Int32, n_vec: Int32) -> tuple[Int32, Int32]:
        """The (src, dst) indices of the u-th vector a thread moves."""
        k = self.kind
        if const_expr(k.row):
            warp = chunk * (k.threads // 32) + tidx // 32
            i = (warp * k.vectors + u) * 32 + tidx % 32
            src, dst = i, i
            if const_expr(k.qi):
                # whole warps lie in whole tokens or past them (QI_TOKEN_VECTORS is a multiple of 32 x vectors)
                if (warp + 1) * (k.vectors * 32) <= n_vec // QI_TOKEN_VECTORS * QI_TOKEN_VECTORS:
                    src, dst = qi_indices(warp, u, tidx % 32, k.vectors // 2)
            return src, dst
        i = (chunk * k.vectors + u) * k.threads + tidx
        return i, i

    @cute.jit
    def copy_chunk(self, src: cute.Tensor, dst: cute.Tensor, n_vec: Int32, chunk: Int32, tidx: Int32):
        frags = [cute.make_rmem_tensor(4, Int32) for _ in range(self.kind.vectors)]
        indices = []
        for u in range_constexpr(self.kind.vectors):
            indices.append(self.vector_indices(chunk, u, tidx, n_vec))
        for u in range_constexpr(self.kind.vectors):
            i, _ = indices[u]
            if i < n_vec:
                kl.load_vector_into(frags[u], kl.base_address(src), Int64(i) * 16, Int32, True)
        for u in range_constexpr(self.kind.vectors):
            i, j = indices[u]
            if i < n_vec:
                kl.store_vector(frags[u], kl.base_address(dst), Int64(j) * 16, Int32, 16)

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
