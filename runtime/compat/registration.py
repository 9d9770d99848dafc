"""Registering ops under another library's namespace, safely (compat.vllm's `register`).

- Names: the namespace and the op names must be identifiers (what a schema parses), the namespace
  none of torch's own or ours, and the namespace one a library has already defined unless the
  caller says it is new: a library that loads later and defines the same names fails on them.
- Ownership: the schema we define for a name (and the fake implementation we add to it) lives in a
  library shared by every registration of that name and is dropped when the last one closes; each
  registration's CPU and CUDA kernels live in a library of its own. Closing one registration gives
  the kernels of the one before it back and leaves the op defined for the others.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import RegistrationError
from ..torch_op import NAMESPACE

# torch's own namespaces (those `import torch` and torch.compile define in torch 2.13, listed by
# torch._C._dispatch_get_all_op_names()) and ours: never registered into, override or not
RESERVED_NAMESPACES = frozenset({
    "aten", "prim", "prims", "quantized", "_quantized", "sparse", "mkldnn", "mkldnn_prepacked", "mkl", "onednn",
    "inductor", "inductor_prims", "rngprims", "debugprims", "higher_order", "profiler", "quantization",
    "static_runtime", "symm_mem", "export", "c10d", "c10d_functional", "_c10d_functional",
    "_c10d_functional_autograd", "_dtensor", "_native", "_test", "streams", "fsdp", "onnx", NAMESPACE,
})  # fmt: skip
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # what a schema parses as a namespace or an op name


def check_names(namespace, names: tuple, *, new_namespace: bool) -> None:
    """RegistrationError unless the names can be registered (module docstring, "Names")."""
    for what, name in (("namespace", namespace), *(("op name", n) for n in names)):
        if not isinstance(name, str) or not IDENTIFIER.match(name):
            raise RegistrationError(f"the {what} must be an identifier (letters, digits, _), got {name!r}")
    if len(set(names)) != len(names):
        raise RegistrationError(f"the op names must differ, got {', '.join(names)}")
    if namespace in RESERVED_NAMESPACES:
        raise RegistrationError(
            f"{namespace!r} is a namespace of torch's or attn_prologue's own ops: use the engine's"
        )
    if not new_namespace and not defined(namespace):
        raise RegistrationError(
            f"no library has defined namespace {namespace!r} yet: register after the engine's own library "
            "has loaded (e.g. `import vllm._C` first: one loading later fails to define the same names), "
            "or pass new_namespace=True for a namespace of your own"
        )


def defined(namespace: str) -> bool:
    """Whether any op is defined in the namespace."""
    return any(n.startswith(f"{namespace}::") for n in torch._C._dispatch_get_all_op_names())


def existing_schema(namespace: str, name: str):
    try:
        return getattr(getattr(torch.ops, namespace), name).default._schema
    except (AttributeError, RuntimeError):
        return None


def signature(schema) -> tuple:
    """What a positional call depends on: argument types and which are written, and the returns."""
    return (
        tuple((str(a.type), bool(a.alias_info and a.alias_info.is_write)) for a in schema.arguments),
        tuple(str(r.type) for r in schema.returns),
    )


@dataclass
class _Definition:
    """What the registrations of one op share: the library holding our schema (where no engine defined
    it) and our fake implementation (where it had none), and how many registrations use it."""

    library: torch.library.Library
    users: int = 0


_DEFINITIONS: dict[str, _Definition] = {}  # "namespace::name" -> its _Definition


class Registration:
    """One register() call's ops: add() each, close() once."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._kernels = self._library()
        self._defined: list[str] = []  # the _DEFINITIONS entries this registration uses

    def _library(self) -> torch.library.Library:
        try:
            return torch.library.Library(self.namespace, "FRAGMENT")
        except (RuntimeError, ValueError) as exc:
            raise RegistrationError(
                f"cannot register ops under namespace {self.namespace!r}: {exc}"
            ) from None

    def add(
        self, name: str, schema: str, kernels: dict[str, Callable], fake: Callable, *, override: bool
    ) -> None:
        """Define `name` in `schema` (or, with override, run ours behind the existing same-typed one) with
        these per-dispatch-key kernels and, unless it has one, the fake implementation."""
        ns, qualified = self.namespace, f"{self.namespace}::{name}"
        ours = torch._C.parse_schema(f"{qualified}{schema}")
        theirs = existing_schema(ns, name)
        if theirs is not None and not override:
            raise RegistrationError(
                f"{qualified} is already defined ({theirs}); pass override=True to run ours behind it"
            )
        if theirs is not None and signature(theirs) != signature(ours):
            raise RegistrationError(
                f"{qualified} is already defined with another schema: {theirs}; ours is {ours} "
                "(register another form, or under another namespace)"
            )
        shared = _DEFINITIONS.get(qualified)
        if shared is None:
            shared = _Definition(self._library())
            if theirs is None:
                shared.library.define(f"{name}{schema}")
            try:
                torch.library.register_fake(qualified, fake, lib=shared.library)
            except RuntimeError:  # the engine's op has a fake implementation already
                if theirs is None:
                    shared.library._destroy()
                    raise
            _DEFINITIONS[qualified] = shared
        shared.users += 1
        self._defined.append(qualified)
        self.add_kernels(name, kernels)

    def add_kernels(self, name: str, kernels: dict[str, Callable]) -> None:
        """Register these per-dispatch-key kernels of an op add() defined."""
        for key, kernel in kernels.items():
            self._kernels.impl(name, kernel, key)

    def close(self) -> None:
        """Unregister our kernels; drop a definition no other registration uses. Idempotent."""
        if self._kernels is not None:
            self._kernels._destroy()
            self._kernels = None
        for qualified in self._defined:
            shared = _DEFINITIONS[qualified]
            shared.users -= 1
            if shared.users == 0:
                shared.library._destroy()
                del _DEFINITIONS[qualified]
        self._defined.clear()
