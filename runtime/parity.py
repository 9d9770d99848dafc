"""Parity choices: the rounding details on which engines' cache writers disagree, as named fields.

A `Numerics` names some fields (or an engine preset, `presets.py`); every field left None takes the
cache format's default (`CacheFormat.resolve_numerics`). The kernels read the choices from one
run-time int32 argument, `numerics` (`NumericsFlag` bits): a choice is a uniform branch on values
already in registers, where a compile-time axis would multiply the modules. docs/formats.md
("Parity choices", "Matching an engine byte for byte") says which engine each value matches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import UnsupportedError, did_you_mean


class NumericsError(UnsupportedError, ValueError):
    """A parity choice or preset that is not spelled right or that the cache format does not have."""


class ScaleFloor(enum.Enum):
    """Where the floor of a UE8M0 exponent applies. The two agree when amax >= 448 * floor."""

    AMAX = "amax"  # e = ceil(log2(max(amax, floor) / 448)): vLLM's writers; a zero block gets byte 105
    SCALE = "scale"  # e = ceil(log2(max(amax / 448, floor))): FlashMLA tests/quant.py, SGLang; byte >= 114


class AmaxFloor(enum.Enum):
    """The floor's value for the E4M3 block formats (where it applies: ScaleFloor)."""

    E4 = "1e-4"  # vLLM, SGLang, FlashMLA, DeepSeek's act_quant
    E8 = "1e-8"  # TensorRT-LLM's 584 B writer


class Fp4Zero(enum.Enum):
    """The sign of an E2M1 code whose value rounds to zero."""

    SIGNED = "signed"  # the sign of the value: 0x8 for a negative one, -0.0 included (the hardware cvt)
    POSITIVE = "positive"  # always code 0x0
    EXACT = "exact"  # 0x0 for an exact -0.0, 0x8 for a negative value that rounds to zero


class RotatedRow(enum.Enum):
    """Which values of the RoPE'd KV row the cache quantizes."""

    IO_ROUNDED = "io_rounded"  # the row rounded to the I/O dtype first (the CUDA writers)
    FP32 = "fp32"  # the float32 row as RoPE left it (vLLM's Triton compressed writers)


class NopeRotation(enum.Enum):
    """What RoPE does to the non-rotated dims [0, D - R)."""

    NONE = "none"  # nothing: they are stored as loaded
    IDENTITY = "identity"  # rotated with cos = 1, sin = 0 (vLLM's V4.1 Triton writers): even - odd * 0,
    # odd + even * 0, so a -0.0 becomes +0.0 by its pair's sign and a NaN or Inf makes its pair NaN


class RopeOrder(enum.Enum):
    """The fused multiply-add the odd term of a rotated pair uses (the even one is always
    fma(even, c, -(odd * s)))."""

    EVEN_SIN = "even_sin"  # odd' = fma(even, s, odd * c): vLLM's CUDA op, this project
    ODD_COS = "odd_cos"  # odd' = fma(odd, c, even * s): vLLM's Triton writers, TensorRT-LLM


class E4m3Nan(enum.Enum):
    """The byte a NaN E4M3 element is stored as."""

    NAN = "0x7f"  # the canonical NaN of cvt.rn.satfinite.e4m3x2.f32
    POS_MAX = "0x7e"  # +448: Triton's clamp (min.xorsign.abs) of a NaN, which the multiply made positive
    NEG_MAX = "0xfe"  # -448: CUDA's fminf(fmaxf(x, -448), 448), whose fmaxf returns -448 for a NaN


class InfScale(enum.Enum):
    """The scale of a block holding +-Inf (UE8M0 byte, or fp8_token's float32 2^e)."""

    SATURATE = "254"  # e saturates at 127; elements x * 2^-126: Inf -> +-448, the rest (nearly) 0
    OVERFLOW = (
        "255"  # e = 128 (float32 +Inf for fp8_token); elements x * 2^-128 = x * 0: Inf -> NaN, rest +-0
    )
    WRAPPED = (
        "126"  # as 255, but the byte is 126: +Inf exponent to int32 (INT_MAX) + 127, wrapped (TensorRT-LLM)
    )


class ScalePad(enum.Enum):
    """The pad bytes at the end of a scale record."""

    ZERO = "zero"  # written as 0
    SKIP = "skip"  # never written (TensorRT-LLM's 584 B writer)


