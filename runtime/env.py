"""Every ATTN_PROLOGUE_* environment variable, parsed in one place: its type, accepted values and default.

A variable is read where it is first needed, never at import, so a bad value never makes
`import attn_prologue` fail: it is an `EnvironmentVariableError` (naming the variable, the value and
what it accepts) from the first call that needs it. Each distinct value is parsed once. Names and
values are matched without regard to case or surrounding blanks; an empty value is the default.
docs/environment.md lists them all (a test keeps that table and this one in step).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import AttnPrologueError


class EnvironmentVariableError(AttnPrologueError, ValueError):
    """An ATTN_PROLOGUE_* variable holds a value it does not accept."""


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.lower()
        if word not in values:
            raise ValueError
        return word

    return parse


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    word = text.lower()
    if word not in _TRUE + _FALSE:
        raise ValueError
    return word in _TRUE


def _seconds(text: str) -> float:
    value = float(text)  # ValueError for anything but a number
    if not (math.isfinite(value) and value > 0):
        raise ValueError
    return value


def _path(text: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(text)))


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], object]
    default: object
    accepts: str  # what the error message and the docs table say it takes
    meaning: str


VARIABLES = {
    v.name: v
    for v in (
        Variable("ATTN_PROLOGUE_CACHE", _path, None, "a directory (made absolute)",
                 "the kernel cache (default `$XDG_CACHE_HOME/attn_prologue/kernels`, else "
                 "`~/.cache/attn_prologue/kernels`); the native parts and the self-test records live in it"),
        Variable("ATTN_PROLOGUE_CACHE_TRUST", _choice("own", "shared"), "own", "`own` or `shared`",
                 "whose cache is loaded: `own` only yours; `shared` also a read-only cache owned by someone "
                 "else (README, \"The kernel cache and what it trusts\")"),
        Variable("ATTN_PROLOGUE_LOCK_TIMEOUT", _seconds, 900.0, "seconds, finite and > 0",
                 "how long a build waits for another process's lock on the same cache entry"),
        Variable("ATTN_PROLOGUE_NATIVE", _flag, True, "`1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`",
                 "the native fast path and the C++ torch-op kernels (off: the Python paths serve)"),
        Variable("ATTN_PROLOGUE_SELFTEST", _choice("auto", "always", "off"), "auto",
                 "`auto`, `always` or `off`",
                 "the first-use self-test: `auto` tests modules with a distinct portable fallback, `always` "
                 "every module (on itself where it has none), `off` none"),
        Variable("ATTN_PROLOGUE_SELFTEST_FAULT", _flag, False, "a flag, as `ATTN_PROLOGUE_NATIVE`",
                 "corrupt one byte of each self-test's output (to see the fallback work); outcomes under "
                 "it are never recorded"),
        Variable("ATTN_PROLOGUE_TUNING_DB", _path, None, "a file (made absolute)",
                 "the tuning database `tune` merges into and the dispatcher reads (default: the shipped "
                 "one); naming a file that does not exist is a warning, and the dispatcher then reads the "
                 "shipped one"),
        Variable("ATTN_PROLOGUE_SOURCE", str, "", "`<40-hex commit>` or `<commit>+dirty`",
                 "the lab's provenance of a copied tree without git (anything else is ignored)"),
    )
}  # fmt: skip


def get(name: str):
    """The typed value of variable `name` (its default when unset or empty)."""
    raw = os.environ.get(name, "").strip()
    return _parsed(name, raw) if raw else VARIABLES[name].default


@functools.lru_cache(maxsize=64)
def _parsed(name: str, raw: str):
    var = VARIABLES[name]
    try:
        return var.parse(raw)
    except ValueError:
        raise EnvironmentVariableError(f"{name}={raw!r} is not valid: it takes {var.accepts}") from None
