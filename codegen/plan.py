"""What a template needs to know about one variant, derived from the variant and the format data.

Nothing here is a template decision: lane mapping, record sizes and the compiled signature all
follow from the variant's axes and attn_prologue.formats.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from attn_prologue.formats import CHOICE_TYPES, NUMERICS_FLAGS, AmaxFloor, ElementCode, ScaleCode
from attn_prologue.variants import IoDtype, Op, QFlag, QLayout, QOut, Variant

VEC = 8
WARP = 32
TOKENS = "tokens"  # name of the shared symbolic token count in the generated fake_arguments()
PAD_VECTORS_PER_LANE = 8  # pad heads are zeroed 4 KB per warp pass (32 lanes x 8 x 16 bytes)
# Lanes per Q row in the chunk-interleaved layout. 8 puts a warp's 4 rows (adjacent heads of one token)
# side by side in each 16-dim chunk, so a store writes 128-byte runs as head-major's do; on the H200 that
# was 1.0-2.0 points of the copy faster at T >= 2048 and 8% slower at T = 1 (each lane's chain 4x longer:
# results/experiments/bench-h200-writers-qi8.json.gz), so the rows keep the 32 lanes of head-major's
INTERLEAVED_Q_LANES = 32
# A compressed writer's call whose kv rows are at most this many bytes loads every row (r times the row
# bytes it needs) instead of running the scan kernel (positions first, then the boundary rows only).
# That saved a dependent round trip while the cos/sin rows were read after the PDL wait; since they are
# read before it, every row waits for its position anyway, and on the H200 the scan was as fast or
# faster at every size: T = 1 to 2048, 0 to 11% less time (results/experiments/spec-h200-9c651eb.txt).
# So every compressed call scans (0); the knob stays for a target where a measurement says otherwise.
SPECULATIVE_BYTES = 0


@dataclass(frozen=True)
class Argument:
    name: str
    dsl_type: str  # annotation in the compiled signature
    fake: str  # expression building its compile-time stand-in


def ceil_log2_f32(x: float) -> int:
    """ceil(log2(fl32(x))) for a positive normal x, from the float32 bits (as the kernels take it)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFFFF) >> 23) - 127


def _fakes(v: Variant) -> dict[str, Argument]:
    """Each argument's compiled type and compile-time stand-in (the order is `Variant.arguments`)."""
    io, d = "IO_DTYPE", "HEAD_DIM"
    sym, sym64 = "cute.sym_int32()", "cute.sym_int64(divisibility=8)"
    rows3 = f"({sym}, {sym}, {d}), ({sym64}, {d}, 1)"
    # q_in, kv and positions of the qkv op share one symbolic token count: TVM-FFI then refuses a
    # call whose row counts differ before launching (the Python hot path does not check them)
    tokens = TOKENS if v.op is Op.QKV else sym
    q_out_dtype = "Uint8" if v.q_out is QOut.FP8 else io
    tensors = {
        "q_in": f"make_fake_tensor({io}, ({tokens}, {sym}, {d}), ({sym64}, {d}, 1), assumed_align=16)",
        "kv": f"make_fake_tensor({io}, ({tokens}, {d}), ({sym64}, 1), assumed_align=16)",
        "q_out": f"make_fake_tensor({q_out_dtype}, {rows3}, assumed_align=16)",
        "norm_weight": f"make_fake_compact_tensor({io}, ({d},), assumed_align=16)",
        "k_cache": f"make_fake_tensor(Uint8, ({sym}, {sym}), (cute.sym_int64(divisibility=16), 1), assumed_align=16)",
        "slot_mapping": (
            f"make_fake_compact_tensor(Int32 if config.slots32 else Int64, ({sym},), "
            "assumed_align=4 if config.slots32 else 8)"  # 8: one 64-bit load, not two 32-bit halves
        ),
        "positions": f"make_fake_compact_tensor(Int64, ({tokens},), assumed_align=8)",
        "cos_sin_cache": f"make_fake_compact_tensor(Float32, ({sym}, ROPE_DIM), stride_order=(1, 0), assumed_align=16)",
        "kv_scale": "make_fake_compact_tensor(Float32, (1,), assumed_align=4)",
        "q_scale": "make_fake_compact_tensor(Float32, (1,), assumed_align=4)",
        "errors": "make_fake_compact_tensor(Int32, (2,), assumed_align=4)",
    }
    scalars = {
        "eps": ("Float32", "Float32(1e-6)"),
        "block_size": ("Int32", "Int32(64)"),
        "n_write_heads": ("Int32", "Int32(64)"),
        "q_flags": ("Int32", "Int32(0)"),  # variants.QFlag bits: Q steps skipped
        "compress_ratio": ("Int32", "Int32(1)"),  # KV rows inserted at group boundaries only
        "numerics": ("Int32", "Int32(0)"),  # formats.NumericsFlag bits: the parity choices
        "checked": ("Int32", "Int32(0)"),
        "max_ctas": ("Int32", "Int32(0)"),  # grid cap of persistent configs (SMs x CTAs per SM)
    }
    out = {name: Argument(name, "cute.Tensor", fake) for name, fake in tensors.items()}
    out.update({name: Argument(name, t, fake) for name, (t, fake) in scalars.items()})
    return out


