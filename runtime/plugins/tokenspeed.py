"""The TokenSpeed plugin: entry point `tokenspeed_kernel.plugins` -> `install` (docs/tokenspeed-plugin.md).

TokenSpeed's kernel package dispatches its DeepSeek-V4 SWA prologue,
`tokenspeed_kernel.ops.attention.dsv4.dsv4_swa_cache_insert`, through its kernel registry
(`select_kernel("attention", "dsv4_swa_cache_insert", ...)`). The host calls
`tokenspeed_kernel.plugins.discover_plugins()`, which runs `install`: it registers our kernel for that
operator at `Priority.PLUGIN` (16, the band TokenSpeed reserves for out-of-tree plugins), so it
outranks the in-tree kernels (`cuda_dsv4_swa_cache_insert`, SPECIALIZED; `triton_dsv4_swa_cache_insert`,
PORTABLE) wherever it matches: NVIDIA, bf16 Q/KV, the traits the in-tree kernels declare.

The seam the version gate checks is the in-tree kernel `triton_dsv4_swa_cache_insert` (defined on every
vendor): its parameters are the keyword arguments TokenSpeed's op passes to whichever kernel it
selects, i.e. what ours must take. The gate's `put` registers ours in TokenSpeed's registry instead
of `setattr` (nothing of TokenSpeed is patched) and returns what unregisters it.

Our kernel writes Q once, into `q_out` or in place into `q` (TokenSpeed's CUDA kernel copies q into
q_out, then runs in place), and the 584 B page-planar SWA record (our `fp8_ds_mla`) with
`numerics="preset=vllm"`: TokenSpeed's CUDA kernel (`fused_dsv4_qnorm_rope_kv_rope_quant_insert`,
read in lightseekorg/tokenspeed `deepseek_v4_attention.cu` and in the SASS of the 0.1.4 wheel's
`dsv4_attention.so`) is vLLM's rule: fmaxf(amax, 1e-4), ceil(log2(amax / 448)), fminf(fmaxf(x * 2^-e,
-448), 448) (NaN -> 0xfe), byte min(e + 127, 255) (Inf -> 255), pad byte 0, the rope tail the
bf16-rounded rotation. What is left (docs/tokenspeed-plugin.md, "Numerics"): its Q norm is
`rsqrtf` (MUFU.RSQ, approximate) of a warp-shuffle sum where ours is an IEEE square root and
division, so a Q value can land on the neighbouring bf16; and the binary is built with fast math
(FTZ), so subnormal inputs differ.

Not ours, left to TokenSpeed's own selection: fp16 (TokenSpeed's CUDA kernel stores the rope tail as
fp16, our record as bf16: we register no fp16 signature), AMD and Ascend (capability NVIDIA), and a
call our op refuses (e.g. a page stride not a multiple of 16 bytes): nothing is written, the kernel
TokenSpeed would have selected without us runs it, and one warning per kind of refusal says why.
"""

from __future__ import annotations

import logging

import torch

from .. import ops
from ..errors import InputError, UnsupportedError
from . import Installed, Seam, engine_version
from . import install as install_seams

log = logging.getLogger(__name__)

DISTRIBUTION = "tokenspeed-kernel"
FAMILY, MODE = "attention", "dsv4_swa_cache_insert"
NAME = "attn_prologue_dsv4_swa_cache_insert"  # our kernel's registry name (override= takes it)
SOLUTION = "attn_prologue"
DSV4_TRITON = "tokenspeed_kernel.ops.attention.dsv4.triton"
KERNEL_PARAMETERS = (
    "q", "kv", "swa_kv_cache", "slot_mapping", "positions", "cos_sin_cache", "rms_norm_eps", "page_size", "q_out",
)  # fmt: skip
CACHE_FORMAT = "fp8_ds_mla"  # TokenSpeed's "fp8_swa_page_planar" V4 record, 584 B per token
NUMERICS = "preset=vllm"  # TokenSpeed's CUDA kernel quantizes by vLLM's CUDA op's rules
# what the in-tree kernels declare (dsv4/triton.py, dsv4/cuda.py), as sets
TRAITS = {
    "head_dim": frozenset({512}),
    "quant_block_size": frozenset({64}),
    "rope_dim": frozenset({64}),
    "cache_layout": frozenset({"fp8_swa_page_planar"}),
    "has_q_out": frozenset({True, False}),
}

_installed: Installed | None = None
_refused: set[str] = set()  # error types already logged


def install(version: str | None = None, seams_by_version: dict | None = None) -> Installed | None:
    """The entry point (discover_plugins calls it with no argument): register our kernel, or
    nothing (attn_prologue.plugins). `version` and `seams_by_version` are for tests (default: the
    installed tokenspeed-kernel, VERSIONS). Registers again after TokenSpeed's registry was reset."""
    global _installed
    if _installed is not None and _installed.replaced and registered():
        return _installed
    table = VERSIONS if seams_by_version is None else seams_by_version
    version = engine_version(DISTRIBUTION) if version is None else version
    _installed = install_seams(DISTRIBUTION, version, table, log, put=into_registry)
    return _installed


def registered() -> bool:
    """Whether TokenSpeed's current registry holds our kernel."""
    from tokenspeed_kernel.registry import KernelRegistry

    return KernelRegistry.get().get_by_name(NAME) is not None


