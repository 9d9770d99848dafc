"""Tuning database and the per-arch heuristic the dispatcher falls back to.

A database is JSON: {"format": 1, "entries": [...]}; each entry is keyed by the GPU (name, SM
count, compute capability, driver), the package and DSL versions, the variant, a token-count
bucket (powers of two) and the Q head counts it was tuned at (H live heads, P heads written: the
tuner writes the pad heads), and holds the best launch-config key with its timing. A call uses the
entry tuned at its (H, heads written), else the nearest one: the KV rows' share of the work and
the share of pad zeroing change which config wins. Loading checks the metadata against the running
environment: a mismatch is reported and ignored unless forced; a corrupt file is reported and
ignored. Runs merge into one file.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .jit import compiler
from .launch import LaunchConfig

ENV_DB = "ATTN_PROLOGUE_TUNING_DB"
DB_FORMAT = 1
MATCH_FIELDS = ("gpu", "sms", "capability", "package", "dsl")
DEFAULT_HEADS = 64  # entries that do not say


class TuningDatabaseWarning(UserWarning):
    pass


def bucket_of(n_tokens: int) -> int:
    """The power of two >= n_tokens (1 for 0): token counts share the entry of their bucket."""
    b = 1
    while b < n_tokens:
        b *= 2
    return b


def default_buckets(max_tokens: int = 32768) -> list[int]:
    return [1 << i for i in range(max_tokens.bit_length()) if (1 << i) <= max_tokens]


@dataclass(frozen=True)
class Environment:
    gpu: str
    sms: int
    capability: str
    driver: str
    package: str
    dsl: str

    def as_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "sms": self.sms,
            "capability": self.capability,
            "driver": self.driver,
            "package": self.package,
            "dsl": self.dsl,
        }


def environment_for(gpu: str, sms: int, capability: tuple[int, int], driver: str = "") -> Environment:
    """The environment entries are matched against, for a device described by name, SMs and capability."""
    return Environment(
        gpu=gpu,
        sms=sms,
        capability=f"{capability[0]}.{capability[1]}",
        driver=driver,
        package=importlib.metadata.version("attn-prologue"),
        dsl=compiler.dsl_fingerprint(),
    )


def current_environment(device=None) -> Environment:
    """The environment of a CUDA device (the current one by default), driver version included."""
    import torch

    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    try:
        driver = str(torch._C._cuda_getDriverVersion())
    except Exception:  # informational only: not part of the match
        driver = ""
    return environment_for(props.name, props.multi_processor_count, (props.major, props.minor), driver)


class TuningDatabase:
    def __init__(self, entries: list[dict] | None = None, path: Path | None = None):
        self.entries = entries or []
        self.path = path

    # ---- persistence -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path) -> TuningDatabase:
        """Read a database; a missing file is empty, a corrupt one is reported and treated as empty."""
        path = Path(path)
        if not path.exists():
            return cls([], path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != DB_FORMAT or not isinstance(data.get("entries"), list):
                raise ValueError(f"unknown format {data.get('format')!r}")
            for e in data["entries"]:
                LaunchConfig.from_key(e["config"])
                int(e["bucket"])
                str(e["variant"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            warnings.warn(f"tuning database {path} is corrupt and was ignored: {exc}", TuningDatabaseWarning)
            return cls([], path)
        return cls(data["entries"], path)

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = sorted(self.entries, key=lambda e: (e["gpu"], e["variant"], e["bucket"]))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": DB_FORMAT, "entries": entries}, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    def merge(self, new_entries: list[dict]) -> None:
        """New entries replace old ones with the same environment, variant, bucket and head counts."""

        def ident(e):
            return tuple(e.get(f) for f in MATCH_FIELDS) + (
                e["variant"],
                e["bucket"],
                e.get("heads", DEFAULT_HEADS),
                e.get("padded_heads", e.get("heads", DEFAULT_HEADS)),
            )

        index = {ident(e): i for i, e in enumerate(self.entries)}
        for e in new_entries:
            i = index.get(ident(e))
            if i is None:
                index[ident(e)] = len(self.entries)
                self.entries.append(e)
            else:
                self.entries[i] = e

    # ---- lookup ---------------------------------------------------------------------------------
    def table_for(
        self, env: Environment, *, force: bool = False
    ) -> dict[tuple[str, int], dict[tuple[int, int], LaunchConfig]]:
        """(variant, bucket) -> {(heads, heads written): config} for this environment. Entries for
        another GPU, SM count, capability, package or DSL version are reported once and ignored
        unless force=True."""
        table, mismatched = {}, set()
        want = env.as_dict()
        for e in self.entries:
            diff = [f for f in MATCH_FIELDS if e.get(f) != want[f]]
            if diff and not force:
                mismatched.add((e.get("gpu"), tuple(diff)))
                continue
            heads = int(e.get("heads", DEFAULT_HEADS))
            shape = (heads, int(e.get("padded_heads", heads)))
            table.setdefault((e["variant"], int(e["bucket"])), {})[shape] = LaunchConfig.from_key(e["config"])
        if mismatched and not table:
            warnings.warn(
                f"tuning database {self.path}: no entry matches this environment ({want['gpu']}, "
                f"{want['sms']} SMs, sm {want['capability']}); differing fields: "
                f"{sorted({f for _, d in mismatched for f in d})}; using the heuristic (force=True to use it anyway)",
                TuningDatabaseWarning,
            )
        return table


def pick(
    tuned: dict[tuple[int, int], LaunchConfig] | None, heads: int | None, written: int | None = None
) -> LaunchConfig | None:
    """The config tuned at (heads, written) Q heads, else the nearest tuned pair (sum of the log2
    ratios; a tie takes the larger counts); the largest when heads is None (ops without Q). None
    without entries. `written` defaults to heads (pads not written)."""
    if not tuned:
        return None
    if heads is None:
        return tuned[max(tuned)]
    want = (heads, written or heads)

    def distance(shape):
        return sum(abs(math.log2(a / b)) for a, b in zip(shape, want))

    return tuned[min(tuned, key=lambda shape: (distance(shape), -shape[1], -shape[0]))]


def shipped_database_path() -> Path:
    return Path(str(resources.files("attn_prologue") / "data" / "tuning_h200.json"))


def database_path() -> Path:
    env = os.environ.get(ENV_DB)
    return Path(env) if env else shipped_database_path()