def signature(v: Variant) -> list[Argument]:
    """The compiled function's run-time arguments, in `Variant.arguments` order."""
    fakes = _fakes(v)
    return [fakes[name] for name in v.arguments]


def make_plan(v: Variant) -> dict:
    f = v.format
    d, r = v.head_dim, v.rope_dim
    lanes = min(WARP, d // VEC)
    nq, tail = f.dims(d)
    if f.element is ElementCode.BF16:
        encoder = "bf16"
    elif f.scale is ScaleCode.TENSOR_F32:
        encoder = "fp8_tensor"
    else:
        encoder = "block_scaled"
    sig = signature(v)
    choices = f.numerics_choices()
    q_lanes = min(lanes, INTERLEAVED_Q_LANES) if v.q_layout is QLayout.INTERLEAVED else lanes
    io_bytes = 2  # bf16 and fp16 rows
    return {
        "lanes_per_row": lanes,
        "q_lanes_per_row": q_lanes,
        "rows_per_pass": WARP // lanes,
        "slots": d // (VEC * lanes),
        "tail_vector": (d - r) // VEC,
        "io_bytes": io_bytes,
        "speculative_rows": SPECULATIVE_BYTES // (d * io_bytes),
        "q_out_bytes": 1 if v.q_out is QOut.FP8 else 2,
        "pad_vectors_per_lane": PAD_VECTORS_PER_LANE,
        "encoder": encoder,
        "data_bytes": f.data_bytes(d),
        "scale_bytes": f.scale_bytes(d),
        "quant_vectors": nq // VEC,
        "has_tail": tail > 0,
        "quant_block": f.quant_block,
        "num_scales": f.num_scales(d),
        "scale_pad": f.scale_pad_bytes,
        "amax_floor": repr(f.amax_floor),
        "element_max": repr(f.fp_max),
        "element": f.element.value,
        "element_bytes_per_vector": VEC if f.element is ElementCode.E4M3 else VEC // 2,
        "divide": f.divide_by_fp_max,
        "scale": {ScaleCode.UE8M0: "ue8m0", ScaleCode.E4M3: "e4m3"}.get(f.scale, "f32"),
        "scale_clamp": tuple(repr(b) for b in f.scale_clamp) if f.scale_clamp else None,
        "divide_by_scale": f.divide_by_scale,
        # the parity choices this format has (formats.Numerics), read from the run-time `numerics` bits
        "numerics_flags": {
            NUMERICS_FLAGS[field][value].name: int(NUMERICS_FLAGS[field][value])
            for field, values in choices.items()
            for value in values
            if value in NUMERICS_FLAGS[field]
        },
        "choices": {field: field in choices for field in CHOICE_TYPES},
        "default_numerics": f.numerics_flags(),  # the defaults' bits: what a defaults_only module reads
        # ScaleFloor.SCALE as the least UE8M0 byte: 127 + ceil(log2(fl32(floor))), for AmaxFloor.E4 / E8
        "floor_bytes": tuple(ceil_log2_f32(float(v.value)) + 127 for v in AmaxFloor),
        "needs_e2m1": f.element is ElementCode.E2M1,
        "e2m1_float_codes": True,  # the float32 codes (portable e2m1_pack8): every writer calls them
        # E2M1 codes of rows in the I/O dtype (lean_quant): float16 pairs in software, exact where the value
        # coded is x * 2^-e or the quotient x / s (mxfp4, nvfp4_v41), and x * fl(1 / s) (nvfp4_dsv4) for
        # bf16 rows only (tests/test_lean_quant_cpu.py)
        "e2m1_io_codes": f.element is ElementCode.E2M1
        and (f.scale is ScaleCode.UE8M0 or f.divide_by_scale or v.io_dtype is IoDtype.BF16),
        "bf16_e2m1_rows": False,  # (index_q's bf16 rows only: plan_index_q)
        "needs_ue8m0": f.scale in (ScaleCode.UE8M0, ScaleCode.F32_POW2),
        "q_flags": {flag.name: int(flag) for flag in QFlag} if v.op.has_q else {},
        "interleaved": v.q_layout is QLayout.INTERLEAVED,
        "signature": sig,
        "shared_symbols": {TOKENS: "cute.sym_int32()"} if v.op is Op.QKV else {},
    }


def describe(v: Variant) -> str:
    q = ""
    if v.op is Op.QKV:
        q = f"Q RMSNorm + RoPE into q_out ({'e4m3, per-tensor scale' if v.q_out is QOut.FP8 else v.io_dtype.value}), "
    norm = "weighted RMSNorm + " if v.op is Op.KV_NORM else ""
    return f"{q}KV {norm}RoPE + {v.cache_format} encode + paged insert; D={v.head_dim}, R={v.rope_dim}, {v.io_dtype.value} I/O."
