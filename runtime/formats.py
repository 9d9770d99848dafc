"""Paged KV-cache formats: the one place a byte layout is defined.

Every format keeps the per-token data records first in a block and the per-token scale records
after all of them (a footer), so data records stay 16-byte aligned (docs/formats.md). The codecs,
the PyTorch reference, the generator and the runtime validation all read these tables.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import UnsupportedError


class ElementCode(enum.Enum):
    """How one value is stored in a data record."""

    E4M3 = "e4m3"  # float8_e4m3fn, one byte
    E2M1 = "e2m1"  # fp4, two per byte (element 2j in the low nibble)
    BF16 = "bf16"  # bfloat16, little-endian


class ScaleCode(enum.Enum):
    """How a quantization block's scale is stored."""

    NONE = "none"  # unquantized
    UE8M0 = "ue8m0"  # one byte per block, value 2^(byte - 127)
    E4M3 = "e4m3"  # one float8_e4m3fn byte per group, value float(e4m3) (NVFP4; no global scale)
    F32_POW2 = "f32_pow2"  # one float32 per block holding 2^e
    TENSOR_F32 = "tensor_f32"  # no per-token scale: one float32 scale tensor argument


# ---- numerics: each ecosystem's rounding conventions as named choices ---------------------------
class ScaleFloor(enum.Enum):
    """Where the 1e-4 floor of a UE8M0 exponent applies. The two agree when amax >= 448e-4."""

    AMAX = "amax"  # e = ceil(log2(max(amax, 1e-4) / 448)): vLLM's writers; a zero block gets byte 105
    SCALE = "scale"  # e = ceil(log2(max(amax / 448, 1e-4))): FlashMLA tests/quant.py, SGLang; byte >= 114


class Fp4Zero(enum.Enum):
    """The sign of an E2M1 code whose value rounds to zero."""

    POSITIVE = "positive"  # always code 0x0 (SGLang's V4.1 writer as the spec describes it)
    SIGNED = (
        "signed"  # the sign of the input: 0x8 for a negative value (FlashMLA's reference, the hardware cvt)
    )


class RotatedRow(enum.Enum):
    """Which values of the RoPE'd KV row the cache quantizes."""

    IO_ROUNDED = "io_rounded"  # the row rounded to the I/O dtype first (the CUDA writers)
    FP32 = "fp32"  # the float32 row as RoPE left it (vLLM's Triton compressed writer)


@dataclass(frozen=True)
class Numerics:
    """Parity choices of the KV path. A field left None means "the format's default"; a format whose
    default for a field is None has no such choice (see `CacheFormat.resolve_numerics`)."""

    scale_floor: ScaleFloor | None = None
    fp4_zero: Fp4Zero | None = None
    rotated_row: RotatedRow | None = None

    def text(self) -> str:
        """The spelling `parse` reads ("" when every field is left to the format)."""
        return ", ".join(
            f"{k}={getattr(self, k).value}" for k in self.__dataclass_fields__ if getattr(self, k)
        )

    def __str__(self) -> str:
        return self.text() or "format defaults"

    @classmethod
    def parse(cls, text: str) -> Numerics:
        """The inverse of str(): "scale_floor=scale, fp4_zero=signed" (empty: the format defaults).
        The torch ops take the choices in this spelling (a schema has no dataclass type)."""
        fields = {field: type(value) for field, (value, _) in NUMERICS_FLAGS.items()}  # field -> its enum
        out = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            kind = fields.get(key.strip())
            values = [v.value for v in kind] if kind else []
            if kind is None or value.strip() not in values:
                choices = "; ".join(f"{k}={'|'.join(v.value for v in e)}" for k, e in fields.items())
                raise NumericsError(f"numerics {part!r} is not a parity choice; choices: {choices}")
            out[key.strip()] = kind(value.strip())
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


class NumericsFlag(enum.IntFlag):
    """The parity choices as the kernels read them: one run-time int32 argument, `numerics`. A set
    bit selects the non-vLLM rule; which bits a format honours follows from its `Numerics` fields.
    Run-time, not a variant axis: each costs a few instructions on data already in registers, while
    a compile-time axis would multiply the modules (and the build) by up to 8."""

    SCALE_FLOOR = 1  # ScaleFloor.SCALE
    FP4_POSITIVE_ZERO = 2  # Fp4Zero.POSITIVE
    FP32_ROTATED_ROW = 4  # RotatedRow.FP32


