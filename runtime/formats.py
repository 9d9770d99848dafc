"""Paged KV-cache formats: the one place a byte layout is defined.

Every format keeps the per-token data records first in a block and the per-token scale records
after all of them (a footer), so data records stay 16-byte aligned (docs/formats.md). The codecs,
the PyTorch reference, the generator and the runtime validation all read these tables.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import UnsupportedError
from .parity import (  # noqa: F401  (the parity choices are part of this module's API)
    CHOICE_TYPES,
    NUMERICS_FLAGS,
    NUMERICS_HELP,
    AmaxFloor,
    E4m3Nan,
    Fp4Zero,
    InfScale,
    NopeRotation,
    Numerics,
    NumericsError,
    NumericsFlag,
    RopeOrder,
    RotatedRow,
    ScaleFloor,
    ScalePad,
)
from .presets import PRESETS, preset_entry


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
    # values of the format's parity choices that it does not have (e.g. fp8_token's float32 scale has
    # no wrapped UE8M0 byte)
    numerics_excluded: tuple[enum.Enum, ...] = ()

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

    def resolve_numerics(self, numerics: Numerics | str | None) -> Numerics:
        """The choices in effect, every field set: the format's defaults, then the preset's fields for
        this format (presets.PRESETS), then the fields given. A preset without an entry for this format,
        or a field or value the format does not have (e.g. a UE8M0 floor on an NVFP4 format), is a
        NumericsError naming what it has."""
        numerics = Numerics.of(numerics)
        if numerics is None or numerics is self.numerics:
            # (its own resolved choices, which the reference passes on, come back as they are: torch
            # 2.11's dynamo cannot trace the enum iteration below)
            return self.numerics
        out = {k: getattr(self.numerics, k) for k in CHOICE_TYPES}
        layers = [numerics.given()]
        if numerics.preset is not None:
            layers.insert(0, preset_entry(numerics.preset, self.name).numerics.given())
        choices = self.numerics_choices()
        for layer in layers:
            for field, value in layer.items():
                if value not in choices.get(field, ()):
                    has = "; ".join(f"{k}={'|'.join(v.value for v in vs)}" for k, vs in choices.items())
                    what = f"no {field} choice" if field not in choices else f"no {field}={value.value}"
                    raise NumericsError(f"cache format {self.name} has {what}; it has: {has}")
                out[field] = value
        return Numerics(**out)

    def numerics_flags(self, numerics: Numerics | str | None = None) -> int:
        """The kernels' `numerics` argument for these choices (NumericsFlag bits)."""
        n = self.resolve_numerics(numerics)
        return sum(int(NUMERICS_FLAGS[field].get(value, 0)) for field, value in n.given().items())

    def numerics_choices(self) -> dict[str, list[enum.Enum]]:
        """Per field the format has, its values, default first."""
        out = {}
        for field, value in self.numerics.given().items():
            rest = [v for v in type(value) if v is not value and v not in self.numerics_excluded]
            out[field] = [value, *rest]
        return out

    def presets(self) -> list[str]:
        """The engine presets (presets.PRESETS) with an entry for this format."""
        return [name for name, p in PRESETS.items() if self.name in p.formats]

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


# default parity choices, by what a format has: every format has the RoPE ones; the E4M3 block formats
# the NaN / Inf ones; the UE8M0 E4M3 formats the floor; FP4 the zero sign; a scale pad its pad
ROPE_DEFAULTS = dict(
    rotated_row=RotatedRow.IO_ROUNDED, nope_rotation=NopeRotation.NONE, rope_order=RopeOrder.EVEN_SIN
)
E4M3_BLOCK_DEFAULTS = dict(ROPE_DEFAULTS, e4m3_nan=E4m3Nan.NAN, inf_scale=InfScale.SATURATE)
UE8M0_FLOOR_DEFAULTS = dict(E4M3_BLOCK_DEFAULTS, scale_floor=ScaleFloor.AMAX, amax_floor=AmaxFloor.E4)
FP4_DEFAULTS = dict(ROPE_DEFAULTS, fp4_zero=Fp4Zero.SIGNED)

E4_BLOCK_NAN = (
    "amax ignores NaN; by default NaN -> 0x7F (e4m3_nan) and a block holding +-Inf gets byte 254 (inf_scale), "
    "stores Inf as +-448 and its finite values as +-0"
)

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
            numerics=Numerics(**UE8M0_FLOOR_DEFAULTS, scale_pad=ScalePad.ZERO),
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
            numerics=Numerics(**UE8M0_FLOOR_DEFAULTS),
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
            nan_policy="amax ignores NaN; by default NaN -> 0x7F and a token holding +-Inf gets scale 2^127, "
            "stores Inf as +-448",
            numerics=Numerics(**E4M3_BLOCK_DEFAULTS),
            numerics_excluded=(InfScale.WRAPPED,),  # a float32 scale has no wrapped UE8M0 byte
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
            numerics=Numerics(**FP4_DEFAULTS),
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
            numerics=Numerics(**ROPE_DEFAULTS),
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
            numerics=Numerics(**ROPE_DEFAULTS),
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
            numerics=Numerics(**FP4_DEFAULTS),
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
            numerics=Numerics(**FP4_DEFAULTS, scale_pad=ScalePad.ZERO),
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


def preset_rows() -> list[dict]:
    """The engine presets per format (format x preset -> fields), used by `list --why` and
    docs/formats.md: the fields each preset sets, the writer it follows and the row classes it cannot
    match (presets.ROW_CLASSES)."""
    rows = []
    for f in FORMATS.values():
        for name in f.presets():
            entry = PRESETS[name].formats[f.name]
            rows.append(
                {
                    "format": f.name,
                    "preset": name,
                    "fields": entry.numerics.text() or "format defaults",
                    "row classes not matched": ", ".join(entry.unmatched) or "none",
                    "source": entry.source,
                }
            )
    return rows
