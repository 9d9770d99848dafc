"""Tuning database and the per-arch heuristic the dispatcher falls back to.

A database is JSON: {"format": 1, "entries": [...]}; each entry is keyed by the GPU (name, SM
count, compute capability, driver), the package and DSL versions, the variant, a token-count
bucket (powers of two), the Q head counts it was tuned at (H live heads, P heads written: the
tuner writes the pad heads) and the compress ratio of the calls it timed (1 where the entry does not
say), and holds the best launch-config key with its timing. A call uses the entries of its compress
ratio, else those of ratio 1 (a compressed writer inserts one row in r, which changes which config
wins); among them, the entry tuned at its (H, heads written), else the nearest one: the KV rows'
share of the work and the share of pad zeroing change which config wins. An entry whose config folds a
call's numerics bits (`_n<bits>`: index_q's engine presets, `tune --numerics`) serves the calls with exactly
those bits, ahead of the entries that serve every call. Loading checks the metadata against the running
environment: a mismatch is reported and ignored unless forced; a corrupt file is reported and
ignored. Runs merge into one file.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from filelock import FileLock

from . import env
from .errors import UnsupportedError
from .jit import compiler
from .jit.trusted_fs import read_regular
from .launch import LaunchConfig
from .variants import parse_name

ENV_DB = "ATTN_PROLOGUE_TUNING_DB"
DB_FORMAT = 1
MATCH_FIELDS = ("gpu", "sms", "capability", "package", "dsl")
DEFAULT_HEADS = 64  # entries that do not say
MAX_DB_BYTES = 16 << 20  # the shipped database is ~60 KB; a bigger file is not a database
MAX_ENTRIES = 100_000
_CAPABILITY = re.compile(r"\d{1,2}\.\d{1,2}")


class TuningDatabaseWarning(UserWarning):
    pass


log = logging.getLogger("attn_prologue.tuning")
_NOTED: set[str] = set()


def entry_shape(e: dict) -> tuple[int, int, int]:
    """(heads, heads written, compress ratio) an entry was tuned at; older entries leave out what
    was then the only value (64 heads, written as many, ratio 1)."""
    heads = int(e.get("heads", DEFAULT_HEADS))
    return heads, int(e.get("padded_heads", heads)), int(e.get("compress_ratio", 1))


def entry_numerics(e: dict) -> int | None:
    """The numerics bits an entry was tuned for: those its config folds (`tune --numerics PRESET`); None for
    an entry that serves every call (folded to each call's bits where its op folds them)."""
    bits = LaunchConfig.from_key(e["config"]).folded_numerics
    return bits if bits >= 0 else None


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
        """Read a database. A missing file is empty; a file that is not a regular file, too large, or
        not a database is reported and treated as empty; an entry that does not validate is reported
        and skipped, and the others are used."""
        path = Path(path)
        try:
            text = read_regular(path, MAX_DB_BYTES)
        except FileNotFoundError:
            return cls([], path)
        except (OSError, ValueError) as exc:
            warnings.warn(f"tuning database {path} was ignored: {exc}", TuningDatabaseWarning)
            return cls([], path)
        try:
            data = json.loads(text, parse_constant=_no_constants)
            if (
                not isinstance(data, dict)
                or data.get("format") != DB_FORMAT
                or not isinstance(data.get("entries"), list)
            ):
                raise ValueError(
                    f"unknown format {data.get('format') if isinstance(data, dict) else type(data).__name__!r}"
                )
        except (ValueError, RecursionError) as exc:
            warnings.warn(f"tuning database {path} is corrupt and was ignored: {exc}", TuningDatabaseWarning)
            return cls([], path)
        entries, bad = [], []
        for i, e in enumerate(data["entries"][:MAX_ENTRIES]):
            why = entry_problem(e)
            if why is None:
                entries.append(e)
            else:
                bad.append(f"entry {i}: {why}")
        if len(data["entries"]) > MAX_ENTRIES:
            bad.append(f"{len(data['entries']) - MAX_ENTRIES} entries past the first {MAX_ENTRIES}")
        if bad:
            shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
            warnings.warn(
                f"tuning database {path}: skipped {len(bad)} invalid entries, using the other {len(entries)} ({shown})",
                TuningDatabaseWarning,
            )
        return cls(entries, path)

    def save(self, path: Path | None = None) -> Path:
        """Write the database atomically (a unique temporary file, then a rename): a reader sees the
        old file or the new one, never part of one."""
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = sorted(self.entries, key=lambda e: (e["gpu"], e["variant"], e["bucket"]))
        text = json.dumps({"format": DB_FORMAT, "entries": entries}, indent=1, sort_keys=True) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def merge_into(cls, path: Path, new_entries: list[dict], timeout: float = 120) -> TuningDatabase:
        """Load, merge and save under a file lock, so concurrent writers (two `tune` runs) each keep
        the other's entries."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=timeout):
            db = cls.load(path)
            db.merge(new_entries)
            db.save(path)
        return db

    def merge(self, new_entries: list[dict]) -> None:
        """New entries replace old ones with the same environment, variant, bucket and head counts."""

        def ident(e):
            return (
                *(e.get(f) for f in MATCH_FIELDS),
                e["variant"],
                e["bucket"],
                *entry_shape(e),
                entry_numerics(e),
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
    ) -> dict[tuple[str, int], dict[tuple[int, int, int], LaunchConfig]]:
        """(variant, bucket) -> {(heads, heads written, compress ratio): config} for this environment, and
        (variant, bucket, bits) -> the same for the entries tuned for those numerics bits. Entries for
        another GPU, SM count, capability, package or DSL version are reported once and ignored
        unless force=True."""
        table, mismatched = {}, set()
        want = env.as_dict()
        for e in self.entries:
            diff = [f for f in MATCH_FIELDS if e.get(f) != want[f]]
            if diff and not force:
                mismatched.add((e.get("gpu"), tuple(diff)))
                continue
            shape = entry_shape(e)  # (validated on load: positive ints)
            bits = entry_numerics(e)
            key = (e["variant"], int(e["bucket"])) + (() if bits is None else (bits,))
            table.setdefault(key, {})[shape] = LaunchConfig.from_key(e["config"])
        if mismatched and not table:
            note = (
                f"tuning database {self.path}: no entry matches this GPU ({want['gpu']}, {want['sms']} SMs, "
                f"sm {want['capability']}; differing fields: {sorted({f for _, d in mismatched for f in d})}): "
                "using the arch's default launch configs (`python -m attn_prologue tune` makes entries for it)"
            )
            if note not in _NOTED:  # informational, once per process: an untuned GPU is not a fault
                _NOTED.add(note)
                log.info(note)
        return table


def entry_problem(e) -> str | None:
    """Why an entry cannot be used (None: it can)."""
    if not isinstance(e, dict):
        return f"not an object ({type(e).__name__})"
    for field, kind in (
        ("gpu", str),
        ("variant", str),
        ("config", str),
        ("capability", str),
        ("package", str),
        ("dsl", str),
    ):
        if not isinstance(e.get(field), kind):
            return f"{field} must be a string, got {e.get(field)!r}"
    for field in ("bucket", "sms", "heads", "padded_heads", "compress_ratio"):
        # head counts and the compress ratio may be absent
        value = e.get(field, 1 if field in ("heads", "padded_heads", "compress_ratio") else None)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= 1 << 20:
            return f"{field} must be a positive integer, got {value!r}"
    if e.get("bucket") & (e.get("bucket") - 1):
        return f"bucket must be a power of two, got {e['bucket']}"
    if not _CAPABILITY.fullmatch(e["capability"]):
        return f"capability must look like 9.0, got {e['capability']!r}"
    try:
        config = LaunchConfig.from_key(e["config"])
        if config.row_split == 1 and not config.q_lanes:
            return None
        return parse_name(e["variant"]).refusal(config)  # a module compiled with it would refuse the config
    except (ValueError, UnsupportedError) as exc:
        return str(exc)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a valid number in a tuning database")


def pick(
    tuned: dict[tuple[int, int, int], LaunchConfig] | None,
    heads: int | None,
    written: int | None = None,
    compress_ratio: int = 1,
) -> LaunchConfig | None:
    """Among the entries of this compress ratio (else of ratio 1), the config tuned at (heads,
    written) Q heads, else the nearest tuned pair (sum of the log2 ratios; a tie takes the larger
    counts); the largest when heads is None (ops without Q). None without such entries. `written`
    defaults to heads (pads not written)."""
    for ratio in (compress_ratio, 1):
        same = {shape[:2]: c for shape, c in (tuned or {}).items() if shape[2] == ratio}
        if same:
            return _nearest_heads(same, heads, written)
    return None


def _nearest_heads(
    tuned: dict[tuple[int, int], LaunchConfig], heads: int | None, written: int | None
) -> LaunchConfig:
    if heads is None:
        return tuned[max(tuned)]
    want = (heads, written or heads)

    def distance(shape):
        return sum(abs(math.log2(a / b)) for a, b in zip(shape, want))

    return tuned[min(tuned, key=lambda shape: (distance(shape), -shape[1], -shape[0]))]


def shipped_database_path() -> Path:
    return Path(str(resources.files("attn_prologue") / "data" / "tuning.json"))


def database_path() -> Path:
    """Where `tune` merges its entries: $ATTN_PROLOGUE_TUNING_DB (made on first write), else the
    shipped database."""
    return env.get(ENV_DB) or shipped_database_path()


def database_to_read() -> Path:
    """The database the dispatcher and `build` read: $ATTN_PROLOGUE_TUNING_DB, else the shipped one.
    A named file that does not exist is most likely a typo: reported once, and the shipped one read."""
    named = env.get(ENV_DB)
    if named is None or named.exists():
        return database_path()
    note = f"{ENV_DB}={named} does not exist: reading the shipped tuning database instead"
    if note not in _NOTED:
        _NOTED.add(note)
        warnings.warn(note, TuningDatabaseWarning)
    return shipped_database_path()