# the bit of each Numerics field, set when the field holds this value
NUMERICS_FLAGS = {
    "scale_floor": (ScaleFloor.SCALE, NumericsFlag.SCALE_FLOOR),
    "fp4_zero": (Fp4Zero.POSITIVE, NumericsFlag.FP4_POSITIVE_ZERO),
    "rotated_row": (RotatedRow.FP32, NumericsFlag.FP32_ROTATED_ROW),
}


class NumericsError(UnsupportedError, ValueError):
    """A parity choice that is not spelled right or that the cache format does not have."""


NUMERICS_HELP = {
    ScaleFloor.AMAX: "floor amax at 1e-4, then e = ceil(log2(amax / 448)) (vLLM)",
    ScaleFloor.SCALE: "e = ceil(log2(max(amax / 448, 1e-4))) (FlashMLA tests/quant.py, SGLang, FlashInfer)",
    Fp4Zero.POSITIVE: "a value that rounds to zero is stored as +0 (code 0x0)",
    Fp4Zero.SIGNED: "a negative value that rounds to zero keeps its sign (code 0x8)",
    RotatedRow.IO_ROUNDED: "quantize the RoPE'd row after rounding it to the I/O dtype",
    RotatedRow.FP32: "quantize the float32 RoPE'd row (vLLM's Triton compressed writer)",
}


