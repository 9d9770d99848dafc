"""Typed errors. Every check on user input raises one of these before anything is written."""

import difflib


def did_you_mean(name: str, known) -> str:
    """ " (did you mean X?)" naming the closest of `known` to a mistyped name, or "" if none is close."""
    close = difflib.get_close_matches(name, [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class AttnPrologueError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedError(AttnPrologueError, NotImplementedError):
    """No generated variant covers the requested combination (the message lists what exists)."""


class InputError(AttnPrologueError, ValueError):
    """A tensor or scalar argument has the wrong dtype, shape, device, stride or alignment."""


class ScratchError(AttnPrologueError, RuntimeError):
    """The scratch pool cannot serve a request (too many tokens after locking, wrong key)."""


class RegistrationError(AttnPrologueError, RuntimeError):
    """Ops cannot be registered under the asked name: it is taken by an op of another schema, or by
    one the caller did not ask to override (attn_prologue.compat)."""
