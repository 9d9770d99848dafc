"""A launcher: one compiled kernel bound to a device, calling it in its own argument order.

Every caller (the one-call functions, bound ops, the torch ops, the self-test, bench, tune and the
tools) calls a kernel through a Launcher. The argument order comes from the variant
(`Variant.arguments`, which the template renders as the module's signature), never from the caller:
by name (`launcher(**values)`), or, on hot paths, as a positional call whose leading names the
launcher checks once (`tail`) and whose remaining arguments it orders once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .launch import LaunchConfig
from .variants import Variant


@dataclass(frozen=True)
class Launcher:
    variant: Variant
    config: LaunchConfig
    target: str
    device_index: int
    fn: Callable = field(repr=False, compare=False)  # the loaded TVM-FFI function
    sm_count: int = field(compare=False)

    @property
    def arguments(self) -> tuple[str, ...]:
        return self.variant.arguments

    @property
    def max_ctas(self) -> int:
        """Grid cap of persistent configs: CTAs per SM x this device's SMs (0: uncapped)."""
        return self.config.ctas_per_sm * self.sm_count

    def order(self, values: dict) -> tuple:
        """Every argument by name, in the compiled order. Defaults: max_ctas this device's cap, numerics
        the cache format's parity choices, the full op's modes (both Q steps, every row inserted)."""
        defaults = {"max_ctas": self.max_ctas, "numerics": self.variant.default_numerics}
        defaults.update((k, v) for k, v in (("q_flags", 0), ("compress_ratio", 1)) if k in self.arguments)
        values = {**defaults, **values}
        missing = [a for a in self.arguments if a not in values]
        extra = sorted(set(values) - set(self.arguments))
        if missing or extra:
            raise TypeError(
                f"{self.variant.name} takes {', '.join(self.arguments)}; missing {missing}, unexpected {extra}"
            )
        return tuple(values[a] for a in self.arguments)

    def __call__(self, **values) -> None:
        """Launch with arguments by name (on the current torch stream)."""
        self.fn(*self.order(values))

    def tail(self, leading: tuple[str, ...], **values) -> tuple:
        """The arguments after `leading`, in order, for a hot-path call `fn(*leading_values, *tail)`.
        `leading` must be the start of the argument list: checked here, once, not per call."""
        if self.arguments[: len(leading)] != leading:
            raise TypeError(
                f"{self.variant.name}: arguments start {self.arguments[: len(leading)]}, not {leading}"
            )
        full = self.order({**dict.fromkeys(leading), **values})
        return full[len(leading) :]

    def __repr__(self) -> str:
        return f"Launcher({self.variant.name}, {self.config.key}, {self.target}, cuda:{self.device_index})"