def signatures() -> frozenset:
    """The format signatures we take: the in-tree kernels' bf16 one (their fp16 one stores an fp16
    rope tail, which is not our record)."""
    from tokenspeed_kernel.signature import dense_tensor_format, format_signature

    return frozenset(
        {
            format_signature(
                q=dense_tensor_format(torch.bfloat16),
                kv=dense_tensor_format(torch.bfloat16),
                swa_kv_cache=dense_tensor_format(torch.uint8),
            )
        }
    )


def into_registry(seam: Seam, owner: object, attr: str, original: object, replacement):
    """The gate's `put` for TokenSpeed: register `replacement` as our kernel (TokenSpeed's own
    `register_kernel`, Priority.PLUGIN, NVIDIA); the undo (tests only) unregisters it."""
    from tokenspeed_kernel.platform import CapabilityRequirement
    from tokenspeed_kernel.registry import KernelRegistry, Priority, register_kernel

    register_kernel(
        FAMILY, MODE, name=NAME, solution=SOLUTION,
        capability=CapabilityRequirement(vendors=frozenset({"nvidia"})),
        signatures=signatures(), traits=dict(TRAITS), priority=Priority.PLUGIN,
    )(replacement)  # fmt: skip
    registry = KernelRegistry.get()

    def undo() -> None:
        if registry.get_impl(NAME) is replacement:
            registry._unregister(NAME)  # TokenSpeed has no public unregister; this drops its selections too

    return undo


# ---- the kernel ------------------------------------------------------------------------------
def ours_run(device: torch.device) -> bool:
    """Our kernels on CUDA (not ROCm), the reference on CPU."""
    return device.type == "cpu" or (device.type == "cuda" and torch.version.hip is None)


def displaced(q: torch.Tensor, cos_sin_cache: torch.Tensor, has_q_out: bool):
    """The kernel TokenSpeed would select for this call without ours (same platform, signature and
    traits, highest priority first): it runs what we do not."""
    from tokenspeed_kernel.platform import current_platform
    from tokenspeed_kernel.registry import KernelRegistry
    from tokenspeed_kernel.selection import NoKernelFoundError, spec_matches_traits
    from tokenspeed_kernel.signature import dense_tensor_format, format_signature

    signature = format_signature(
        q=dense_tensor_format(q.dtype),
        kv=dense_tensor_format(q.dtype),
        swa_kv_cache=dense_tensor_format(torch.uint8),
    )
    traits = {
        "head_dim": int(q.shape[-1]),
        "quant_block_size": 64,
        "rope_dim": int(cos_sin_cache.shape[-1]),
        "cache_layout": "fp8_swa_page_planar",
        "has_q_out": has_q_out,
    }
    registry = KernelRegistry.get()
    specs = registry.get_for_operator(FAMILY, MODE, platform=current_platform(), format_signature=signature)
    for spec in specs:  # kept sorted by priority, highest first
        if spec.name != NAME and spec_matches_traits(spec, traits):
            return registry.get_impl(spec.name)
    raise NoKernelFoundError(f"no kernel but {NAME} for {FAMILY}.{MODE} ({signature}) with traits {traits}")


def kernel_seam(original):
    def attn_prologue_dsv4_swa_cache_insert(
        q, kv, swa_kv_cache, slot_mapping, positions, cos_sin_cache, rms_norm_eps, page_size, q_out=None
    ):
        if q.dtype == torch.bfloat16 and ours_run(q.device):
            try:
                ops.qnorm_rope_kv_insert(
                    q, kv, q if q_out is None else q_out, swa_kv_cache, slot_mapping,
                    positions if positions.dtype == torch.int64 else positions.to(torch.int64),
                    cos_sin_cache, float(rms_norm_eps), int(page_size), CACHE_FORMAT, numerics=NUMERICS,
                )  # fmt: skip
                return None
            except (InputError, UnsupportedError) as exc:  # refused before anything was written
                if type(exc).__name__ not in _refused:
                    _refused.add(type(exc).__name__)
                    log.warning(
                        "attn_prologue: %s: our op refused a call (%s); TokenSpeed's kernel ran it", NAME, exc
                    )
        kernel = displaced(q, cos_sin_cache, q_out is not None)
        return kernel(
            q=q, kv=kv, swa_kv_cache=swa_kv_cache, slot_mapping=slot_mapping, positions=positions,
            cos_sin_cache=cos_sin_cache, rms_norm_eps=rms_norm_eps, page_size=page_size, q_out=q_out,
        )  # fmt: skip

    attn_prologue_dsv4_swa_cache_insert.__doc__ = (
        f"attn_prologue's kernel for TokenSpeed's {FAMILY}.{MODE} (attn_prologue/plugins/tokenspeed.py)."
    )
    return attn_prologue_dsv4_swa_cache_insert


# tokenspeed-kernel version -> the seams checked against it (parameter names read from that wheel)
VERSIONS: dict[str, tuple[Seam, ...]] = {
    "0.1.4": (Seam(DSV4_TRITON, "triton_dsv4_swa_cache_insert", KERNEL_PARAMETERS, kernel_seam),),
}