@dataclass(frozen=True)
class Numerics:
    """Parity choices of the KV path. `preset` names an engine (presets.PRESETS) whose fields apply
    first; a field given here overrides it; a field left None takes the format's default. A field
    may be given as its enum or its value string ("scale"); anything else is a NumericsError."""

    preset: str | None = None
    scale_floor: ScaleFloor | None = None
    amax_floor: AmaxFloor | None = None
    fp4_zero: Fp4Zero | None = None
    rotated_row: RotatedRow | None = None
    nope_rotation: NopeRotation | None = None
    rope_order: RopeOrder | None = None
    e4m3_nan: E4m3Nan | None = None
    inf_scale: InfScale | None = None
    scale_pad: ScalePad | None = None

    def __post_init__(self):
        if self.preset is not None and not isinstance(self.preset, str):
            raise NumericsError(f"numerics preset must be a str, got {type(self.preset).__name__}")
        if self.preset is not None:
            object.__setattr__(self, "preset", self.preset.strip().lower())  # "vLLM" is "vllm"
        for name, kind in CHOICE_TYPES.items():
            value = getattr(self, name)
            if value is None or isinstance(value, kind):
                continue
            spellings = {v.value: v for v in kind}
            if not isinstance(value, str) or value.strip().lower() not in spellings:
                hint = did_you_mean(value.strip().lower(), spellings) if isinstance(value, str) else ""
                raise NumericsError(
                    f"numerics {name}={value!r} is not a parity choice{hint}; choices: {choices_text()}"
                )
            object.__setattr__(self, name, spellings[value.strip().lower()])  # the string spelling

    def given(self) -> dict[str, enum.Enum]:
        """The fields set here (preset excluded)."""
        return {k: getattr(self, k) for k in CHOICE_TYPES if getattr(self, k) is not None}

    def text(self) -> str:
        """The spelling `parse` reads ("" when nothing is set)."""
        parts = [f"preset={self.preset}"] if self.preset else []
        return ", ".join(parts + [f"{k}={v.value}" for k, v in self.given().items()])

    def __str__(self) -> str:
        return self.text() or "format defaults"

    @classmethod
    def parse(cls, text: str) -> Numerics:
        """The inverse of text(): "preset=vllm-triton, fp4_zero=positive" (empty: the format defaults).
        The torch ops take the choices in this spelling (a schema has no dataclass type). A field
        named twice is an error, not "the last one wins"."""
        out: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = (s.strip() for s in part.partition("="))
            key = key.lower()
            if not eq or (key != "preset" and key not in CHOICE_TYPES):
                hint = did_you_mean(key, ["preset", *CHOICE_TYPES]) if eq else ""
                raise NumericsError(
                    f"numerics {part!r} is not a parity choice{hint}; choices: {choices_text()}"
                )
            if key in out:
                raise NumericsError(f"numerics {text!r} sets {key} twice")
            out[key] = value
        return cls(**out)

    @classmethod
    def of(cls, value: Numerics | str | None) -> Numerics | None:
        """A Numerics, its string spelling, or None (the format defaults)."""
        if value is None or isinstance(value, Numerics):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        raise NumericsError(
            f"numerics must be a formats.Numerics, its string form or None, got {type(value).__name__}"
        )


# field -> its enum (every field of Numerics but `preset`, in order)
CHOICE_TYPES: dict[str, type[enum.Enum]] = {
    "scale_floor": ScaleFloor,
    "amax_floor": AmaxFloor,
    "fp4_zero": Fp4Zero,
    "rotated_row": RotatedRow,
    "nope_rotation": NopeRotation,
    "rope_order": RopeOrder,
    "e4m3_nan": E4m3Nan,
    "inf_scale": InfScale,
    "scale_pad": ScalePad,
}


def choices_text() -> str:
    """Every field and its values, as the errors list them."""
    return (
        "; ".join(f"{k}={'|'.join(v.value for v in e)}" for k, e in CHOICE_TYPES.items()) + "; preset=<name>"
    )


