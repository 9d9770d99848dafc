"""attn_prologue: generated, architecture-specialized CuTe-DSL kernels for the fused attention
prologue (Q RMSNorm + RoPE, KV RoPE, block-scaled quantization, paged KV-cache insert).

Serving: `ScratchPool`, `bind` / `bind_kv` (per layer), or the one-call functions `qnorm_rope_kv_insert` and
`kv_rope_insert`; importing the package registers them as torch.ops.attn_prologue.* too. Build:
`python -m attn_prologue generate | build`. Nothing here imports the DSL compiler or Jinja.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__version__ = "0.1.0"


def _started_as_the_command_line() -> bool:
    """Is this process `python -m attn_prologue ...` or the `attn-prologue` script? Read from the
    interpreter's own command line: its options, then `-m attn_prologue`."""
    if sys.argv[0].endswith(("/attn-prologue", "\\attn-prologue", "attn-prologue.exe")):
        return True
    argv = getattr(sys, "orig_argv", [])
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-c", "-"):
        if argv[i] == "-m":
            return argv[i + 1 : i + 2] == [__name__]
        if argv[i].startswith("-m"):
            return argv[i][2:] == __name__
        i += 2 if argv[i] in ("-X", "-W") else 1
    return False


if _started_as_the_command_line():
    # The command line parses first and then imports _exports itself where its command needs it, so
    # `--help` and a mistyped argument never wait for torch. Public names still resolve on first use.
    def __getattr__(name: str):
        # a submodule is not a public name: `from . import x` then imports it, without torch
        if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        exports = importlib.import_module(f"{__name__}._exports")
        globals().update({n: getattr(exports, n) for n in exports.__all__})
        if name not in exports.__all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return globals()[name]

else:
    from ._exports import *  # noqa: F403
    from ._exports import __all__  # noqa: F401
