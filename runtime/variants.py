"""The variant space as plain data, shared by codegen and the serving path.

Every axis is an Enum with its small name tables; `Variant.name` is the one identity (module file,
registry key, kernel-cache key); `unsupported_reason` is the one predicate that says why a
combination is not generated; `ArchFamily` holds the arch facts (capability -> family -> compile
targets, native conversions, default launch config). Codegen enumerates and renders the space;
the runtime reads the generated registry (the sorted names) and resolves requests with `find`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from .errors import UnsupportedError
from .formats import FORMATS, CacheFormat, ElementCode, ScaleCode, get_format
from .launch import LaunchConfig


class Op(enum.Enum):
    QKV = "qkv"  # Q norm + RoPE into q_out, KV RoPE + quantize + insert
    KV = "kv"  # KV RoPE + quantize + insert only
    KV_NORM = "kv_norm"  # KV weighted RMSNorm (rounded to the I/O dtype), RoPE, quantize, insert
    INDEX_Q = "index_q"  # the sparse indexer's Q: RoPE, FP8 / MXFP4 quantize, weights folded (index_q.py)

    @property
    def has_q(self) -> bool:
        return self is Op.QKV


class QOut(enum.Enum):
    IO = "io"  # q_out in the I/O dtype
    FP8 = "fp8"  # q_out as e4m3 with a per-tensor float32 scale (for FP8 attention)

    @property
    def name_part(self) -> str:
        return "_q8" if self is QOut.FP8 else ""


class QLayout(enum.Enum):
    """Where q_out's values go within one token's P * D elements."""

    HEAD_MAJOR = "head_major"  # [P, D]: head h, dim d at h * D + d
    INTERLEAVED = "interleaved"  # [D / 16, P, 16]: dim d of head h at (d // 16) * P * 16 + h * 16 + d % 16

    @property
    def name_part(self) -> str:
        return "_qi" if self is QLayout.INTERLEAVED else ""


# The interleaved layout is FlashMLA's fused Q input on SM100 (vLLM's `is_q_interleaved`): generated for
# the caches it reads there, bf16 I/O, and the padded head counts its kernels take.
INTERLEAVED_FORMATS = ("fp8_ds_mla", "mxfp8")
INTERLEAVED_PADDED_HEADS = (64, 128)


class QFlag(enum.IntFlag):
    """The qkv op's run-time Q switches: bits of its `q_flags` argument (a set bit skips a step).
    Run-time, not variant axes: a skipped step is a uniform branch around work the kernel would do."""

    NO_NORM = 1  # apply_q_norm=False: Q is already normalized (DeepSeek-V4.1)
    NO_ROPE = 2  # apply_q_rope=False: the attention kernel rotates Q itself


def q_flags(apply_q_norm: bool = True, apply_q_rope: bool = True) -> int:
    return (0 if apply_q_norm else QFlag.NO_NORM) | (0 if apply_q_rope else QFlag.NO_ROPE)


class IoDtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dsl(self) -> str:
        return {"bf16": "cutlass.BFloat16", "fp16": "cutlass.Float16"}[self.value]

    @property
    def torch_dtype(self):
        import torch  # here, not at the top: codegen imports this module and needs no torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @classmethod
    def of_torch(cls, dtype) -> IoDtype | None:
        """The I/O dtype of a torch dtype, or None if kernels take no such dtype."""
        return next((io for io in cls if io.torch_dtype == dtype), None)


class Conversions(enum.Enum):
    NATIVE = "native"  # hardware UE8M0 / E2M1 conversions (SM100, SM120)
    PORTABLE = "portable"  # integer UE8M0 and software E2M1 (SM90; the fallback elsewhere)


# Launch defaults per family: 4-warp CTAs, PDL, ld.global.nc, streaming hints on every family for now.
# codegen/archs.py gives the arithmetic behind them and what was measured (`list --archs` prints it).
_DEFAULT = LaunchConfig(warps_per_cta=4, pdl=True, non_coherent=True, streaming=True)


class ArchFamily(enum.Enum):
    SM90 = "sm90"
    SM100 = "sm100"
    SM120 = "sm120"

    @property
    def targets(self) -> tuple[str, ...]:
        """Compile targets, one per distinct binary its GPUs need (sm_120f serves 12.0 and 12.1)."""
        return tuple(dict.fromkeys(t for fam, t in CAPABILITIES.values() if fam is self))

    @property
    def has_native_block_conversions(self) -> bool:
        """cvt.rp.satfinite.ue8m0x2.f32 and cvt.rn.satfinite.e2m1x2.f32 exist."""
        return self is not ArchFamily.SM90

    @property
    def default_conversions(self) -> Conversions:
        return Conversions.NATIVE if self.has_native_block_conversions else Conversions.PORTABLE

    @property
    def default_config(self) -> LaunchConfig:
        return {"sm90": _DEFAULT, "sm100": _DEFAULT, "sm120": _DEFAULT}[self.value]


# compute capability -> (arch family, compile target): the one table the runtime dispatches on.
# A cubin for an "a" target loads on that capability only. The SM120 GPUs (RTX 50xx and RTX PRO 6000
# Blackwell at 12.0, GB10 at 12.1) share the family-specific target sm_120f, whose cubin loads on every
# 12.x with x >= 0 (NVIDIA, "NVIDIA Blackwell and NVIDIA CUDA 12.9 Introduce Family-Specific
# Architecture Features", developer.nvidia.com/blog, 2025): ptxas emits the same SASS for it as for sm_120a and sm_121a (no instruction these
# kernels use is specific to one of them: tests/test_emitted_knobs.py compares the three), so one
# build serves both. B300 (10.3) and Thor (11.0) run the SM100 modules compiled for sm_103a / sm_110a,
# each its own target: sm_103a's SASS is not sm_100a's.
CAPABILITIES: dict[tuple[int, int], tuple[ArchFamily, str]] = {
    (9, 0): (ArchFamily.SM90, "sm_90a"),
    (10, 0): (ArchFamily.SM100, "sm_100a"),
    (10, 3): (ArchFamily.SM100, "sm_103a"),
    (11, 0): (ArchFamily.SM100, "sm_110a"),
    (12, 0): (ArchFamily.SM120, "sm_120f"),
    (12, 1): (ArchFamily.SM120, "sm_120f"),
}
TARGETS = tuple(dict.fromkeys(t for _, t in CAPABILITIES.values()))
# what `build` compiles unless told otherwise: each extra SM100 target adds ~90 kernels (~40 s on two
# cores) for GPUs few deployments have; `build --targets sm_103a` prebuilds one, and without that a
# B300 or Thor compiles what it binds on first use (seconds per kernel, then cached)
DEFAULT_BUILD_TARGETS = ("sm_90a", "sm_100a", "sm_120f")


def arch_for_capability(major: int, minor: int) -> tuple[ArchFamily, str]:
    """(family, compile target) of a compute capability, or an UnsupportedError listing the known ones."""
    try:
        return CAPABILITIES[(major, minor)]
    except KeyError:
        known = ", ".join(f"{a}.{b} ({t})" for (a, b), (_, t) in sorted(CAPABILITIES.items()))
        raise UnsupportedError(
            f"no kernels for compute capability {major}.{minor}; supported: {known}"
        ) from None


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
    q_layout: QLayout = QLayout.HEAD_MAJOR

    @cached_property
    def name(self) -> str:
        portable = self.conversions is Conversions.PORTABLE and self.arch.has_native_block_conversions
        return (
            f"{self.op.value}{self.q_out.name_part}{self.q_layout.name_part}_d{self.head_dim}r{self.rope_dim}_{self.cache_format}"
            f"_{self.io_dtype.value}_{self.arch.value}{'_portable' if portable else ''}"
        )

    @property
    def stem(self) -> str:
        """The name less its arch part: what a request is called before a device picks the arch."""
        return self.name[: self.name.rindex(f"_{self.arch.value}")]

    @property
    def format(self) -> CacheFormat:
        return get_format(self.cache_format)

    @property
    def uses_arch_conversions(self) -> bool:
        """Does the format need a UE8M0 or E2M1 conversion (the arch-specific pieces)?"""
        f = self.format
        if self.op is Op.INDEX_Q:  # its scales come from the float32 bits on every target: only E2M1 differs
            return f.element is ElementCode.E2M1
        return f.scale in (ScaleCode.UE8M0, ScaleCode.F32_POW2) or f.element is ElementCode.E2M1

    @property
    def default_numerics(self) -> int:
        """The kernels' `numerics` bits when a call gives none (and what a defaults_only module folds)."""
        return 0 if self.op is Op.INDEX_Q else self.format.numerics_flags()

    @property
    def portable_fallback(self) -> Variant | None:
        """The portable-conversion module of the same variant, where it is a different module."""
        if self.conversions is Conversions.NATIVE and self.uses_arch_conversions:
            return _replace(self, conversions=Conversions.PORTABLE)
        return None

    @cached_property
    def arguments(self) -> tuple[str, ...]:
        """Run-time arguments of the compiled function, in order (the stream is the current torch
        stream). The template renders its signature from this, so it is the one argument order."""
        op, fmt = self.op, self.format
        if op is Op.INDEX_Q:
            scales = ["q_scales"] if fmt.element is ElementCode.E2M1 else []
            return ("q_in", "weights", "q_out", *scales, "weights_out", "positions", "cos_sin_cache", "errors",
                    "weights_scale", "head_scale", "weights_bf16", "numerics", "checked", "max_ctas")  # fmt: skip
        names = ["q_in"] if op is Op.QKV else []
        names.append("kv")
        if op is Op.QKV:
            names.append("q_out")
        if op is Op.KV_NORM:
            names.append("norm_weight")
        names += ["k_cache", "slot_mapping", "positions", "cos_sin_cache"]
        if fmt.needs_tensor_scale:
            names.append("kv_scale")
        if self.q_out is QOut.FP8:
            names.append("q_scale")
        names.append("errors")
        if op in (Op.QKV, Op.KV_NORM):
            names.append("eps")
        names.append("block_size")
        if op is Op.QKV:
            names += ["n_write_heads", "q_flags"]
        else:
            names.append("compress_ratio")
        names += ["numerics", "checked", "max_ctas"]
        return tuple(names)

    @property
    def row_splits(self) -> tuple[int, ...]:
        """The LaunchConfig.row_split values this module takes: a KV row over k warps, each with 1/k
        of the row's 128-bit vectors. Only the plain KV writer: its lanes reduce over a scale block
        (inside a warp) and never over the row (an RMSNorm or a Q row would need the whole row)."""
        vectors_per_lane = self.head_dim // 8 // 32  # a row over one warp: 128-bit vectors per lane
        if self.op is not Op.KV or vectors_per_lane < 2:
            return (1,)
        return tuple(k for k in (1, 2, 4) if vectors_per_lane % k == 0)

    @property
    def q_lanes(self) -> tuple[int, ...]:
        """The LaunchConfig.q_lanes values this module takes: 0 (its own) and each lane count of a warp
        that holds a Q row in whole 128-bit vectors; (0,) for a module without Q rows."""
        if self.op is Op.INDEX_Q:  # a row over 4 lanes (4 slots) or its own 8 (templates/index_q.py.jinja)
            return (0, 4, 8)
        if not self.op.has_q:
            return (0,)
        return (0,) + tuple(k for k in (8, 16, 32) if k <= self.head_dim // 8)

    def refusal(self, config) -> str | None:
        """Why this module's Kernel would refuse a LaunchConfig (the knobs only some modules take), or None."""
        if config.row_split not in self.row_splits:
            return (
                f"config {config.key} splits a KV row over {config.row_split} warps; {self.name} takes "
                f"row_split {self.row_splits} (only the plain KV writers of D >= 512 split a row)"
            )
        if config.q_lanes not in self.q_lanes:
            return f"config {config.key} puts a Q row on {config.q_lanes} lanes; {self.name} takes q_lanes {self.q_lanes}"
        if config.spread_kv and self.op is Op.INDEX_Q:
            return f"config {config.key} spreads KV rows; {self.name} has none (index_q writes Q rows only)"
        if config.positions32 and self.op is not Op.INDEX_Q:
            return f"config {config.key} takes int32 positions; only the index_q modules do ({self.name} takes int64)"
        return None

    def __str__(self) -> str:
        return self.name


def _replace(v: Variant, **changes) -> Variant:
    fields = {f: getattr(v, f) for f in Variant.__dataclass_fields__}
    fields.update(changes)
    return Variant(**fields)


def unsupported_reason(v: Variant) -> str | None:
    """Why a combination is not generated (None: supported). One predicate for the whole space."""
    f = v.format
    d, r = v.head_dim, v.rope_dim
    if v.op is Op.INDEX_Q and (why := _index_q_unsupported(v)):
        return why
    if not (d == 128 or d % 256 == 0):
        return f"head_dim={d}: the lane mapping needs D == 128 or D % 256 == 0"
    if r % 8 != 0 or not 0 < r <= d:
        return f"rope_dim={r}: needs 0 < R <= D and R % 8 == 0 (a 128-bit vector holds 4 rope pairs)"
    if not f.supports_head_dim(d, r):
        return f"{f.name} stores D={f.head_dim}/R={f.rope_dim} records, not D={d}/R={r}"
    if f.quant_block and f.dims(d)[0] % f.quant_block:
        return f"{f.name}: {f.dims(d)[0]} quantized dims are not a multiple of the block {f.quant_block}"
    if f.scale is ScaleCode.E4M3 and v.op is Op.KV_NORM:
        return (
            f"{f.name}: an NVFP4 MLA record is written from un-normed KV rows (kv_norm is the indexer path)"
        )
    if f.scale is ScaleCode.E4M3 and v.op is Op.QKV and not f.rope_tail_bf16:
        return (
            f"{f.name}: the V4.1 compressed cache is written by the kv-only writer; "
            "V4.1's fused qkv call writes the sliding-window cache (mxfp8)"
        )
    if v.q_layout is QLayout.INTERLEAVED:
        if not v.op.has_q:
            return f"op {v.op.value} writes no Q, so a Q layout does not apply"
        if v.cache_format not in INTERLEAVED_FORMATS or v.io_dtype is not IoDtype.BF16:
            return (
                f"the interleaved Q layout is FlashMLA's SM100 input: generated for "
                f"{', '.join(INTERLEAVED_FORMATS)} with bf16 I/O, not {v.cache_format} / {v.io_dtype.value}"
            )
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


# the indexer's Q: (D, R) of its rows (8 lanes a row: templates/index_q.py.jinja), the indexer keys' formats
INDEX_Q_HEAD_DIMS, INDEX_Q_FORMATS = ((128, 64),), ("fp8_token", "mxfp4")


def _index_q_unsupported(v: Variant) -> str | None:
    if (v.head_dim, v.rope_dim) not in INDEX_Q_HEAD_DIMS or v.cache_format not in INDEX_Q_FORMATS:
        return f"index_q is generated for (D, R) in {INDEX_Q_HEAD_DIMS} and {' or '.join(INDEX_Q_FORMATS)}"
    if v.q_out is not QOut.IO or v.q_layout is not QLayout.HEAD_MAJOR:
        return "index_q has its own outputs: no q_out dtype or Q layout axis applies"
    return None


def all_combinations() -> Iterator[Variant]:
    """Every point of the axes' product, supported or not."""
    for op, q_out, (d, r), fmt, dt, arch, cv, layout in itertools.product(
        OPS, Q_OUTS, HEAD_DIMS, sorted(FORMATS), IO_DTYPES, ARCH_FAMILIES, CONVERSIONS, tuple(QLayout)
    ):
        yield Variant(op, q_out, d, r, fmt, dt, arch, cv, layout)


def _alternatives(values) -> str:
    return "|".join(sorted((re.escape(str(v)) for v in values), key=len, reverse=True))


NAME = re.compile(  # the grammar of Variant.name
    rf"(?P<op>{_alternatives(o.value for o in Op)})(?P<q8>_q8)?(?P<qi>_qi)?_d(?P<d>\d+)r(?P<r>\d+)"
    rf"_(?P<fmt>{_alternatives(FORMATS)})_(?P<io>{_alternatives(i.value for i in IoDtype)})"
    rf"_(?P<arch>{_alternatives(a.value for a in ArchFamily)})(?P<portable>_portable)?"
)


def parse_name(name: str) -> Variant:
    """The inverse of Variant.name, for any combination (supported or not)."""
    m = NAME.fullmatch(name)
    if m is None:
        raise UnsupportedError(f"{name!r} is not a variant name (e.g. qkv_d512r64_fp8_ds_mla_bf16_sm90)")
    arch = ArchFamily(m["arch"])
    v = Variant(
        Op(m["op"]),
        QOut.FP8 if m["q8"] else QOut.IO,
        int(m["d"]),
        int(m["r"]),
        m["fmt"],
        IoDtype(m["io"]),
        arch,
        Conversions.PORTABLE if m["portable"] else arch.default_conversions,
        QLayout.INTERLEAVED if m["qi"] else QLayout.HEAD_MAJOR,
    )
    if v.name != name:
        raise UnsupportedError(f"{name!r} is not a variant name (did you mean {v.name!r}?)")
    return v


@dataclass(frozen=True)
class Request:
    """What a caller asks for; `find` turns it into the generated variant for an arch family."""

    op: Op
    head_dim: int
    rope_dim: int
    cache_format: str
    io_dtype: IoDtype
    q_out: QOut = QOut.IO
    conversions: Conversions | None = None  # None: the arch's default
    q_layout: QLayout = QLayout.HEAD_MAJOR

    def variant(self, arch: ArchFamily) -> Variant:
        cv = self.conversions or arch.default_conversions
        v = Variant(
            self.op, self.q_out, self.head_dim, self.rope_dim, self.cache_format, self.io_dtype, arch, cv,
            self.q_layout,
        )  # fmt: skip
        if cv is Conversions.PORTABLE and unsupported_reason(v) and arch.has_native_block_conversions:
            v = _replace(
                v, conversions=Conversions.NATIVE
            )  # formats without arch conversions have one module
        return v


@functools.cache
def generated() -> frozenset[str]:
    """Names of the generated modules (the registry). Read on first use: codegen, which writes the
    registry, imports this module before the registry exists."""
    from .generated import registry

    return frozenset(registry.VARIANTS)


def find(request: Request, arch: ArchFamily | None) -> Variant:
    """The generated variant for a request, or an UnsupportedError whose message is the reason
    `list --why` prints for that combination plus the nearest generated variants. With no arch,
    SM90's answers for all (every family has the same set) and the message names no arch."""
    get_format(request.cache_format)  # an unknown name: UnknownFormatError listing the known ones
    v = request.variant(arch or ArchFamily.SM90)
    if unsupported_reason(v) is None and v.name in generated():
        return v
    raise UnsupportedError(not_generated(v, with_arch=arch is not None))


def not_generated(v: Variant, with_arch: bool = True) -> str:
    """Why v has no generated module, and the nearest that exist (`find`'s and the CLI's message);
    without the arch, names are stems (a caller that asked for no arch is not told of one)."""
    why = (
        unsupported_reason(v)
        or "it is supported but was not generated (run `python -m attn_prologue generate`)"
    )
    near = nearest(v) if with_arch else list(dict.fromkeys(parse_name(n).stem for n in nearest(v, None)))[:3]
    return f"no kernel variant {v.name if with_arch else v.stem}: {why}; nearest generated: {', '.join(near)}"


def nearest(v: Variant, count: int | None = 3) -> list[str]:
    """The generated variants that differ from v on the fewest axes (ties by name)."""
    mine = {f: getattr(v, f) for f in Variant.__dataclass_fields__}

    def distance(name: str) -> int:
        other = parse_name(name)
        return sum(getattr(other, f) != value for f, value in mine.items())

    return sorted(generated(), key=lambda n: (distance(n), n))[:count]
