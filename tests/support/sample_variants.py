"""Variants the generator's tests perturb and render: one per op, each on another arch family,
conversions mode, format and I/O dtype (all supported)."""

from __future__ import annotations

from attn_prologue.variants import ArchFamily, Conversions, IoDtype, Op, QOut, Variant

BASES = [
    Variant(Op.QKV, QOut.IO, 512, 64, "fp8_ds_mla", IoDtype.BF16, ArchFamily.SM120, Conversions.NATIVE),
    Variant(Op.KV, QOut.IO, 128, 64, "mxfp4", IoDtype.FP16, ArchFamily.SM100, Conversions.PORTABLE),
    Variant(Op.KV_NORM, QOut.IO, 128, 64, "bf16", IoDtype.FP16, ArchFamily.SM90, Conversions.PORTABLE),
]