@dataclass(frozen=True)
class CacheFormat:
    """A cache format as data. `head_dim`/`rope_dim` of None means "any D" (full-cache rows)."""

    name: str
    head_dim: int | None
    rope_dim: int | None
    element: ElementCode
    scale: ScaleCode
    quant_block: int  # elements per scale (0: no per-block scale)
    rope_tail_bf16: bool  # True: the rotated dims [D-R, D) are stored unquantized as bf16
    amax_floor: float  # lower bound of a block's amax before the exponent is taken
    fp_max: float  # largest finite magnitude of the element code (448 for e4m3, 6 for e2m1)
    scale_pad_bytes: int  # trailing pad bytes of a scale record, written as 0
    exponent_clamp: tuple[int, int] | None  # clamp of e itself (mxfp4) before the byte is made
    divide_by_fp_max: bool  # True: the scale quotient is amax / fp_max; False: amax * fl(1 / fp_max)
    summary: str
    nan_policy: str  # what a NaN or Inf input becomes (stated, and pinned by golden vectors)
    numerics: Numerics  # the default parity choices; None fields are choices the format does not have
    # E4M3-scaled (NVFP4) groups only: the clamp of the scale quotient before its e4m3 rounding (None:
    # none, the conversion's saturation only) and whether codes are x / s (IEEE division) or x * fl(1/s).
    scale_clamp: tuple[float, float] | None = None
    divide_by_scale: bool = True
    # compress_ratio r of the KV-only writers: row t is inserted only when (positions[t] + 1) % r == 0,
    # its RoPE at positions[t] // r * r. The ratios engines use (V4.1: 1, 2; V4: 4, 128).
    compress_ratios: tuple[int, ...] = (1, 2, 4, 128)

    # ---- per-token byte layout ------------------------------------------------------------
    def dims(self, head_dim: int) -> tuple[int, int]:
        """(quantized dims, bf16 tail dims) of one token."""
        if self.rope_tail_bf16:
            r = self.rope_dim
            return head_dim - r, r
        return head_dim, 0

    def data_bytes(self, head_dim: int) -> int:
        """Bytes of one token's data record."""
        q, tail = self.dims(head_dim)
        if self.element is ElementCode.E4M3:
            return q + 2 * tail
        if self.element is ElementCode.E2M1:
            return q // 2 + 2 * tail
        return 2 * q + 2 * tail

    def resolve_numerics(self, numerics: Numerics | None) -> Numerics:
        """The choices in effect: the format's default for every field left None. A ValueError for a
        choice the format does not have (e.g. a UE8M0 floor on an NVFP4 format) is a NumericsError
        naming the choices it has."""
        numerics = Numerics.of(numerics)
        if numerics is None:
            return self.numerics
        out = {}
        for field in Numerics.__dataclass_fields__:
            want, default = getattr(numerics, field), getattr(self.numerics, field)
            if want is not None and default is None:
                has = "; ".join(
                    f"{k}={'|'.join(v.value for v in vs)}" for k, vs in self.numerics_choices().items()
                )
                raise NumericsError(
                    f"cache format {self.name} has no {field} choice (asked for {want.value}); it has: {has}"
                )
            out[field] = default if want is None else want
        return Numerics(**out)

    def numerics_flags(self, numerics: Numerics | str | None = None) -> int:
        """The kernels' `numerics` argument for these choices (NumericsFlag bits)."""
        n = self.resolve_numerics(numerics)
        return sum(int(flag) for field, (value, flag) in NUMERICS_FLAGS.items() if getattr(n, field) is value)

    def numerics_choices(self) -> dict[str, list[enum.Enum]]:
        """Per field the format has, its values, default first."""
        out = {}
        for field in Numerics.__dataclass_fields__:
            default = getattr(self.numerics, field)
            if default is not None:
                out[field] = [default] + [v for v in type(default) if v is not default]
        return out

    def num_scales(self, head_dim: int) -> int:
        if self.scale in (ScaleCode.NONE, ScaleCode.TENSOR_F32):
            return 0
        return self.dims(head_dim)[0] // self.quant_block

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of one token's scale record in the footer (pad included)."""
        if self.scale in (ScaleCode.UE8M0, ScaleCode.E4M3):
            return self.num_scales(head_dim) + self.scale_pad_bytes
        if self.scale is ScaleCode.F32_POW2:
            return 4 * self.num_scales(head_dim)
        return 0

    def bytes_per_token(self, head_dim: int) -> int:
        return self.data_bytes(head_dim) + self.scale_bytes(head_dim)

    def block_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes of one block's records (the page may be larger: trailing padding)."""
        return block_size * self.bytes_per_token(head_dim)

    def data_offset(self, head_dim: int, block_size: int, o):
        """Byte offset in its page of token o's data record (o: an int or an int64 tensor)."""
        return o * self.data_bytes(head_dim)

    def scale_offset(self, head_dim: int, block_size: int, o):
        """Byte offset in its page of token o's scale record: after all block_size data records."""
        return block_size * self.data_bytes(head_dim) + o * self.scale_bytes(head_dim)

    def supports_head_dim(self, head_dim: int, rope_dim: int) -> bool:
        if self.head_dim is not None:
            return head_dim == self.head_dim and rope_dim == self.rope_dim
        return True

    @property
    def needs_tensor_scale(self) -> bool:
        return self.scale is ScaleCode.TENSOR_F32


E4_BLOCK_NAN = "amax ignores NaN; NaN -> 0x7F; a block holding +-Inf gets byte 254, stores Inf as +-448 and its finite values as +-0"

