"""attn_prologue: generated, architecture-specialized CuTe-DSL kernels for the fused attention
prologue (Q RMSNorm + RoPE, KV RoPE, block-scaled quantization, paged KV-cache insert).

Serving: `ScratchPool`, `bind` / `bind_kv` (per layer), or the one-call functions `qnorm_rope_kv_insert` and
`kv_rope_insert`; importing the package registers them as torch.ops.attn_prologue.* too. Build:
`python -m attn_prologue generate | build`. Nothing here imports the DSL compiler or Jinja.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import torch_op  # noqa: F401  (registers torch.ops.attn_prologue.*)
from .api import BoundKvOp, BoundOp, bind, bind_kv
from .codecs import decode_cache
from .dispatch import Runtime, default_runtime
from .errors import AttnPrologueError, InputError, RegistrationError, ScratchError, UnsupportedError
from .formats import FORMATS, get_format
from .launch import LaunchConfig
from .ops import kv_rope_insert, qnorm_rope_kv_insert
from .scratch import ScratchPool

__all__ = [
    "FORMATS",
    "AttnPrologueError",
    "BoundKvOp",
    "BoundOp",
    "InputError",
    "LaunchConfig",
    "RegistrationError",
    "Runtime",
    "ScratchError",
    "ScratchPool",
    "UnsupportedError",
    "bind",
    "bind_kv",
    "decode_cache",
    "default_runtime",
    "get_format",
    "kv_rope_insert",
    "qnorm_rope_kv_insert",
]
