"""Every ATTN_PROLOGUE_* environment variable, parsed in one place: its type, accepted values and default.

A variable is read where it is first needed, never at import, so a bad value never makes
`import attn_prologue` fail: it is an `EnvironmentVariableError` (naming the variable, the value and
what it accepts) from the first call that needs it. Each distinct value is parsed once. Values are
matched without regard to case or surrounding blanks; an empty value is the default.
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
    accepts: str  # what the error message and docs/environment.md say it takes


# what each one does: docs/environment.md
VARIABLES = {
    v.name: v
    for v in (
        Variable("ATTN_PROLOGUE_CACHE", _path, None, "a directory (made absolute)"),
        Variable("ATTN_PROLOGUE_CACHE_TRUST", _choice("own", "shared"), "own", "`own` or `shared`"),
        Variable("ATTN_PROLOGUE_LOCK_TIMEOUT", _seconds, 900.0, "seconds, finite and > 0"),
        Variable("ATTN_PROLOGUE_NATIVE", _flag, True, "`1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`"),
        Variable("ATTN_PROLOGUE_ENGINE_PLUGINS", _flag, True, "a flag, as `ATTN_PROLOGUE_NATIVE`"),
        Variable(
            "ATTN_PROLOGUE_SELFTEST", _choice("auto", "always", "off"), "auto", "`auto`, `always` or `off`"
        ),
        Variable("ATTN_PROLOGUE_SELFTEST_FAULT", _flag, False, "a flag, as `ATTN_PROLOGUE_NATIVE`"),
        Variable("ATTN_PROLOGUE_TUNING_DB", _path, None, "a file (made absolute)"),
        Variable("ATTN_PROLOGUE_SOURCE", str, "", "`<40-hex commit>` or `<commit>+dirty`"),
        Variable("ATTN_PROLOGUE_NVDISASM", _path, None, "a file (made absolute)"),
    )
}


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
