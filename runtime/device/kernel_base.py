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
    def stage_row_bytes(row_bytes: int, rows: int, vector_bytes: int = 16) -> int:
        """Bytes from one staged row to the next, for a stage of `rows` rows read back in `vector_bytes`
        pieces: the row and 128 / min(rows, 64 / vector_bytes) bytes. An access phase (8 lanes of 16-byte
        loads, 16 of 8-byte) then reads 64 / vector_bytes consecutive rows' two halves of one chunk, or all
        rows of two or more chunks, each bank once; the row-wise writes are contiguous."""
        return row_bytes + 128 // min(rows, 64 // vector_bytes)

    def warp_stage_bytes(self, row_vectors: int) -> int:
        """One warp's part of the staging buffer: passes_per_warp rows of `row_vectors` 16-byte vectors,
        spaced for the warp-wise stage (the widest spacing: the CTA-wide stage of the same rows fits, and an
        FP8 row's 8-byte pieces take half)."""
        rows = self.cfg.passes_per_warp
        return rows * self.stage_row_bytes(row_vectors * 16, rows)

    @cute.jit
    def stage_buffer(self, row_vectors: int):
        """The CTA's staging buffer (a shared-memory address): warp_stage_bytes a warp."""
        return (
            SmemAllocator()
            .allocate_array(
                cutlass.Uint8, self.cfg.warps_per_cta * self.warp_stage_bytes(row_vectors), byte_alignment=16
            )
            .toint()
        )

    @cute.jit
    def store_rows_interleaved(
        self,
        stage: Int32,
        lane: Int32,
        rows,
        dst: Int64,
        chunk_stride: Int64,
        streaming,
        cta_wide: cutlass.Constexpr,
    ):
        """Store G rows of adjacent heads h0 .. h0 + G - 1 (h0 % G == 0) of one token in the chunk-interleaved
        layout, every store instruction writing the G heads' pieces of 16 / G chunks, each as one run
        (G x 32 bytes for bf16). `rows` (u = len(rows)) are this warp's: with `cta_wide`, G = u x warps per
        CTA, every warp of the CTA calls this and holds heads h0 + w u .. (w: its warp in the CTA);
        otherwise G = u. rows[k][s] is the warp's head k's vector j = 32 s + lane (16 or 8 bytes); `dst` is
        head h0's chunk 0; `chunk_stride` the bytes from a chunk to the next; `stage` the CTA's buffer. The
        rows go to the stage as they are, and come back chunk-wise: lane L of the instruction i of the G S
        (S = len(rows[0])) stores half L % 2 of chunk c's piece of head h0 + L // 2 % G; the warp w stores
        instructions w u S .. of them."""
        u = len(rows)
        slots = len(rows[0])
        vector_bytes = cute.size(rows[0][0]) * rows[0][0].element_type.width // 8
        words = vector_bytes // 4
        warp = cute.arch.warp_idx()
        group = u * self.cfg.warps_per_cta if const_expr(cta_wide) else u
        row_stride = self.stage_row_bytes(slots * 32 * vector_bytes, group, vector_bytes)
        first = warp * u if const_expr(cta_wide) else 0  # this warp's first row in the group
        if const_expr(not cta_wide):
            stage = stage + warp * self.warp_stage_bytes(slots * 32)  # the warp's part (stage_buffer)
        for k in range_constexpr(u):
            for s in range_constexpr(slots):
                _stage_store(
                    stage + (first + k) * row_stride + (s * 32 + lane) * vector_bytes,
                    cute.recast_tensor(rows[k][s], Uint32),
                    words,
                )
        if const_expr(cta_wide):
            cute.arch.barrier()
        else:
            cute.arch.sync_warp()
        half = lane % 2
        k = lane // 2 % group
        for i in range_constexpr(u * slots):
            c = (first * slots + i) * (16 // group) + lane // (2 * group)  # 16 / G chunks per instruction
            piece = _stage_load(stage + k * row_stride + (2 * c + half) * vector_bytes, words)
            offset = Int64(c) * chunk_stride + Int64((2 * k + half) * vector_bytes)
            kl.store_vector(piece, dst, offset, Uint32, vector_bytes, streaming)
        if const_expr(not cta_wide):
            cute.arch.sync_warp()  # (the warp's next rows overwrite the stage; a CTA-wide stage is used once)


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
