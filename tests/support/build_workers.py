"""Process entry points for tests/test_kernel_cache.py (importable by multiprocessing's spawn start method)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def _is_ours(w: warnings.WarningMessage) -> bool:
    package_dir = Path(__import__("attn_prologue").__file__).parent
    return w.category.__module__.startswith("attn_prologue") or Path(w.filename).is_relative_to(package_dir)


def build_entry(root: str, variant: str, config: str, target: str, barrier, queue) -> None:
    """Build one kernel-cache entry as soon as the other process is ready too; report what happened."""
    import cutlass.cute  # noqa: F401  (pay the DSL import before the barrier: both builders start together)
    from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
    from attn_prologue.launch import LaunchConfig

    cache = KernelCache(Path(root))
    key = KernelKey(variant, LaunchConfig.from_key(config), target)
    key.relpath()  # hash the sources before the race, too
    barrier.wait(timeout=300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = cache.ensure_built(key)
    queue.put(
        {
            "pid": os.getpid(),
            "compiles": cache.compiles,
            "built_by_pid": meta["built_by_pid"],
            "so_sha256": meta["so_sha256"],
            # only warnings this package raises count: torch or the DSL may warn about their own setup
            "warnings": [str(w.message) for w in caught if _is_ours(w)],
        }
    )
