"""Paged KV-cache formats: the one place a byte layout is defined.

Every format keeps the per-token data records first in a block and the per-token scale records
after all of them (a footer), so data records stay 16-byte aligned (spec/formats.md). The codecs,
the PyTorch reference, the generator and the runtime validation all read these tables.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ElementCode(enum.Enum):
    """How one value is stored in a data record."""

    E4M3 = "e4m3"  # float8_e4m3fn, one byte
    E2M1 = "e2m1"  # fp4, two per byte (element 2j in the low nibble)
    BF16 = "bf16"  # bfloat16, little-endian


class ScaleCode(enum.Enum):
    """How a quantization block's scale is stored."""

    NONE = "none"  # unquantized
    UE8M0 = "ue8m0"  # one byte per block, value 2^(byte - 127)
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
    divide_by_fp_max: bool  # True: e = ceil(log2(amax / fp_max)); False: amax * fl(1 / fp_max)
    summary: str

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

    def num_scales(self, head_dim: int) -> int:
        if self.scale in (ScaleCode.NONE, ScaleCode.TENSOR_F32):
            return 0
        return self.dims(head_dim)[0] // self.quant_block

    def scale_bytes(self, head_dim: int) -> int:
        """Bytes of one token's scale record in the footer (pad included)."""
        if self.scale is ScaleCode.UE8M0:
            return self.num_scales(head_dim) + self.scale_pad_bytes
        if self.scale is ScaleCode.F32_POW2:
            return 4 * self.num_scales(head_dim)
        return 0

    def bytes_per_token(self, head_dim: int) -> int:
        return self.data_bytes(head_dim) + self.scale_bytes(head_dim)

    def block_bytes(self, head_dim: int, block_size: int) -> int:
        """Bytes of one block's records (the page may be larger: trailing padding)."""
        return block_size * self.bytes_per_token(head_dim)

    def data_offset(self, head_dim: int, block_size: int, o: int) -> int:
        return o * self.data_bytes(head_dim)

    def scale_offset(self, head_dim: int, block_size: int, o: int) -> int:
        return block_size * self.data_bytes(head_dim) + o * self.scale_bytes(head_dim)

    def supports_head_dim(self, head_dim: int, rope_dim: int) -> bool:
        if self.head_dim is not None:
            return head_dim == self.head_dim and rope_dim == self.rope_dim
        return True

    @property
    def needs_tensor_scale(self) -> bool:
        return self.scale is ScaleCode.TENSOR_F32


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
        ),
    )
}


class UnknownFormatError(KeyError):
    pass


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
            start = q
            data += f"; +{start}..+{start + 2 * tail - 1}: {tail} x bf16 rope"
        if f.scale is ScaleCode.UE8M0:
            scale = f"{f.num_scales(d)} x ue8m0 (1 per {f.quant_block})" + (
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
