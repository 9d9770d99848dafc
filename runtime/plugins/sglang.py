"""The SGLang plugin: entry point `sglang.srt.plugins` -> `install` (docs/sglang-plugin.md).

SGLang's `load_plugins()` runs `install` in every process, then `HookRegistry.apply_hooks()`. Each
seam is handed to SGLang's HookRegistry as a REPLACE hook (the gate's `put`), which SGLang applies
at the end of `load_plugins()` and propagates to modules holding `from X import Y` copies (the
`dsv4` package, the model file, the memory pool). An `install()` made outside `load_plugins()` takes
effect at the next `HookRegistry.apply_hooks()`.

Two seams of SGLang's kernel wrappers in `sglang/kernels/ops/attention/dsv4/norm_rope.py`. Each
replacement runs our op only where one call of it does what SGLang's kernel does, rounding step for
rounding step, and calls SGLang's own function for everything else (docs/sglang-plugin.md, "What
runs where", says why for each case):

* `fused_q_norm_rope` with `eps=None` (RoPE only, the V4.1 models): our Q path with
  `apply_q_norm=False` and no KV rows (M = 0); an FP8 `q_output` as SGLang does it, through a bf16
  temporary and `copy_`. `eps` given (the norm path) stays SGLang's: its kernel rounds the normed
  row to bf16 before RoPE, ours rounds once.
* `fused_k_norm_rope_flashmla` (the SWA key store) for `KVLayout.V41` (block-split 528 B pages, our
  `mxfp8`): `kv_rope_insert(..., norm_weight, eps, numerics="preset=sglang")`. `V4` (584 B) stays
  SGLang's: its writer quantizes the float32 normed row, ours the bf16-rounded one. `V41_FP4` has
  no kv_norm kernel here; the `_NEW` layouts are not our page; `q` (ROCm) is not our op.
* `fused_q_indexer_rope_hadamard_quant` and `..._fp4_quant` (the indexer's Q, RoPE + Hadamard + FP8 or
  MXFP4): our `index_q_rope_quant` with the `sglang` preset, its outputs allocated as SGLang's wrappers
  allocate them. Rows SGLang's CUDA kernels do not take (not bf16) stay SGLang's.

The norm's 1/sqrt is the one difference left on the V4.1 store: SGLang's `rsqrtf` is approximate
and sums in another order, so a normed value can land on the neighbouring bf16 (rarely visible
after quantization), as for the `kv_norm` rows of the `vllm-triton` presets.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref

import torch

from .. import ops
from ..errors import InputError, UnsupportedError
from ..index_q_ops import index_q_rope_quant
from . import Installed, Seam, engine_version
from . import install as install_seams

log = logging.getLogger(__name__)

NORM_ROPE = "sglang.kernels.ops.attention.dsv4.norm_rope"
Q_PARAMETERS = ("q_input", "q_output", "eps", "freqs_cis", "positions")
KV_PARAMETERS = (
    "kv", "kv_weight", "eps", "freqs_cis", "positions", "out_loc", "kvcache", "page_size", "layout", "q",
)  # fmt: skip
# SGLang's KVLayout value -> our cache format, where the page and the writer's rounding are ours
OUR_LAYOUTS = {"v41": "mxfp8"}
HEAD_DIM, ROPE_PAIRS = 512, 32  # what SGLang's FlashMLA-layout kernels take (static_assert 512, 64)
INDEX_Q_PARAMETERS = ("q_input", "weight", "weight_scale", "freqs_cis", "positions")
INDEX_HEAD_DIM = 128  # the indexer's Q rows (SGLang's Hadamard kernels take 128 only)
Q_ONLY_FORMAT, Q_ONLY_RECORD = "fp8_ds_mla", 584  # the format of the one-page cache a Q-only call names

_installed: Installed | None = None
_refused: set[tuple[str, str]] = set()  # (seam, error type) already logged
_tables: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(freqs_cis) -> (ref, _version, cos_sin)
_spares: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (no slots, one-page cache)


def install(version: str | None = None, seams_by_version: dict | None = None) -> Installed | None:
    """The entry point: hand every seam to SGLang's HookRegistry, or none (attn_prologue.plugins).
    `version` and `seams_by_version` are for tests (default: the installed sglang, VERSIONS)."""
    global _installed
    if _installed is not None and _installed.replaced:
        return _installed
    table = VERSIONS if seams_by_version is None else seams_by_version
    version = engine_version("sglang") if version is None else version
    _installed = install_seams("SGLang", version, table, log, put=through_hook_registry)
    return _installed


def through_hook_registry(seam: Seam, owner: object, attr: str, original: object, replacement):
    """The gate's `put` for SGLang: a REPLACE hook on the seam's dotted name. The undo (tests only)
    drops the hook and, once applied, puts the original back where SGLang's propagation had put ours."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _propagate_patch

    target = seam.name
    HookRegistry.register(target, replacement, HookType.REPLACE)

    def undo() -> None:
        hooks = HookRegistry._hooks.get(target, [])
        hooks[:] = [h for h in hooks if h[1] is not replacement]
        if not hooks:
            HookRegistry._hooks.pop(target, None)
        if target in HookRegistry._patched:
            HookRegistry._patched.discard(target)
            applied = inspect.getattr_static(owner, attr)
            setattr(owner, attr, original)
            _propagate_patch(applied, original, owner)

    return undo


