"""The enumeration of the variant space: every combination of the axes that `unsupported_reason`
accepts is generated. The axes, names and the predicate are data in attn_prologue.variants, which
the serving path imports too."""

from __future__ import annotations

from attn_prologue.variants import Variant, all_combinations, unsupported_reason


def variant_space() -> list[Variant]:
    """Every supported variant, sorted by name."""
    return sorted((v for v in all_combinations() if unsupported_reason(v) is None), key=lambda v: v.name)


def dropped_combinations() -> list[tuple[Variant, str]]:
    """Every combination that is not generated, with the reason."""
    return [(v, why) for v in all_combinations() if (why := unsupported_reason(v)) is not None]
