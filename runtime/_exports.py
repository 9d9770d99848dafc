"""The package's public names: `attn_prologue` re-exports this module. Importing it imports torch and
registers torch.ops.attn_prologue.*; the command line imports it after parsing its arguments, so that
`python -m attn_prologue ... --help` and a mistyped argument cost no torch import."""

from __future__ import annotations

from . import torch_op  # noqa: F401  (registers torch.ops.attn_prologue.*)
from .api import BoundKvOp, BoundOp, bind, bind_kv
from .bound_index_q import BoundIndexQOp, bind_index_q
from .codecs import decode_cache
from .dispatch import Runtime, default_runtime
from .errors import AttnPrologueError, InputError, RegistrationError, ScratchError, UnsupportedError
from .formats import FORMATS, get_format
from .index_q_ops import index_q_rope_quant
from .launch import LaunchConfig
from .ops import kv_rope_insert, qnorm_rope_kv_insert
from .scratch import ScratchPool

__all__ = [
    "FORMATS",
    "AttnPrologueError",
    "BoundIndexQOp",
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
    "bind_index_q",
    "bind_kv",
    "decode_cache",
    "default_runtime",
    "get_format",
    "index_q_rope_quant",
    "kv_rope_insert",
    "qnorm_rope_kv_insert",
]