# ---- what the replacements share -------------------------------------------------------------
def cos_sin(freqs_cis: torch.Tensor) -> torch.Tensor:
    """SGLang's complex table [max_pos, R/2] (cos + i sin per GPT-J pair) as our [max_pos, R] float32
    (cos columns, then sin columns). Made once per table (kept while the table lives and is unchanged)."""
    key = id(freqs_cis)
    hit = _tables.get(key)
    if hit is not None and hit[0]() is freqs_cis and hit[1] == freqs_cis._version:
        return hit[2]
    table = torch.cat((freqs_cis.real, freqs_cis.imag), dim=-1).to(torch.float32).contiguous()
    _tables[key] = (weakref.ref(freqs_cis, lambda _, k=key: _tables.pop(k, None)), freqs_cis._version, table)
    return table


def positions64(positions: torch.Tensor) -> torch.Tensor:
    """SGLang's kernels read int32 or int64 positions; ours int64 (the same values)."""
    return positions if positions.dtype == torch.int64 else positions.to(torch.int64)


def spares(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(an empty slot_mapping, a one-page cache of one token) for Q-only calls: M = 0 writes no KV."""
    if device not in _spares:
        _spares[device] = (
            torch.empty(0, dtype=torch.int64, device=device),
            torch.zeros(1, Q_ONLY_RECORD, dtype=torch.uint8, device=device),
        )
    return _spares[device]


def ours_run(device: torch.device) -> bool:
    """Our kernels on CUDA (not ROCm: SGLang's HIP build rounds its RoPE another way), the reference on CPU."""
    return device.type == "cpu" or (device.type == "cuda" and torch.version.hip is None)


def table_ok(freqs_cis) -> bool:
    return (
        isinstance(freqs_cis, torch.Tensor)
        and freqs_cis.dtype == torch.complex64
        and freqs_cis.dim() == 2
        and freqs_cis.shape[1] == ROPE_PAIRS
    )


def positions_ok(positions, n: int) -> bool:
    return (
        isinstance(positions, torch.Tensor)
        and positions.dtype in (torch.int32, torch.int64)
        and positions.shape == (n,)
    )


def attempt(seam: str, call) -> bool:
    """Run our op; on a call it refuses (refused before anything is written, docs/op.md) log once
    per seam and error type and return False, so that SGLang's own kernel runs it."""
    try:
        call()
    except (InputError, UnsupportedError) as exc:
        if (seam, type(exc).__name__) not in _refused:
            _refused.add((seam, type(exc).__name__))
            log.warning("attn_prologue: %s: our op refused a call (%s); SGLang's kernel ran it", seam, exc)
        return False
    return True


# ---- fused_q_norm_rope -----------------------------------------------------------------------
def q_is_ours(q_input, q_output, eps, freqs_cis, positions) -> bool:
    """RoPE only, shapes SGLang's kernel takes, an output our op writes (or SGLang's FP8 route)."""
    if eps is not None or not isinstance(q_input, torch.Tensor) or not isinstance(q_output, torch.Tensor):
        return False
    if q_input.dim() != 3 or q_input.shape[2] != HEAD_DIM or q_output.shape != q_input.shape:
        return False
    fp8 = q_output.dtype == torch.float8_e4m3fn and q_input.dtype == torch.bfloat16
    if q_input.dtype not in (torch.bfloat16, torch.float16) or not (fp8 or q_output.dtype == q_input.dtype):
        return False
    if q_output.device != q_input.device or not ours_run(q_input.device):
        return False
    if q_output.untyped_storage().data_ptr() == q_input.untyped_storage().data_ptr():
        return False  # in place: our Q-only call reads its stand-in KV rows from q_input
    return table_ok(freqs_cis) and positions_ok(positions, q_input.shape[0])


def q_rope_only(q_input, out, freqs_cis, positions) -> None:
    """Our Q path with no norm into `out`, and no KV row (M = 0: rows of `kv` past M are not read,
    so a view of `q_input` stands in for it; the one-page cache is never written)."""
    no_slots, page = spares(q_input.device)
    ops.qnorm_rope_kv_insert(
        q_input, q_input[:, 0], out, page, no_slots, positions64(positions), cos_sin(freqs_cis),
        0.0, 1, Q_ONLY_FORMAT, apply_q_norm=False,
    )  # fmt: skip


def q_seam(original):
    def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions):
        if q_is_ours(q_input, q_output, eps, freqs_cis, positions):
            fp8 = q_output.dtype == torch.float8_e4m3fn
            # SGLang's FP8 route: its bf16 result, then copy_ (not our q_scale path, which rounds once)
            out = torch.empty_like(q_input) if fp8 else q_output
            if attempt("fused_q_norm_rope", lambda: q_rope_only(q_input, out, freqs_cis, positions)):
                if fp8:
                    q_output.copy_(out)
                return None
        return original(q_input, q_output, eps, freqs_cis, positions)

    fused_q_norm_rope.__doc__ = f"attn_prologue's replacement of {NORM_ROPE}.fused_q_norm_rope (sglang.py)."
    return fused_q_norm_rope


# ---- fused_k_norm_rope_flashmla --------------------------------------------------------------
def kv_format(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout, q) -> str | None:
    """Our cache format for this call, or None where SGLang's kernel runs it. The accepted arguments
    are the ones SGLang's kernel accepts (its TensorMatcher: out_loc int32, a page stride of exactly
    KVLayout.page_bytes(page_size), a power-of-two page), so nothing it refuses runs here."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    try:
        layout = KVLayout.parse(layout)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    fmt = OUR_LAYOUTS.get(layout.value)
    if fmt is None or q is not None or not all(isinstance(t, torch.Tensor) for t in (kv, kv_weight, kvcache)):
        return None
    if not (type(page_size) is int and page_size > 0 and page_size & (page_size - 1) == 0):
        return None
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        return None
    n = kv.shape[0] if kv.dim() == 2 else -1
    return (
        fmt
        if kv.dim() == 2
        and kv.shape[1] == HEAD_DIM
        and kv.dtype in (torch.bfloat16, torch.float16)
        and kv_weight.shape == (HEAD_DIM,)
        and kv_weight.dtype == kv.dtype
        and ours_run(kv.device)
        and table_ok(freqs_cis)
        and positions_ok(positions, n)
        and isinstance(out_loc, torch.Tensor)
        and out_loc.dtype == torch.int32
        and out_loc.shape == (n,)
        and kvcache.dtype == torch.uint8
        and kvcache.dim() == 2
        and kvcache.stride() == (layout.page_bytes(page_size), 1)
        else None
    )


def kv_seam(original):
    def fused_k_norm_rope_flashmla(
        kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout="v4", q=None
    ):
        args = (kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout, q)
        fmt = kv_format(*args)

        def ours() -> None:
            ops.kv_rope_insert(
                kv, kvcache, out_loc, positions64(positions), cos_sin(freqs_cis), page_size, fmt,
                norm_weight=kv_weight, eps=float(eps), numerics="preset=sglang",
            )  # fmt: skip

        if fmt is not None and attempt("fused_k_norm_rope_flashmla", ours):
            return None
        return original(*args)

    fused_k_norm_rope_flashmla.__doc__ = (
        f"attn_prologue's replacement of {NORM_ROPE}.fused_k_norm_rope_flashmla (sglang.py)."
    )
    return fused_k_norm_rope_flashmla


# ---- fused_q_indexer_rope_hadamard_quant / _fp4_quant (the indexer's Q) ----------------------------------
def index_q_is_ours(q_input, weight, weight_scale, freqs_cis, positions) -> bool:
    """What SGLang's CUDA kernels take (bf16 [T, H, 128] rows, weight [T, H] of q's dtype) on CUDA or CPU."""
    return (
        isinstance(q_input, torch.Tensor)
        and q_input.dim() == 3
        and q_input.shape[2] == INDEX_HEAD_DIM
        and q_input.dtype == torch.bfloat16
        and isinstance(weight, torch.Tensor)
        and weight.dtype == q_input.dtype
        and weight.shape == q_input.shape[:2]
        and weight.device == q_input.device
        and ours_run(q_input.device)
        and isinstance(weight_scale, (int, float))
        and not isinstance(weight_scale, bool)
        and math.isfinite(weight_scale)
        and table_ok(freqs_cis)
        and positions_ok(positions, q_input.shape[0])
    )


def index_q(q_input, weight, weight_scale, freqs_cis, positions, fmt: str):
    """Our op with the sglang preset into outputs allocated as SGLang's wrappers allocate them; SGLang's one
    weight_scale (softmax_scale * n_heads^-0.5, a double) is our softmax_scale with head_scale 1."""
    t, h, d = q_input.shape
    weights_out = torch.empty(t, h, 1, dtype=torch.float32, device=q_input.device)
    if fmt == "mxfp4":
        q_out = torch.empty(t, h, d // 2, dtype=torch.int8, device=q_input.device)
        q_sf = torch.empty(t, h, dtype=torch.int32, device=q_input.device)
        scales = q_sf.view(torch.uint8).view(t, h, d // 32)  # the int32 is its 4 UE8M0 bytes, little-endian
    else:
        q_out = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=q_input.device)
        q_sf = scales = None
    # (int32 positions as they are: index_q has an int32-positions module)
    index_q_rope_quant(
        q_input, positions, cos_sin(freqs_cis), weight, float(weight_scale), 1.0,
        q_out.view(torch.uint8), weights_out.view(t, h), scales, fmt, numerics="sglang",
    )  # fmt: skip
    return ((q_out, q_sf), weights_out) if fmt == "mxfp4" else (q_out, weights_out)


def index_q_seam(fmt: str):
    name = (
        "fused_q_indexer_rope_hadamard_fp4_quant" if fmt == "mxfp4" else "fused_q_indexer_rope_hadamard_quant"
    )

    def make(original):
        def replacement(q_input, weight, weight_scale, freqs_cis, positions):
            out = []
            if index_q_is_ours(q_input, weight, weight_scale, freqs_cis, positions) and attempt(
                name, lambda: out.append(index_q(q_input, weight, weight_scale, freqs_cis, positions, fmt))
            ):
                return out[0]
            return original(q_input, weight, weight_scale, freqs_cis, positions)

        replacement.__name__ = replacement.__qualname__ = name
        replacement.__doc__ = f"attn_prologue's replacement of {NORM_ROPE}.{name} (sglang.py)."
        return replacement

    return make


# sglang version -> the seams checked against it (parameter names read from that release's wheel)
VERSIONS: dict[str, tuple[Seam, ...]] = {
    "0.5.23": (
        Seam(NORM_ROPE, "fused_q_norm_rope", Q_PARAMETERS, q_seam),
        Seam(NORM_ROPE, "fused_k_norm_rope_flashmla", KV_PARAMETERS, kv_seam),
        Seam(NORM_ROPE, "fused_q_indexer_rope_hadamard_quant", INDEX_Q_PARAMETERS, index_q_seam("fp8_token")),
        Seam(NORM_ROPE, "fused_q_indexer_rope_hadamard_fp4_quant", INDEX_Q_PARAMETERS, index_q_seam("mxfp4")),
    ),
}
