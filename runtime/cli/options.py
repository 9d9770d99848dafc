"""What the command line's options accept: the parser class (a mistyped choice gets "did you mean"),
the help layout (every option shows its default), and the value types that refuse out-of-range
numbers and unknown names while parsing, before any command runs. Nothing here imports torch."""

from __future__ import annotations

import argparse
import difflib
import re

from ..errors import UnsupportedError, did_you_mean
from ..parity import Numerics
from ..presets import get_preset
from ..variants import CAPABILITIES, NAME, TARGETS, generated, not_generated, parse_name


class Parser(argparse.ArgumentParser):
    """argparse whose invalid-choice message (a command, a shape set, a device) names the closest."""

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            known = ", ".join(map(str, action.choices))
            hint = did_you_mean(str(value), action.choices)
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint} (choose from {known})")


def version_text() -> str:
    """The package's version and those of what it builds and runs with, read from the installed
    distributions' metadata (nothing imported)."""
    import importlib.metadata
    import platform

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    parts = ", ".join(f"{n} {version(n)}" for n in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "torch"))
    return f"attn-prologue {version('attn-prologue')} ({parts}; Python {platform.python_version()})"


class VersionAction(argparse.Action):
    """`--version`: print version_text() and exit, before a command is asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says what it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def _typed(name: str, parse):
    """A type= function whose ValueError or UnsupportedError reads as argparse's own error."""

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, UnsupportedError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def count(minimum: int = 1):
    """A whole number >= minimum."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"not a whole number: {text!r}") from None
        if n < minimum:
            raise ValueError(f"must be >= {minimum}, not {n}")
        return n

    return _typed(f"int >= {minimum}", parse)


def number(low: float, high: float | None = None):
    """A number > low (and <= high)."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise ValueError(f"not a number: {text!r}") from None
        if not (x > low and (high is None or x <= high)):
            raise ValueError(
                f"must be in ({low:g}, {high:g}], not {x:g}"
                if high is not None
                else f"must be > {low:g}, not {x:g}"
            )
        return x

    return _typed("number", parse)


def counts(minimum: int = 1):
    """Comma-separated whole numbers >= minimum."""
    one = count(minimum)
    return _typed("list of int", lambda text: [one(t) for t in text.split(",")])


# GPU names a target may be given as (matched without regard to case), each its compute capability
GPU_ALIASES: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("h100", "h200", "h800", "h20", "gh200"), (9, 0)),
    **dict.fromkeys(("b200", "gb200"), (10, 0)),
    **dict.fromkeys(("b300", "gb300"), (10, 3)),
    "thor": (11, 0),
    **dict.fromkeys(("rtx5090", "rtx5080", "rtx5070", "rtx-pro-6000"), (12, 0)),
    **dict.fromkeys(("gb10", "dgx-spark"), (12, 1)),
}


def check_targets(targets) -> tuple[str, ...]:
    """The targets (a GPU name of GPU_ALIASES stands for its target), or an UnsupportedError naming the
    valid ones: the target of a supported capability spelled another way (sm_90, sm_121a), that a
    capability has no kernels (sm_89), or the closest name."""
    out = []
    for t in targets:
        if t.lower() in GPU_ALIASES:
            out.append(CAPABILITIES[GPU_ALIASES[t.lower()]][1])
            continue
        if t not in TARGETS:
            valid = f"targets: {', '.join(TARGETS)} (or a GPU name: {', '.join(GPU_ALIASES)})"
            m = re.fullmatch(r"(?:sm|compute)_?(\d+)(\d)[af]?", t.lower())
            # (a "capability" below 3.0 is a typo, e.g. sm_12a, not a GPU)
            capability = (int(m.group(1)), int(m.group(2))) if m and int(m.group(1)) >= 3 else None
            if capability in CAPABILITIES:
                raise UnsupportedError(
                    f"unknown target {t!r} (did you mean {CAPABILITIES[capability][1]}?); {valid}"
                )
            if capability is not None:
                known = ", ".join(f"{a}.{b} ({tt})" for (a, b), (_, tt) in sorted(CAPABILITIES.items()))
                raise UnsupportedError(
                    f"{t!r}: compute capability {capability[0]}.{capability[1]} is not supported (no kernels "
                    f"run there); supported: {known}"
                )
            hint = did_you_mean(t.lower(), [*TARGETS, *GPU_ALIASES])
            raise UnsupportedError(f"unknown target {t!r}{hint}; {valid}")
        out.append(t)
    return tuple(out)


