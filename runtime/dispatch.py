"""Dispatcher: (arch, op, head dims, cache format, dtype) -> generated variant; token count ->
launch config. Reads the generated registry (data), never the generator."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import UnsupportedError
from .generated import registry
from .launch import LaunchConfig

# compute capability -> (arch family, compile target)
CAPABILITY_TARGETS = {
    (9, 0): ("sm90", "sm_90a"),
    (10, 0): ("sm100", "sm_100a"),
    (12, 0): ("sm120", "sm_120a"),
    (12, 1): ("sm120", "sm_121a"),
}
NATIVE_FAMILIES = ("sm100", "sm120")


@dataclass(frozen=True)
class VariantInfo:
    name: str
    op: str
    q_out: str
    head_dim: int
    rope_dim: int
    cache_format: str
    io_dtype: str
    arch: str
    conversions: str
    signature: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def _tables():
    infos = {}
    by_key = {}
    for name, row in registry.VARIANTS.items():
        info = VariantInfo(name, *row[:8], registry.SIGNATURES[row[8]])
        infos[name] = info
        by_key[
            (
                info.arch,
                info.conversions,
                info.op,
                info.q_out,
                info.head_dim,
                info.rope_dim,
                info.cache_format,
                info.io_dtype,
            )
        ] = name
    return infos, by_key


def variant_info(name: str) -> VariantInfo:
    try:
        return _tables()[0][name]
    except KeyError:
        raise UnsupportedError(f"no generated variant named {name!r}") from None


def target_for_capability(major: int, minor: int) -> tuple[str, str]:
    try:
        return CAPABILITY_TARGETS[(major, minor)]
    except KeyError:
        known = ", ".join(f"{a}.{b} ({t})" for (a, b), (_, t) in sorted(CAPABILITY_TARGETS.items()))
        raise UnsupportedError(
            f"no kernels for compute capability {major}.{minor}; supported: {known}"
        ) from None


def default_conversions(arch: str) -> str:
    return "native" if arch in NATIVE_FAMILIES else "portable"


def select_variant(
    *,
    arch: str,
    op: str,
    head_dim: int,
    rope_dim: int,
    cache_format: str,
    io_dtype: str,
    q_out: str = "io",
    conversions: str | None = None,
) -> str:
    """The variant name for a request, or an UnsupportedError naming the alternatives."""
    conversions = conversions or default_conversions(arch)
    _, by_key = _tables()
    key = (arch, conversions, op, q_out, head_dim, rope_dim, cache_format, io_dtype)
    name = by_key.get(key)
    if name is None and conversions == "portable":  # formats without arch conversions have one module
        name = by_key.get((arch, "native") + key[2:])
    if name is not None:
        return name
    raise UnsupportedError(
        _explain_miss(
            dict(
                zip(
                    (
                        "arch",
                        "conversions",
                        "op",
                        "q_out",
                        "head_dim",
                        "rope_dim",
                        "cache_format",
                        "io_dtype",
                    ),
                    key,
                )
            )
        )
    )


def _explain_miss(req: dict) -> str:
    infos = _tables()[0].values()
    wanted = ", ".join(f"{k}={v}" for k, v in req.items())
    # find the first field that no variant matching all earlier fields offers
    pool = list(infos)
    for field in ("arch", "op", "q_out", "cache_format", "head_dim", "rope_dim", "io_dtype"):
        choices = sorted({str(getattr(i, field)) for i in pool})
        if str(req[field]) not in choices:
            return f"no kernel variant for {wanted}: {field}={req[field]} is not available here; available: {', '.join(choices)}"
        pool = [i for i in pool if str(getattr(i, field)) == str(req[field])]
    return f"no kernel variant for {wanted}"


def require_shape(head_dim: int, rope_dim: int, cache_format: str) -> None:
    """UnsupportedError unless some generated variant has these head/rope dims and format."""
    infos = _tables()[0].values()
    if any(
        i.head_dim == head_dim and i.rope_dim == rope_dim and i.cache_format == cache_format for i in infos
    ):
        return
    dims = sorted({(i.head_dim, i.rope_dim) for i in infos if i.cache_format == cache_format})
    raise UnsupportedError(
        f"no kernel variant for head_dim={head_dim}, rope_dim={rope_dim} with {cache_format}; "
        f"generated (D, R): {dims}"
    )


def default_config(arch: str) -> LaunchConfig:
    return LaunchConfig.from_key(registry.DEFAULT_CONFIGS[arch])


def targets_of(arch: str) -> tuple[str, ...]:
    return registry.TARGETS[arch]
