"""attn_prologue: generated, architecture-specialized CuTe-DSL kernels for the fused attention
prologue (Q RMSNorm + RoPE, KV RoPE, block-scaled quantization, paged KV-cache insert).

Serving: `ScratchPool`, `bind` (per layer), or the one-call functions `qnorm_rope_kv_insert` and
`kv_rope_insert` (also registered as torch.ops.attn_prologue.*). Build: `python -m attn_prologue
generate | build`. Everything below imports lazily, so `import attn_prologue` stays cheap.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "ScratchPool": ("scratch", "ScratchPool"),
    "bind": ("api", "bind"),
    "BoundOp": ("api", "BoundOp"),
    "qnorm_rope_kv_insert": ("torch_op", "qnorm_rope_kv_insert"),
    "kv_rope_insert": ("torch_op", "kv_rope_insert"),
    "decode_cache": ("codecs", "decode_cache"),
    "FORMATS": ("formats", "FORMATS"),
    "get_format": ("formats", "get_format"),
    "LaunchConfig": ("launch", "LaunchConfig"),
    "AttnPrologueError": ("errors", "AttnPrologueError"),
    "UnsupportedError": ("errors", "UnsupportedError"),
    "InputError": ("errors", "InputError"),
    "ScratchError": ("errors", "ScratchError"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attn_prologue' has no attribute {name!r}")
