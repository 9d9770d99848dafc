"""The variant space as data: every axis is an Enum with small name tables, one predicate says why
a combination is unsupported, and one naming function gives the identity used everywhere (module
file, kernel symbol, registry key, kernel-cache key)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from attn_prologue.formats import FORMATS, CacheFormat, ElementCode, ScaleCode, get_format


class Op(enum.Enum):
    QKV = "qkv"  # Q norm + RoPE into q_out, KV RoPE + quantize + insert
    KV = "kv"  # KV RoPE + quantize + insert only
    KV_NORM = "kv_norm"  # KV weighted RMSNorm (rounded to the I/O dtype), RoPE, quantize, insert

    @property
    def has_q(self) -> bool:
        return self is Op.QKV


class QOut(enum.Enum):
    IO = "io"  # q_out in the I/O dtype
    FP8 = "fp8"  # q_out as e4m3 with a per-tensor float32 scale (for FP8 attention)

    @property
    def name_part(self) -> str:
        return "_q8" if self is QOut.FP8 else ""


class IoDtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dsl(self) -> str:
        return {"bf16": "cutlass.BFloat16", "fp16": "cutlass.Float16"}[self.value]

    @property
    def torch_name(self) -> str:
        return {"bf16": "bfloat16", "fp16": "float16"}[self.value]


class ArchFamily(enum.Enum):
    SM90 = "sm90"
    SM100 = "sm100"
    SM120 = "sm120"

    @property
    def targets(self) -> tuple[str, ...]:
        """Compile targets. A cubin for sm_120a does not load on sm_121a (GB10): build both."""
        return {"sm90": ("sm_90a",), "sm100": ("sm_100a",), "sm120": ("sm_120a", "sm_121a")}[self.value]

    @property
    def has_native_block_conversions(self) -> bool:
        """cvt.rp.satfinite.ue8m0x2.f32 and cvt.rn.satfinite.e2m1x2.f32 exist (spec/formats.md)."""
        return self is not ArchFamily.SM90

    @classmethod
    def of_capability(cls, major: int, minor: int) -> ArchFamily:
        if major == 9:
            return cls.SM90
        if major == 10:
            return cls.SM100
        if major == 12:
            return cls.SM120
        raise KeyError(f"no arch family for compute capability {major}.{minor}")


class Conversions(enum.Enum):
    NATIVE = "native"  # hardware UE8M0 / E2M1 conversions (SM100, SM120)
    PORTABLE = "portable"  # integer UE8M0 and software E2M1 (SM90; the fallback elsewhere)


OPS = tuple(Op)
Q_OUTS = tuple(QOut)
IO_DTYPES = tuple(IoDtype)
ARCH_FAMILIES = tuple(ArchFamily)
CONVERSIONS = tuple(Conversions)
# (head dim, rope dim) pairs generated; the template takes any D with D % 256 == 0 or D == 128.
HEAD_DIMS = ((512, 64), (128, 64))


@dataclass(frozen=True, order=True)
class Variant:
    """The identity of one generated kernel module."""

    op: Op
    q_out: QOut
    head_dim: int
    rope_dim: int
    cache_format: str
    io_dtype: IoDtype
    arch: ArchFamily
    conversions: Conversions

    @property
    def name(self) -> str:
        suffix = (
            "_portable"
            if (self.conversions is Conversions.PORTABLE and self.arch.has_native_block_conversions)
            else ""
        )
        return (
            f"{self.op.value}{self.q_out.name_part}_d{self.head_dim}r{self.rope_dim}_{self.cache_format}"
            f"_{self.io_dtype.value}_{self.arch.value}{suffix}"
        )

    @property
    def format(self) -> CacheFormat:
        return get_format(self.cache_format)

    @property
    def uses_arch_conversions(self) -> bool:
        """Does the format need a UE8M0 or E2M1 conversion (the arch-specific pieces)?"""
        f = self.format
        return f.scale in (ScaleCode.UE8M0, ScaleCode.F32_POW2) or f.element is ElementCode.E2M1

    def __str__(self) -> str:
        return self.name


def unsupported_reason(v: Variant) -> str | None:
    """Why a combination is not generated (None: supported). One predicate for the whole space."""
    f = v.format
    d, r = v.head_dim, v.rope_dim
    if not (d == 128 or d % 256 == 0):
        return f"head_dim={d}: the lane mapping needs D == 128 or D % 256 == 0"
    if r % 8 != 0 or not 0 < r <= d:
        return f"rope_dim={r}: needs 0 < R <= D and R % 8 == 0 (a 128-bit vector holds 4 rope pairs)"
    if not f.supports_head_dim(d, r):
        return f"{f.name} stores D={f.head_dim}/R={f.rope_dim} records, not D={d}/R={r}"
    if f.quant_block and f.dims(d)[0] % f.quant_block:
        return f"{f.name}: {f.dims(d)[0]} quantized dims are not a multiple of the block {f.quant_block}"
    if v.q_out is QOut.FP8 and not v.op.has_q:
        return f"op {v.op.value} writes no Q, so an FP8 Q output does not apply"
    if v.conversions is Conversions.NATIVE and not v.arch.has_native_block_conversions:
        return f"{v.arch.value} has no native ue8m0x2/e2m1x2 conversions (use the portable ones)"
    if (
        v.conversions is Conversions.PORTABLE
        and v.arch.has_native_block_conversions
        and not v.uses_arch_conversions
    ):
        return f"{f.name} uses no UE8M0/E2M1 conversion, so a portable {v.arch.value} module would equal the native one"
    return None


def all_combinations() -> Iterator[Variant]:
    for op, q_out, (d, r), fmt, dt, arch, cv in itertools.product(
        OPS, Q_OUTS, HEAD_DIMS, sorted(FORMATS), IO_DTYPES, ARCH_FAMILIES, CONVERSIONS
    ):
        yield Variant(op, q_out, d, r, fmt, dt, arch, cv)


def variant_space() -> list[Variant]:
    """Every supported variant, sorted by name."""
    return sorted((v for v in all_combinations() if unsupported_reason(v) is None), key=lambda v: v.name)


def dropped_combinations() -> list[tuple[Variant, str]]:
    return [(v, why) for v in all_combinations() if (why := unsupported_reason(v)) is not None]


def parse_name(name: str) -> Variant:
    """The inverse of Variant.name (for the CLI and the kernel cache)."""
    for v in all_combinations():
        if v.name == name and unsupported_reason(v) is None:
            return v
    raise KeyError(f"no generated variant named {name!r}")
