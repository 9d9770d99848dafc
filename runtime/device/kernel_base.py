"""The methods every generated `Kernel` shares, as a base class.

A generated module's `Kernel` subclasses `KernelBase` and sets the compile-time constants these
methods read (`TAIL_VECTOR`, `ROPE_DIM`) as class attributes; its own methods are the ones that differ
by op, format or layout. These are traced inside its kernels exactly as if they were written in the
module (the compiled code is the same), and like kernel_lib they are part of every module's source
hash (jit.compiler.source_hash), so an edit here rebuilds every kernel.

Each method runs on one warp's lanes; `self.cfg` is the module's LaunchConfig.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, const_expr, range_constexpr
from cutlass.memory import SmemAllocator

from . import kernel_lib as kl


class KernelBase:
    TAIL_VECTOR: int  # first vector of the rotated dims [D - R, D)
    ROPE_DIM: int

    def launch(self, kernel, grid, stream):
        kernel.launch(
            grid=[grid, 1, 1],
            block=[32 * self.cfg.warps_per_cta, 1, 1],
            stream=stream,
            use_pdl=self.cfg.pdl,
            min_blocks_per_mp=self.cfg.min_ctas_per_sm,
            # all of the SM's memory as L1 (a hint: a kernel that stages rows in shared memory still gets its
            # bytes); given with a register cap, the DSL would ask a GPU for the SM's size
            preferred_smem_carveout=0 if const_expr(self.cfg.min_ctas_per_sm) else None,
        )

    @property
    def rows_non_coherent(self) -> bool:
        """ld.global.nc for the rows the previous kernel wrote (q_in, kv) only without PDL: ptxas moves an .nc
        load (LDG.CONSTANT) above griddepcontrol.wait, where it reads those rows before that kernel's writes
        (seen in the SASS of w4_u1_pdl1_nc1 and on an H100 by tests/gpu/test_pdl_gpu.py; tests/test_sass_cpu.py
        checks every PDL config's kernels). With PDL the rows load coherently, as with `streaming`."""
        return self.cfg.non_coherent and not self.cfg.pdl

    @cute.jit
    def wait_for_producer(self):
        """PDL: wait for the previous kernel in the stream (its writes are then visible). A pass may read
        what the caller prepared before that kernel (slots, positions, cos/sin, norm weights) before it; it reads
        that kernel's outputs (kv, q_in, q_scale) and makes every write of its own after it."""
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def first_pass(self, w: Int32, schedule) -> Int32:
        """First pass of unit w. Units map to passes in pass order, or with spread_kv, whole CTAs
        do: KV CTA k runs as CTA k * spacing and the Q CTAs fill the gaps (a CTA lives as long as
        its slowest warp, so KV warps stay together)."""
        u = w
        if const_expr(self.cfg.spread_kv):
            warps = self.cfg.warps_per_cta
            kv_ctas = schedule.kv_passes // (self.cfg.passes_per_warp * warps)
            cta = w // warps
            k = cta // schedule.spacing
            c = (
                kv_ctas + cta - cutlass.min(k + 1, kv_ctas)
            )  # Q CTAs before this one: CTAs minus KV CTAs up to it
            if (cta == k * schedule.spacing) & (k < kv_ctas):
                c = k
            u = c * warps + (w - cta * warps)
        return u * self.cfg.passes_per_warp

    @cute.jit
    def load_tail_cos_sin(
        self, ok, position: Int64, cos_sin_cache: cute.Tensor, sub: Int32, slots: int, lanes: int
    ):
        """cos/sin of this lane's pairs in [D - R, D) (zeros elsewhere); its row's vector j is on lane
        j % lanes, slot j // lanes (of `slots`). Coherent loads whatever the config: callers issue them
        before the PDL wait, and ptxas moves a non-coherent load (LDG.CONSTANT) past it, a coherent one not."""
        tables = []
        for s in range_constexpr(slots):
            cos = kl.zero_f32_vector(kl.VEC // 2)
            sin = kl.zero_f32_vector(kl.VEC // 2)
            if const_expr((s + 1) * lanes > self.TAIL_VECTOR):
                j = s * lanes + sub
                if ok & (j >= self.TAIL_VECTOR):
                    kl.load_cos_sin_into(cos, sin, kl.base_address(cos_sin_cache), position, (j - self.TAIL_VECTOR) * (kl.VEC // 2), self.ROPE_DIM, False)  # fmt: skip
            tables.append((cos, sin))
        return tables

    @cute.jit
    def rotate_tail(self, ys, tables, ok, sub: Int32, slots: int, lanes: int, odd_cos=False):
        """RoPE on this lane's vectors that fall in [D - R, D), for rows with `ok` set (`odd_cos`:
        RopeOrder.ODD_COS, a run-time Boolean on the KV path)."""
        for s in range_constexpr(slots):
            if const_expr((s + 1) * lanes > self.TAIL_VECTOR):
                j = s * lanes + sub
                if ok & (j >= self.TAIL_VECTOR):
                    kl.rope_rotate(ys[s], tables[s][0], tables[s][1], odd_cos)

    @cute.jit
    def rotate_nope(self, ys, sub: Int32):
        """NopeRotation.IDENTITY: this lane's vectors in [0, D - R) through the rotation with cos = 1,
        sin = 0 (vLLM's V4.1 Triton writers): only signed zeros, NaN and Inf change."""
        for s in range_constexpr(self.slots):
            if const_expr(s * self.row_lanes < self.TAIL_VECTOR):
                if s * self.row_lanes + sub < self.TAIL_VECTOR:
                    kl.rope_identity(ys[s])

    @cute.jit
    def bad_ids(self, slot: Int64, position: Int64, args):
        """Checked mode: a row whose slot is past the cache or whose position is outside the table."""
        capacity = Int64(args.k_cache.shape[0]) * Int64(args.block_size)
        return (slot >= 0) & ((slot >= capacity) | (position < 0) | (position >= args.cos_sin_cache.shape[0]))

    @cute.jit
    def count_error(self, args, counter: int = 0):
        """Checked mode: one more bad row in errors[counter] (0: KV rows, 1: Q rows); a write, so after the wait."""
        self.wait_for_producer()
        cute.arch.atomic_add(
            kl.gmem_ptr(kl.base_address(args.errors), Int64(4 * counter), Int32, 4), Int32(1)
        )

    # ---- the chunk-interleaved Q layout through shared memory (q_rows.jinja, passes_per_warp > 1) ----
    @staticmethod
    def stage_row_bytes(row_bytes: int, rows: int) -> int:
        """Bytes from one staged row to the next: the row and 128 / rows bytes, so that neither the row-wise
        writes nor the chunk-wise reads of store_rows_interleaved meet a bank twice in one access phase."""
        return row_bytes + 128 // rows

    @cute.jit
    def stage_for_this_warp(self, row_bytes: int):
        """This warp's part of the CTA's staging buffer (a shared-memory address): passes_per_warp rows."""
        rows = self.cfg.passes_per_warp
        part = rows * self.stage_row_bytes(row_bytes, rows)
        buffer = SmemAllocator().allocate_array(
            cutlass.Uint8, part * self.cfg.warps_per_cta, byte_alignment=16
        )
        tidx, _, _ = cute.arch.thread_idx()
        return buffer.toint() + tidx // 32 * part

    @cute.jit
    def store_rows_interleaved(
        self, stage: Int32, lane: Int32, rows, dst: Int64, chunk_stride: Int64, streaming
    ):
        """Store u = len(rows) rows of adjacent heads h0 .. h0 + u - 1 (h0 % u == 0) of one token in the
        chunk-interleaved layout, every store instruction writing u heads' pieces of a chunk as one run
        (u x 32 bytes for bf16). rows[k][s] is head h0 + k's vector j = 32 s + lane (16 or 8 bytes); `dst`
        is head h0's chunk 0; `chunk_stride` the bytes from a chunk to the next. Each row goes to this
        warp's `stage` as it is, and comes back chunk-wise: lane L stores half L % 2 of its chunk's piece
        of head h0 + L // 2 % u."""
        u = len(rows)
        vector_bytes = cute.size(rows[0][0]) * rows[0][0].element_type.width // 8
        words = vector_bytes // 4
        row_stride = self.stage_row_bytes(len(rows[0]) * 32 * vector_bytes, u)
        for k in range_constexpr(u):
            for s in range_constexpr(len(rows[0])):
                _stage_store(
                    stage + k * row_stride + (s * 32 + lane) * vector_bytes,
                    cute.recast_tensor(rows[k][s], Uint32),
                    words,
                )
        cute.arch.sync_warp()
        half = lane % 2
        k = lane // 2 % u
        for i in range_constexpr(u * len(rows[0])):
            c = i * (16 // u) + lane // (2 * u)  # 16 / u chunks per instruction
            piece = _stage_load(stage + k * row_stride + (2 * c + half) * vector_bytes, words)
            offset = Int64(c) * chunk_stride + Int64((2 * k + half) * vector_bytes)
            kl.store_vector(piece, dst, offset, Uint32, vector_bytes, streaming)
        cute.arch.sync_warp()  # (the warp's next rows overwrite the stage)


def _stage_view(address: Int32, n: int) -> cute.Tensor:
    """n (2 or 4) 32-bit words of shared memory at a 16-byte (n = 4) or 8-byte aligned address."""
    return cute.make_tensor(
        cute.make_ptr(Uint32, address, cute.AddressSpace.smem, assumed_align=4 * n), cute.make_layout(n)
    )


def _stage_store(address: Int32, words: cute.Tensor, n: int):
    cute.copy(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * n),
        words,
        _stage_view(address, n),
    )


def _stage_load(address: Int32, n: int) -> cute.Tensor:
    frag = cute.make_rmem_tensor(n, Uint32)
    cute.copy(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=32 * n),
        _stage_view(address, n),
        frag,
    )
    return frag