class NumericsFlag(enum.IntFlag):
    """The parity choices as the kernels read them: one run-time int32 argument, `numerics`. The first
    value of each field has no bit; every other value has one (which bits a format can set follows
    from its choices). Run-time, not a variant axis: each costs a few instructions on data already in
    registers, while a compile-time axis would multiply the modules (and the build)."""

    SCALE_FLOOR = 1  # ScaleFloor.SCALE
    FP4_POSITIVE_ZERO = 2  # Fp4Zero.POSITIVE
    FP32_ROTATED_ROW = 4  # RotatedRow.FP32
    NOPE_ROTATION = 8  # NopeRotation.IDENTITY
    ROPE_ODD_COS = 16  # RopeOrder.ODD_COS
    E4M3_NAN_POS_MAX = 32  # E4m3Nan.POS_MAX
    E4M3_NAN_NEG_MAX = 64  # E4m3Nan.NEG_MAX
    INF_SCALE_OVERFLOW = 128  # InfScale.OVERFLOW
    INF_SCALE_WRAPPED = 256  # InfScale.WRAPPED
    AMAX_FLOOR_1E8 = 512  # AmaxFloor.E8
    SCALE_PAD_SKIP = 1024  # ScalePad.SKIP
    FP4_EXACT_ZERO = 2048  # Fp4Zero.EXACT


# field -> {value: its bit}; a value not listed (each field's first) sets none
NUMERICS_FLAGS: dict[str, dict[enum.Enum, NumericsFlag]] = {
    "scale_floor": {ScaleFloor.SCALE: NumericsFlag.SCALE_FLOOR},
    "amax_floor": {AmaxFloor.E8: NumericsFlag.AMAX_FLOOR_1E8},
    "fp4_zero": {
        Fp4Zero.POSITIVE: NumericsFlag.FP4_POSITIVE_ZERO,
        Fp4Zero.EXACT: NumericsFlag.FP4_EXACT_ZERO,
    },
    "rotated_row": {RotatedRow.FP32: NumericsFlag.FP32_ROTATED_ROW},
    "nope_rotation": {NopeRotation.IDENTITY: NumericsFlag.NOPE_ROTATION},
    "rope_order": {RopeOrder.ODD_COS: NumericsFlag.ROPE_ODD_COS},
    "e4m3_nan": {
        E4m3Nan.POS_MAX: NumericsFlag.E4M3_NAN_POS_MAX,
        E4m3Nan.NEG_MAX: NumericsFlag.E4M3_NAN_NEG_MAX,
    },
    "inf_scale": {
        InfScale.OVERFLOW: NumericsFlag.INF_SCALE_OVERFLOW,
        InfScale.WRAPPED: NumericsFlag.INF_SCALE_WRAPPED,
    },
    "scale_pad": {ScalePad.SKIP: NumericsFlag.SCALE_PAD_SKIP},
}

NUMERICS_HELP = {
    ScaleFloor.AMAX: "floor amax, then e = ceil(log2(amax / 448))",
    ScaleFloor.SCALE: "e = ceil(log2(max(amax / 448, floor)))",
    AmaxFloor.E4: "the floor is 1e-4",
    AmaxFloor.E8: "the floor is 1e-8",
    Fp4Zero.SIGNED: "a negative value that rounds to zero keeps its sign (code 0x8), -0.0 too",
    Fp4Zero.POSITIVE: "a value that rounds to zero is stored as +0 (code 0x0)",
    Fp4Zero.EXACT: "+0 for an exact -0.0; other negatives that round to zero keep the sign",
    RotatedRow.IO_ROUNDED: "quantize the RoPE'd row after rounding it to the I/O dtype",
    RotatedRow.FP32: "quantize the float32 RoPE'd row",
    NopeRotation.NONE: "the non-rotated dims are stored as loaded",
    NopeRotation.IDENTITY: "the non-rotated dims go through the rotation with cos = 1, sin = 0",
    RopeOrder.EVEN_SIN: "odd' = fma(even, sin, odd * cos)",
    RopeOrder.ODD_COS: "odd' = fma(odd, cos, even * sin)",
    E4m3Nan.NAN: "a NaN element is byte 0x7F",
    E4m3Nan.POS_MAX: "a NaN element is byte 0x7E (+448)",
    E4m3Nan.NEG_MAX: "a NaN element is byte 0xFE (-448)",
    InfScale.SATURATE: "a block holding Inf: scale byte 254 (2^127), Inf -> +-448",
    InfScale.OVERFLOW: "a block holding Inf: scale byte 255 (f32 +Inf), every element * 0 (Inf -> NaN)",
    InfScale.WRAPPED: "a block holding Inf: scale byte 126, every element * 0 (Inf -> NaN)",
    ScalePad.ZERO: "scale pad bytes are written as 0",
    ScalePad.SKIP: "scale pad bytes are not written",
}