def _targets(text: str) -> set[str]:
    return set(check_targets(text.split(",")))


def _config_keys(text: str) -> list:
    from ..launch import LaunchConfig

    return [LaunchConfig.from_key(k) for k in text.split(",")]


def _variant_pattern(text: str) -> str:
    """A variant name or name prefix that some generated variant has."""
    if not any(n.startswith(text) for n in generated()):
        raise ValueError(f"no generated variant matches it: {explain_name(text)}")
    return text


def _bench_change(text: str) -> tuple[str, object]:
    """`bench --also`: lean_quant, defaults_only, row_split=K, or numerics=SPEC (SPEC is parsed by the
    format it meets)."""
    if text in ("lean_quant", "defaults_only"):
        return (text, True)
    name, eq, spec = text.partition("=")
    if name == "numerics" and eq and spec:
        return ("numerics", spec)
    if name == "row_split" and spec in ("2", "4"):
        return ("row_split", int(spec))
    raise ValueError(
        f"not a bench change: {text!r} (lean_quant, defaults_only, row_split=2 or 4, or numerics=SPEC such"
        " as numerics=preset=vllm)"
    )


def _numerics_spec(text: str) -> str:
    """A parity-choice spelling whose fields, values and preset exist (NumericsError naming the
    closest otherwise); the spelling itself is what the build takes."""
    numerics = Numerics.parse(text)
    if numerics.preset is not None:
        get_preset(numerics.preset)
    return text


def device_name(text: str) -> str:
    """A --device value: "gpu" is what a user means by "cuda", and case does not matter."""
    word = text.strip().lower()
    return "cuda" if word == "gpu" else word


targets = _typed("targets", _targets)
numerics_spec = _typed("numerics", _numerics_spec)
bench_change = _typed("bench change", _bench_change)
config_keys = _typed("config keys", _config_keys)
variant_pattern = _typed("variant", _variant_pattern)


def matches(name: str, patterns) -> bool:
    """Does a variant name equal or start with one of the patterns (every name, without patterns)?"""
    return not patterns or any(name.startswith(p) for p in patterns)


def explain_name(name: str) -> str:
    """What is wrong with a variant name (or name prefix) a user typed that matches nothing: the
    reason and nearest generated variants for a well-formed name, else the closest names or prefixes."""
    if NAME.fullmatch(name + "_sm90"):  # a whole name but the arch: answered without naming one
        return not_generated(parse_name(name + "_sm90"), with_arch=False)
    if NAME.fullmatch(name) is None:
        return f"{name!r} is not a variant name or prefix" + "".join(
            f"; closest generated: {', '.join(close)}" for close in [_closest_prefixes(name)] if close
        )
    try:
        return not_generated(parse_name(name))
    except UnsupportedError as exc:  # a non-canonical spelling: the message names the canonical one
        return str(exc)


def _closest_prefixes(typed: str, count: int = 3) -> list[str]:
    """Generated names whose start is most like `typed`, each cut at the end of the axis it reaches."""
    scored = {}
    for n in {n if "_sm" in typed else parse_name(n).stem for n in generated()}:  # no arch not asked for
        end = n.find("_", len(typed))
        cut = n if end < 0 else n[:end]
        start, whole = (difflib.SequenceMatcher(None, typed, s).ratio() for s in (n[: len(typed)], cut))
        scored[cut] = max((start, whole), scored.get(cut, (0.0, 0.0)))
    best = sorted(scored.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
    return [cut for cut, (start, _) in best[:count] if start >= 0.6]
