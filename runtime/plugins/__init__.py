"""Engine plugins: our kernels behind a serving engine's own seams (docs/vllm-plugin.md, docs/sglang-plugin.md).

Each engine's plugin module names its seams (an attribute of a module or class, and the parameters
it expects there) for every engine version it was checked against, and calls `install`. That
replaces every seam or none: on an unknown version, a missing attribute or a changed signature it
logs one warning naming the seam and leaves the engine untouched. `ATTN_PROLOGUE_ENGINE_PLUGINS=0`
turns every plugin off. One log line says what was replaced.

A replacement is put in place by `setattr` unless the plugin passes `put` (SGLang's plugin hands each
one to SGLang's own HookRegistry, which applies it and rewrites stale `from X import Y` bindings).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import env
from ..compat.registration import existing_schema


@dataclass(frozen=True)
class Seam:
    """One place of an engine we replace: `module`'s attribute `path` ("Class.method" or "function"),
    expected to take exactly `parameters`; `make(original)` returns what goes there instead."""

    module: str
    path: str
    parameters: tuple[str, ...]
    make: Callable[[Callable], Callable]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"

    def resolve(self) -> tuple[object, str, Callable]:
        """(the object holding the attribute, its name, its current value); ImportError or
        AttributeError when the engine has no such thing."""
        owner = importlib.import_module(self.module)
        *outer, attr = self.path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        return owner, attr, inspect.getattr_static(owner, attr)


class Absent(LookupError):
    """The engine has not loaded this seam in this process (its CUDA extension on a machine without a
    GPU, say): the seam is skipped, which is no mismatch."""


@dataclass(frozen=True)
class OpSeam(Seam):
    """A torch op an engine's extension defines: `module` is its namespace, `path` its name,
    `parameters` its schema's argument names; `make(schema)` puts ours behind it (torch.library) and
    returns what undoes that."""

    @property
    def name(self) -> str:
        return f"torch.ops.{self.module}.{self.path}"

    def resolve(self) -> tuple[object, str, object]:
        schema = existing_schema(self.module, self.path)
        if schema is None:
            raise Absent(self.name)
        return self.module, self.path, schema


@dataclass
class Installed:
    """What one install() replaced: (owner, attribute, original) per seam, to put back."""

    engine: str
    version: str
    replaced: list[tuple[object, str, object]] = field(default_factory=list)
    seams: list[str] = field(default_factory=list)  # the Seam.name of each, in order
    undo: list[Callable[[], None]] = field(default_factory=list)  # what `put` returned, per seam

    def uninstall(self) -> None:
        """Put every original back (tests; an engine never needs it)."""
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()
        self.replaced.clear()
        self.seams.clear()


Put = Callable[[Seam, object, str, object, Callable], Callable[[], None]]


def set_attribute(seam: Seam, owner: object, attr: str, original: object, replacement: Callable):
    """The default `put`: `setattr(owner, attr, replacement)`; returns what undoes it."""
    setattr(owner, attr, replacement)
    return lambda: setattr(owner, attr, original)


def engine_version(distribution: str) -> str | None:
    """The installed version of an engine's distribution, without its local part ("0.33.0+cu130" is
    "0.33.0"), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def _parameters(value) -> tuple[str, ...]:
    if isinstance(value, torch._C.FunctionSchema):
        return tuple(a.name for a in value.arguments)
    function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    return tuple(inspect.signature(function).parameters)


def install(
    engine: str,
    version: str | None,
    seams_by_version: dict[str, tuple[Seam, ...]],
    log: logging.Logger,
    put: Put = set_attribute,
) -> Installed | None:
    """Replace every seam of `seams_by_version[version]`, or none (module docstring). Each replacement
    goes in through `put(seam, owner, attr, original, replacement)`, which returns its undo."""
    if not env.get("ATTN_PROLOGUE_ENGINE_PLUGINS"):
        log.info("attn_prologue: ATTN_PROLOGUE_ENGINE_PLUGINS is off; %s left untouched", engine)
        return None
    seams = seams_by_version.get(version or "")
    if seams is None:
        log.warning(
            "attn_prologue: %s %s is not a version this plugin was checked against (%s); %s left untouched",
            engine, version or "(not installed)", ", ".join(seams_by_version), engine,
        )  # fmt: skip
        return None
    found, absent = [], []
    for seam in seams:
        try:
            owner, attr, current = seam.resolve()
            have = _parameters(current)
        except Absent:
            absent.append(seam.name)
            continue
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            log.warning("attn_prologue: %s %s has no seam %s (%s); %s left untouched",
                        engine, version, seam.name, exc, engine)  # fmt: skip
            return None
        if have != seam.parameters:
            log.warning(
                "attn_prologue: %s %s seam %s takes (%s), expected (%s); %s left untouched",
                engine, version, seam.name, ", ".join(have), ", ".join(seam.parameters), engine,
            )  # fmt: skip
            return None
        found.append((seam, owner, attr, current))
    done = Installed(engine, version)
    for seam, owner, attr, current in found:
        undo = (
            seam.make(current)
            if isinstance(seam, OpSeam)
            else put(seam, owner, attr, current, seam.make(current))
        )
        done.undo.append(undo)
        done.replaced.append((owner, attr, current))
        done.seams.append(seam.name)
    log.info("attn_prologue: replaced in %s %s: %s%s", engine, version, ", ".join(done.seams),
             f"; not loaded in this process, left: {', '.join(absent)}" if absent else "")  # fmt: skip
    return done
