"""Command line: `python -m attn_prologue <command>` (also the `attn-prologue` console script).

Parsing imports no torch, the DSL or codegen (so `--help` is instant and a mistyped argument is
refused at once); each command imports what it needs when it runs. The serving path never imports
this package. Exit status: 0 done, 1 a check failed (`generate --check`, `targets`, a simulation), 2 a
bad argument or one of the package's typed errors (one line, no traceback).
"""

from __future__ import annotations

import importlib
import sys

from .parser import build_parser

__all__ = ["build_parser", "main"]


def _needs_a_gpu(args) -> str | None:
    """The one-line refusal of a GPU command on a machine without one, naming the CPU alternative."""
    if args.gpu is None or getattr(args, "device", "cuda") == "cpu":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return f"attn_prologue {args.command}: needs a CUDA GPU, and none is available here" + (
        f"; {args.gpu}" if args.gpu else ""
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.serving:  # the package's public API and torch ops, as a program importing it sees them
        importlib.import_module("attn_prologue._exports")
    refusal = _needs_a_gpu(args)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    from ..errors import AttnPrologueError

    module, function = args.handler.split(":")
    try:
        return getattr(importlib.import_module(module), function)(args)
    except AttnPrologueError as exc:  # the package's own, typed errors: one line, no traceback
        print(f"attn_prologue {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