FORMATS: dict[str, CacheFormat] = {
    f.name: f
    for f in (
        CacheFormat(
            name="fp8_ds_mla",
            head_dim=512,
            rope_dim=64,
            element=ElementCode.E4M3,
            scale=ScaleCode.UE8M0,
            quant_block=64,
            rope_tail_bf16=True,
            amax_floor=1e-4,
            fp_max=448.0,
            scale_pad_bytes=1,
            exponent_clamp=None,
            divide_by_fp_max=True,
            summary="DeepSeek-V4 sliding-window/compressed cache: 448 e4m3 NoPE + 64 bf16 rope, 7 UE8M0 + 1 pad",
            nan_policy=E4_BLOCK_NAN + "; the bf16 tail keeps NaN and Inf (NaN payload not pinned)",
            numerics=Numerics(ScaleFloor.AMAX, None, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            name="mxfp8",
            head_dim=512,
            rope_dim=64,
            element=ElementCode.E4M3,
            scale=ScaleCode.UE8M0,
            quant_block=32,
            rope_tail_bf16=False,
            amax_floor=1e-4,
            fp_max=448.0,
            scale_pad_bytes=0,
            exponent_clamp=None,
            divide_by_fp_max=True,
            summary="DeepSeek-V4.1 sliding-window cache: 512 e4m3 (rope quantized too), 16 UE8M0",
            nan_policy=E4_BLOCK_NAN,
            numerics=Numerics(ScaleFloor.AMAX, None, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            name="fp8_token",
            head_dim=128,
            rope_dim=64,
            element=ElementCode.E4M3,
            scale=ScaleCode.F32_POW2,
            quant_block=128,
            rope_tail_bf16=False,
            amax_floor=1e-4,
            fp_max=448.0,
            scale_pad_bytes=0,
            exponent_clamp=None,
            divide_by_fp_max=False,
            summary="DeepSeek-V4 indexer keys: 128 e4m3, one float32 scale 2^e per token",
            nan_policy="amax ignores NaN; NaN -> 0x7F; a token holding +-Inf gets scale 2^127 and stores Inf as +-448",
            numerics=Numerics(None, None, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            name="mxfp4",
            head_dim=128,
            rope_dim=64,
            element=ElementCode.E2M1,
            scale=ScaleCode.UE8M0,
            quant_block=32,
            rope_tail_bf16=False,
            amax_floor=6.0 * 2.0**-126,
            fp_max=6.0,
            scale_pad_bytes=0,
            exponent_clamp=(-127, 127),
            divide_by_fp_max=True,
            summary="DeepSeek-V4 indexer keys, FP4: 64 bytes packed e2m1, 4 UE8M0",
            nan_policy="amax ignores NaN; NaN (either sign) -> code 0x7 (+6); a block holding +-Inf gets byte 254 and stores Inf as +-6",
            numerics=Numerics(None, Fp4Zero.SIGNED, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            name="bf16",
            head_dim=None,
            rope_dim=None,
            element=ElementCode.BF16,
            scale=ScaleCode.NONE,
            quant_block=0,
            rope_tail_bf16=False,
            amax_floor=0.0,
            fp_max=0.0,
            scale_pad_bytes=0,
            exponent_clamp=None,
            divide_by_fp_max=True,
            summary="unquantized full cache: D bf16 per token",
            nan_policy="NaN and Inf are stored as bf16 NaN and Inf (NaN payload not pinned)",
            numerics=Numerics(None, None, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            name="fp8_tensor",
            head_dim=None,
            rope_dim=None,
            element=ElementCode.E4M3,
            scale=ScaleCode.TENSOR_F32,
            quant_block=0,
            rope_tail_bf16=False,
            amax_floor=0.0,
            fp_max=448.0,
            scale_pad_bytes=0,
            exponent_clamp=None,
            divide_by_fp_max=True,
            summary="per-tensor-scale FP8 full cache: e4m3(clamp(x / scale)) per value",
            nan_policy="NaN -> 0x7F; +-Inf saturates to +-448",
            numerics=Numerics(None, None, RotatedRow.IO_ROUNDED),
        ),
        CacheFormat(
            # DeepSeek-V4.1 compressed cache (vLLM's `nvfp4_ds_mla`). Per 16-wide group of the whole
            # row (rope dims included): s = e4m3(clamp(amax * fl(1/6), 2^-9, 448)), codes
            # e2m1(x / s) with an IEEE division; a zero group gets scale 0x01 (2^-9) from the clamp.
            name="nvfp4_v41",
            head_dim=512,
            rope_dim=64,
            element=ElementCode.E2M1,
            scale=ScaleCode.E4M3,
            quant_block=16,
            rope_tail_bf16=False,
            amax_floor=0.0,
            fp_max=6.0,
            scale_pad_bytes=0,
            exponent_clamp=None,
            divide_by_fp_max=False,
            summary="DeepSeek-V4.1 compressed cache: 512 e2m1 (rope quantized too), 32 E4M3 group scales",
            nan_policy="amax ignores NaN; NaN -> code 0x7 (+6); a group holding +-Inf gets scale 448 (0x7E) and stores Inf as +-6",
            numerics=Numerics(None, Fp4Zero.POSITIVE, RotatedRow.IO_ROUNDED),
            scale_clamp=(2.0**-9, 448.0),
            divide_by_scale=True,
        ),
        CacheFormat(
            # DeepSeek-V4 NVFP4 record of FlashInfer's SM120 sparse MLA. Its writer
            # (quantize_fp32_group16_to_nvfp4_regs in flashinfer-ai/flashinfer
            # include/flashinfer/attention/sparse_mla_sm120/common/nvfp4_quantization.cuh, commit
            # 3fe65b06) takes s = e4m3_satfinite(amax / 6) with no lower clamp, codes
            # e2m1(x * fl(1/s)) and 0 for every code when s rounds to 0 (scale byte 0x00).
            name="nvfp4_dsv4",
            head_dim=512,
            rope_dim=64,
            element=ElementCode.E2M1,
            scale=ScaleCode.E4M3,
            quant_block=16,
            rope_tail_bf16=True,
            amax_floor=0.0,
            fp_max=6.0,
            scale_pad_bytes=4,
            exponent_clamp=None,
            divide_by_fp_max=True,
            summary="DeepSeek-V4 NVFP4 (FlashInfer SM120): 448 e2m1 NoPE + 64 bf16 rope, 28 E4M3 scales + 4 zero",
            nan_policy="amax ignores NaN; NaN -> code 0x7 (+6); a group holding +-Inf gets scale 448 (0x7E) and stores Inf as +-6; the bf16 tail keeps NaN and Inf",
            # SIGNED: the hardware cvt.rn.satfinite.e2m1x2.f32 that FlashInfer's writer uses keeps the sign
            numerics=Numerics(None, Fp4Zero.SIGNED, RotatedRow.IO_ROUNDED),
            scale_clamp=None,
            divide_by_scale=False,
            compress_ratios=(1, 2),  # what FlashInfer's SM120 writer takes for this record
        ),
    )
}


class UnknownFormatError(UnsupportedError, KeyError):
    """A cache format name that is not defined here (the message lists the defined ones)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def get_format(name: str) -> CacheFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(
            f"unknown cache format {name!r}; known formats: {', '.join(sorted(FORMATS))}"
        ) from None


def layout_rows(head_dim_for_any: int = 512) -> list[dict]:
    """The byte layouts as table rows (used by `list`). Formats for any D are shown at that D."""
    rows = []
    for f in FORMATS.values():
        d = f.head_dim or head_dim_for_any
        q, tail = f.dims(d)
        if f.element is ElementCode.E2M1:
            data = f"+0..+{q // 2 - 1}: {q} x e2m1 packed (elem 2j low nibble)"
        else:
            data = f"+0..+{f.dims(d)[0] * (1 if f.element is ElementCode.E4M3 else 2) - 1}: {q} x {f.element.value}"
        if tail:
            start = f.data_bytes(d) - 2 * tail  # the tail follows the quantized bytes
            data += f"; +{start}..+{start + 2 * tail - 1}: {tail} x bf16 rope"
        if f.scale in (ScaleCode.UE8M0, ScaleCode.E4M3):
            scale = f"{f.num_scales(d)} x {f.scale.value} (1 per {f.quant_block})" + (
                f" + {f.scale_pad_bytes} pad" if f.scale_pad_bytes else ""
            )
        elif f.scale is ScaleCode.F32_POW2:
            scale = f"{f.num_scales(d)} x f32 2^e (1 per {f.quant_block})"
        elif f.scale is ScaleCode.TENSOR_F32:
            scale = "none (f32 scale tensor argument)"
        else:
            scale = "none"
        rows.append(
            {
                "format": f.name,
                "D/R": f"{f.head_dim}/{f.rope_dim}" if f.head_dim else f"any (shown D={d})",
                "bytes/token": f"{f.bytes_per_token(d)} = {f.data_bytes(d)} + {f.scale_bytes(d)}",
                "data record": data,
                "scale record (footer)": scale,
            }
        )
    return rows


def numerics_rows() -> list[dict]:
    """Each format's parity choices (default first) and NaN policy as table rows (used by `list --why`)."""
    rows = []
    for f in FORMATS.values():
        choices = f.numerics_choices()
        rows.append(
            {
                "format": f.name,
                'parity choices (default first; e.g. numerics="scale_floor=scale")': "; ".join(
                    f"{field}: {' | '.join(v.value for v in values)}" for field, values in choices.items()
                ),
                "NaN / Inf": f.nan_policy,
            }
        )
    return rows
