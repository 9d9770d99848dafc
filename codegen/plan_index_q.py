"""What templates/index_q.py.jinja needs to know about one index_q variant (the indexer's Q prologue)."""

from __future__ import annotations

import struct

from attn_prologue import index_q_hadamard as hq
from attn_prologue import numerics as nx
from attn_prologue.formats import ElementCode
from attn_prologue.index_q import FP8_FLOOR, MXFP4_BLOCK, MXFP4_FLOOR, IndexQFlag
from attn_prologue.variants import IoDtype, Variant

from .plan import VEC, Argument


def _signature(v: Variant, mxfp4: bool) -> list[Argument]:
    """The compiled function's arguments in `Variant.arguments` order. q_in, weights, q_out, q_scales, weights_out
    and positions share the token count, and the first four the head count: TVM-FFI refuses a call whose counts
    differ before it launches. weights_out is taken as bytes (float32 or bf16: the weights_bf16 argument)."""
    d, io = "HEAD_DIM", "IO_DTYPE"
    row = "cute.sym_int64(divisibility=16)"
    code_bytes = f"{d} // 2" if mxfp4 else d
    tensors = {
        "q_in": f"make_fake_tensor({io}, (tokens, heads, {d}), ({row}, {d}, 1), assumed_align=16)",
        "weights": f"make_fake_tensor({io}, (tokens, heads), (cute.sym_int64(), 1), assumed_align=2)",
        "q_out": f"make_fake_tensor(Uint8, (tokens, heads, {code_bytes}), ({row}, {code_bytes}, 1), assumed_align=16)",
        "q_scales": f"make_fake_tensor(Uint8, (tokens, heads, {d} // 32), (cute.sym_int64(divisibility=4), {d} // 32, 1), assumed_align=4)",
        "weights_out": "make_fake_tensor(Uint8, (tokens, cute.sym_int32()), (cute.sym_int64(divisibility=2), 1), assumed_align=2)",
        "positions": "make_fake_compact_tensor(Int32 if config.positions32 else Int64, (tokens,), "
        "assumed_align=4 if config.positions32 else 8)",
        "cos_sin_cache": "make_fake_compact_tensor(Float32, (cute.sym_int32(), ROPE_DIM), stride_order=(1, 0), assumed_align=16)",
        "errors": "make_fake_compact_tensor(Int32, (2,), assumed_align=4)",
    }
    scalars = {
        "weights_scale": ("Float32", "Float32(1.0)"),
        "head_scale": ("Float32", "Float32(1.0)"),
        "weights_bf16": ("Int32", "Int32(0)"),
        "numerics": ("Int32", "Int32(0)"),  # index_q.IndexQFlag bits
        "checked": ("Int32", "Int32(0)"),
        "max_ctas": ("Int32", "Int32(0)"),
    }
    out = {name: Argument(name, "cute.Tensor", fake) for name, fake in tensors.items()}
    out.update({name: Argument(name, t, fake) for name, (t, fake) in scalars.items()})
    return [out[name] for name in v.arguments]


def _unread_flags(v: Variant, mxfp4: bool) -> set:
    f = IndexQFlag
    unread = {f.FP8_LINEAR_SCALE, f.FP8_UNSCALED} if mxfp4 else {f.INF_INVERSE_ZERO}
    return unread | ({f.ROTATED_BF16} if v.io_dtype is IoDtype.BF16 else set())


def _bf16_word(value: float) -> int:
    """The bfloat16 bits of `value` (exact in bfloat16)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0 and struct.unpack("<f", struct.pack("<I", bits))[0] == value, value
    return bits >> 16


def _mxfp4_constants() -> dict:
    return {
        "HADAMARD_FLOOR": "FP8_FLOOR",
        "TIES_DOWN_SHRINK": f"float.fromhex({nx.E2M1_TIES_DOWN_SHRINK.hex()!r})  # numerics.E2M1_TIES_DOWN_SHRINK",
    }


def make_index_q_plan(v: Variant) -> dict:
    mxfp4 = v.format.element is ElementCode.E2M1
    lanes = v.head_dim // (2 * VEC)  # two vectors a lane: j and j + lanes
    return {
        "lanes_per_row": lanes,  # (the module's own: LaunchConfig.q_lanes may give 4)
        "tail_vector": (v.head_dim - v.rope_dim) // VEC,
        "io_bytes": 2,
        "mxfp4": mxfp4,
        "block_lanes": MXFP4_BLOCK // VEC,
        "mxfp4_floor": f"float.fromhex({MXFP4_FLOOR.hex()!r})",
        # the bits a module reads: ROTATED_BF16 changes nothing for bf16 rows, each format has its own
        "numerics_flags": {f.name: int(f) for f in IndexQFlag if f not in _unread_flags(v, mxfp4)},
        "default_numerics": 0,
        # the scales' amax floor (fp8; both formats under HADAMARD) and the Hadamard transform's facts
        "constants": {
            "FP8_FLOOR": f"{FP8_FLOOR!r}  # fl32: 0x38D1B717",
            **(_mxfp4_constants() if mxfp4 else {}),
            "HADAMARD_SCALE": f"float.fromhex({hq.HADAMARD_SCALE.item().hex()!r})  # fl32(128 ** -0.5)",
            "NATURAL_STAGES": repr(hq.NATURAL_STAGES) + "  # the butterflies' index bits, in order",
            "TRITON_SM90_STAGES": repr(hq.TRITON_SM90_STAGES),
            "TRITON_SM100_STAGES": repr(hq.TRITON_SM100_STAGES),
        },
        # what conversions/*.jinja read: the E2M1 packing of I/O-dtype values only (no UE8M0 instruction)
        "needs_e2m1": mxfp4,
        "e2m1_float_codes": False,  # (its codes are the float16 ones, e2m1_pack8_io, or the Hadamard rule's)
        "needs_ue8m0": False,
        "e2m1_io_codes": mxfp4,  # (the codes of I/O-dtype values times a power of two: e2m1_pack8_io)
        # bf16 rows: the conversions block's Bf16RowCodes says whether they are coded from bfloat16 words
        # (the portable modules: e2m1_pack8_bf16_pairs) or from float32 (the native ones)
        "bf16_e2m1_rows": mxfp4 and v.io_dtype is IoDtype.BF16,
        "bf16_ties_down_shrinks": hex(_bf16_word(nx.E2M1_TIES_DOWN_SHRINK_BF16) * 0x10001),
        "scale": "ue8m0",
        "signature": _signature(v, mxfp4),
        "shared_symbols": {"tokens": "cute.sym_int32()", "heads": "cute.sym_int32()"},
    }


def describe_index_q(v: Variant) -> str:
    q = (
        "FP8 (per-row power-of-two scale folded into weights_out)"
        if v.format.element is ElementCode.E4M3
        else "MXFP4"
    )
    return f"indexer Q RoPE + {q} quantize; D={v.head_dim}, R={v.rope_dim}, {v.io_dtype.value} I/O."
