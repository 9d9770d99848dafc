"""Input builders for GPU tests: fresh random data, poisoned outputs, and the reference result.

Every case compares the kernel against `reference` (order="kernel") run on clones of the same
poisoned outputs, so the comparison covers every byte: written records, scale bytes, pad bytes,
untouched cache bytes (other blocks, skipped rows, page padding), q_out pad heads and rows >= N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from attn_prologue import reference
from attn_prologue.formats import get_format
from attn_prologue.variants import IoDtype, QOut, Variant

# Launch configs covering every knob: CTA size, passes per warp, PDL, ld.global.nc, persistent grids
# (cases with n=513 exceed 4 CTAs x 132 SMs, so warps stride), KV spread, streaming hints with a
# register cap (the default config has streaming hints: every other GPU test runs them). The GPU suite runs them
# against the reference; tests/test_build.py compiles them for every arch.
CONFIG_KEYS = [
    "w4_u1_pdl1_nc1_spread",
    "w8_u2_pdl0_nc0_spread",
    "w2_u4_pdl1_nc1",
    "w1_u4_pdl0_nc1_spread",
    "w16_u1_pdl1_nc1_spread",
    "w4_u2_pdl1_nc1_c4",
    "w4_u1_pdl1_nc1_c4_spread",
    "w8_u1_pdl0_nc0_cs_m6",
    "w4_u1_pdl1_nc1_cs_lq",  # lean_quant: the leaner exact quantization arithmetic
    "w8_u1_pdl1_nc1_cs_d",  # defaults_only: the parity choices folded to the format defaults
    "w4_u2_pdl1_nc1_cs_lq_d_r2",  # row_split: a KV row over 2 warps (only the modules that take it)
    "w4_u1_pdl1_nc1_cs_lq_late",  # cos_sin_late: the cos/sin rows loaded after the PDL wait
    "w4_u1_pdl1_nc1_cs_lq_d",  # lean_quant with defaults_only: the SM90 E2M1 codes in float16 pairs
    "w2_u2_pdl1_nc1_lq_d_q16",  # q_lanes: a Q row on 16 lanes (only the modules with Q rows)
    "w4_u1_pdl1_nc1_cs_q8",  # and on 8 (D = 128: half its default)
]
CONFIG_VARIANTS = [
    "qkv_d512r64_fp8_ds_mla_bf16_sm90",
    "qkv_d128r64_mxfp4_bf16_sm90",
    "qkv_q8_d128r64_fp8_token_bf16_sm90",
    "kv_norm_d512r64_mxfp8_bf16_sm90",
    "kv_d512r64_nvfp4_v41_bf16_sm90",  # lean_quant's x / s, 1 / s and E2M1 rounding
    "kv_d512r64_nvfp4_v41_fp16_sm90",  # the float16 quotient codes of fp16 rows
    "kv_norm_d128r64_mxfp4_bf16_sm90",  # the float16 codes after the weighted norm
    "qkv_d512r64_nvfp4_dsv4_bf16_sm90",  # lean_quant's amax / 6 and 1 / s
]


@dataclass
class Case:
    n: int
    h: int = 8
    p: int = 8
    head_dim: int = 512
    rope_dim: int = 64
    cache_format: str = "fp8_ds_mla"
    dtype: str = "bf16"
    block_size: int = 64
    m: int | None = None  # None: m = n
    page_pad: int = 0  # extra bytes per block (page stride larger than the data)
    page_align: int = (
        16  # the page stride is rounded up to a multiple of this (vLLM: 576 for V4, 512 for V4.1)
    )
    kv_row_pad: int = 0  # kv is a row slice of a wider tensor with this many extra columns
    extra_rows: int = 3  # q_out rows beyond N (must stay untouched)
    negative_every: int = 0  # every k-th kv row gets slot -1
    scale: float = 1.0  # input magnitude
    zero_rows: int = 0  # first rows of kv (and q) are all zeros
    num_blocks: int | None = None
    q_fp8: bool = False
    op: str = "qkv"
    seed: int = 0
    max_pos: int = 4096
    in_place: bool = False
    numerics: str = ""  # parity choices (formats.Numerics spelling); "" = the format's defaults
    apply_q_norm: bool = True
    apply_q_rope: bool = True
    q_layout: str = "head_major"
    compress_ratio: int = 1  # KV-only ops: group-boundary rows only
    slot_dtype: str = "int64"

    def __str__(self):
        return (
            f"{self.op}-{self.cache_format}-{self.dtype}-D{self.head_dim}-N{self.n}-H{self.h}P{self.p}"
            f"-bs{self.block_size}"
            + (f"-M{self.m}" if self.m is not None else "")
            + ("-q8" if self.q_fp8 else "")
            + (f"-[{self.numerics}]" if self.numerics else "")
            + ("-nonorm" if not self.apply_q_norm else "")
            + ("-norope" if not self.apply_q_rope else "")
            + ("-qi" if self.q_layout == "interleaved" else "")
            + (f"-r{self.compress_ratio}" if self.compress_ratio != 1 else "")
            + ("-i32" if self.slot_dtype == "int32" else "")
        )


def module_fields(v: Variant) -> dict:
    """The Case fields a generated module's name fixes (its Q layout aside: callers choose heads that
    layout takes)."""
    return dict(
        head_dim=v.head_dim,
        rope_dim=v.rope_dim,
        cache_format=v.cache_format,
        dtype=v.io_dtype.value,
        op=v.op.value,
        q_fp8=v.q_out is QOut.FP8,
    )


@dataclass
class Inputs:
    case: Case
    q_in: torch.Tensor | None
    kv: torch.Tensor
    q_out: torch.Tensor | None
    k_cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_scale: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def make_inputs(c: Case, device="cuda") -> Inputs:
    g = torch.Generator(device=device).manual_seed(c.seed)
    dt = IoDtype(c.dtype).torch_dtype
    fmt = get_format(c.cache_format)
    m = c.n if c.m is None else c.m
    d = c.head_dim
    q_in = None
    if c.op == "qkv":
        q_in = (torch.randn(c.n, c.h, d, generator=g, device=device) * c.scale).to(dt)
        if c.zero_rows:
            q_in[: c.zero_rows] = 0
    wide = torch.randn(max(c.n, m), d + c.kv_row_pad, generator=g, device=device) * c.scale
    kv = wide.to(dt)[:, :d]
    if c.zero_rows:
        kv[: c.zero_rows] = 0
    # one token per slot, shuffled over the cache, crossing block boundaries
    bpt = fmt.bytes_per_token(d)
    num_blocks = c.num_blocks or max(2, (m + c.block_size - 1) // c.block_size * 2 + 1)
    block_bytes = c.block_size * bpt
    page = block_bytes + c.page_pad
    page = (page + c.page_align - 1) // c.page_align * c.page_align
    storage = torch.randint(0, 256, (num_blocks, page), generator=g, device=device, dtype=torch.uint8)
    k_cache = storage[:, :block_bytes] if page > block_bytes else storage  # a view: stride(0) > its width
    slots = torch.randperm(num_blocks * c.block_size, generator=g, device=device)[:m].to(torch.int64)
    if c.negative_every:
        slots[:: c.negative_every] = -1
    slots = slots.to(getattr(torch, c.slot_dtype))
    positions = torch.randint(0, c.max_pos, (max(c.n, m),), generator=g, device=device, dtype=torch.int64)
    if c.op == "qkv":
        positions = positions[: c.n].contiguous()
    theta = torch.rand(c.max_pos, c.rope_dim // 2, generator=g, device=device) * 6.28
    cos_sin = torch.cat((torch.cos(theta), torch.sin(theta)), dim=1).contiguous()
    q_out = None
    q_scale = None
    if c.op == "qkv":
        if c.in_place:
            q_out = q_in
        elif c.q_fp8:
            q_out = torch.full((c.n + c.extra_rows, c.p, d), 0x7F, dtype=torch.uint8, device=device).view(
                torch.float8_e4m3fn
            )
            q_scale = torch.tensor([0.05], device=device)
        else:
            q_out = torch.full((c.n + c.extra_rows, c.p, d), float("nan"), dtype=dt, device=device)
    kv_scale = torch.tensor([0.02], device=device) if fmt.needs_tensor_scale else None
    norm_weight = (torch.rand(d, generator=g, device=device) + 0.5).to(dt) if c.op == "kv_norm" else None
    return Inputs(
        c,
        q_in,
        kv,
        q_out,
        k_cache,
        slots,
        positions,
        cos_sin,
        kv_scale,
        q_scale,
        norm_weight,
        extra={"k_storage": storage},
    )


def clone_outputs(x: Inputs) -> Inputs:
    """Same inputs, fresh copies of the outputs (the cache keeps its layout and strides)."""
    storage = x.extra["k_storage"].clone()
    k_cache = storage[:, : x.k_cache.shape[1]]
    q_out = x.q_out.clone() if x.q_out is not None else None
    q_in = x.q_in
    if x.case.in_place:
        q_in = q_out = x.q_in.clone()
    return Inputs(
        x.case,
        q_in,
        x.kv,
        q_out,
        k_cache,
        x.slot_mapping,
        x.positions,
        x.cos_sin_cache,
        x.kv_scale,
        x.q_scale,
        x.norm_weight,
        extra={"k_storage": storage},
    )


def run_reference(x: Inputs, order="kernel", write_pad_heads=True) -> Inputs:
    r = clone_outputs(x)
    c = x.case
    if c.op == "qkv":
        reference.qnorm_rope_kv_insert(
            r.q_in,
            r.kv,
            r.q_out,
            r.k_cache,
            r.slot_mapping,
            r.positions,
            r.cos_sin_cache,
            1e-6,
            c.block_size,
            c.cache_format,
            kv_scale=r.kv_scale,
            q_scale=r.q_scale,
            write_pad_heads=write_pad_heads,
            order=order,
            numerics=c.numerics,
            apply_q_norm=c.apply_q_norm,
            apply_q_rope=c.apply_q_rope,
            q_layout=c.q_layout,
        )
    else:
        reference.kv_rope_insert(
            r.kv,
            r.k_cache,
            r.slot_mapping,
            r.positions,
            r.cos_sin_cache,
            c.block_size,
            c.cache_format,
            norm_weight=r.norm_weight,
            eps=1e-6,
            kv_scale=r.kv_scale,
            order=order,
            numerics=c.numerics,
            compress_ratio=c.compress_ratio,
        )
    return r


def run_kernel(x: Inputs, write_pad_heads=True, **kw) -> Inputs:
    from attn_prologue import ops

    r = clone_outputs(x)
    c = x.case
    if c.op == "qkv":
        ops.qnorm_rope_kv_insert(
            r.q_in,
            r.kv,
            r.q_out,
            r.k_cache,
            r.slot_mapping,
            r.positions,
            r.cos_sin_cache,
            1e-6,
            c.block_size,
            c.cache_format,
            kv_scale=r.kv_scale,
            q_scale=r.q_scale,
            write_pad_heads=write_pad_heads,
            numerics=c.numerics or None,
            apply_q_norm=c.apply_q_norm,
            apply_q_rope=c.apply_q_rope,
            q_layout=c.q_layout,
            **kw,
        )
    else:
        ops.kv_rope_insert(
            r.kv,
            r.k_cache,
            r.slot_mapping,
            r.positions,
            r.cos_sin_cache,
            c.block_size,
            c.cache_format,
            norm_weight=r.norm_weight,
            eps=1e-6,
            kv_scale=r.kv_scale,
            numerics=c.numerics or None,
            compress_ratio=c.compress_ratio,
            **kw,
        )
    return r


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def compare(got: Inputs, want: Inputs) -> dict:
    """Byte-level comparison. Returns counts of differing bytes (all must be 0)."""
    out = {}
    out["cache_bytes_diff"] = int(
        (got.extra["k_storage"] != want.extra["k_storage"]).sum()
    )  # page padding too
    if got.q_out is not None:
        out["q_out_bytes_diff"] = int((raw(got.q_out) != raw(want.q_out)).sum())
    return out


def describe_mismatch(got: Inputs, want: Inputs) -> str:
    lines = []
    gc, wc = got.extra["k_storage"], want.extra["k_storage"]
    bad = (gc != wc).nonzero()
    if bad.numel():
        lines.append(
            f"cache: {bad.shape[0]} bytes differ; first at {bad[:5].tolist()}: got {gc[tuple(bad[0])].item()} want {wc[tuple(bad[0])].item()}"
        )
    if got.q_out is not None:
        gq, wq = got.q_out, want.q_out
        if gq.dtype != torch.float8_e4m3fn:
            diff = (gq.float() - wq.float()).abs()
            diff = torch.where(
                torch.isnan(gq.float()) & torch.isnan(wq.float()), torch.zeros_like(diff), diff
            )
            lines.append(
                f"q_out: max abs diff {diff.nan_to_num(1e9).max().item():.3g}, bytes differing {int((raw(gq) != raw(wq)).sum())}"
            )
        else:
            lines.append(f"q_out fp8: bytes differing {int((raw(gq) != raw(wq)).sum())}")
    return "; ".join(lines)


def boundaries(ratio: int):
    """Make about a third of the rows group boundaries ((position + 1) % ratio == 0), the rest not."""

    def mutate(x):
        pos = x.positions
        k = torch.arange(pos.shape[0], device=pos.device)
        group = torch.div(pos, ratio, rounding_mode="floor")
        on = (k % 3 == 0) & ((group + 1) * ratio - 1 < x.cos_sin_cache.shape[0])
        pos.copy_(torch.where(on, (group + 1) * ratio - 1, pos))

    return mutate
