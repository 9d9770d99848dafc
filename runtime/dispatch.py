"""The dispatcher: one object holds the serving path's process state and resolves every request.

A request (op, head dims, cache format, dtype, Q output) on a device resolves once to a variant
(`variants.find` over the generated registry, after the first-use self-test where the variant has a
distinct fallback) and, per token-count bucket, to a launch config (the tuning database entry
tuned at these head counts or the nearest, else the arch default). `Runtime.launchers` returns the
bound `Launcher` of every bucket. Kernel cache, tuning table, error counters, per-device facts,
self-test outcomes and launchers all live here: tests build their own `Runtime` instead of
patching module globals; `default_runtime()` is the process-wide one.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import selftest, tuning
from .errors import AttnPrologueError, InputError, UnsupportedError
from .jit.kernel_cache import CacheWriteError, KernelCache, KernelKey, KernelLoadError, KernelNotBuiltError
from .launch import LaunchConfig
from .launcher import Launcher
from .variants import ArchFamily, Request, Variant, arch_for_capability, find, generated

MAX_BUCKET_LOG2 = 15  # token-count buckets 1, 2, 4, ... 32768 (larger counts use the last)
# what the CPU implementations (the PyTorch reference behind the torch ops) skip, counted as the
# kernels count it: one process-wide pair, whichever runtime is asked (errors_buffer("cpu"))
CPU_ERRORS = torch.zeros(2, dtype=torch.int32)


def bucket_index(n_tokens: int) -> int:
    """ceil(log2(n)) capped at MAX_BUCKET_LOG2: the index into Runtime.launchers(...)."""
    return min((n_tokens - 1).bit_length(), MAX_BUCKET_LOG2) if n_tokens > 1 else 0


@dataclass(frozen=True)
class DeviceFacts:
    """What the dispatcher needs to know about one CUDA device, read once."""

    index: int
    name: str
    capability: tuple[int, int]
    arch: ArchFamily
    target: str
    sm_count: int
    selftest_key: str  # what a recorded self-test outcome must match (selftest.environment_key)


def read_device_facts(index: int) -> DeviceFacts:
    """The facts of CUDA device `index`, from torch (an UnsupportedError for an unknown capability)."""
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    arch, target = arch_for_capability(*capability)
    return DeviceFacts(
        index, props.name, capability, arch, target, props.multi_processor_count,
        selftest.environment_key(props.name, capability),
    )  # fmt: skip


class Runtime:
    """Everything here is made on first use and kept, so bind-time work happens once per process.
    `cache` (anything with `.root` and `.load(KernelKey)`), `tuning_db` (a path), `selftest_records`
    and `device_facts` (index -> DeviceFacts) can be given, e.g. by tests that run without a GPU."""

    def __init__(
        self,
        *,
        cache: KernelCache | None = None,
        tuning_db: Path | None = None,
        selftest_records: selftest.Records | None = None,
        device_facts: Callable[[int], DeviceFacts] = read_device_facts,
    ):
        self.cache = cache if cache is not None else KernelCache()
        self.tuning_db = Path(tuning_db) if tuning_db is not None else tuning.database_to_read()
        self.selftests = (
            selftest_records if selftest_records is not None else selftest.Records(self.cache.root)
        )
        self._read_facts = device_facts
        self._devices: dict[int, DeviceFacts] = {}
        self._tuning_tables: dict[int, dict] = {}
        self._errors: dict[int, torch.Tensor] = {}
        self._launchers: dict[tuple, Launcher] = {}
        self._variants: dict[tuple, Variant] = {}
        self._arenas: dict[int, selftest.Arena] = {}
        self._lock = threading.RLock()
        # per-shape fast paths of the one-call functions (ops.py); only ever grows (an entry is never
        # replaced or removed: the native fast path remembers recent entries by key)
        self.calls: dict[tuple, object] = {}

    # ---- per device ------------------------------------------------------------------------------
    def device(self, device: torch.device | int | None = None) -> DeviceFacts:
        index = _index(device)
        facts = self._devices.get(index)
        if facts is None:
            facts = self._devices[index] = self._read_facts(index)
        return facts

    def errors_buffer(self, device: torch.device | str | int | None = None) -> torch.Tensor:
        """Per-device int32[2] counters of rows skipped in checked mode: [kv rows, q tokens] (docs/op.md).
        For a CPU device: the counters of the CPU implementations (CPU_ERRORS)."""
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device) and device.type == "cpu":
            return CPU_ERRORS
        index = _index(device)
        buf = self._errors.get(index)
        if buf is None:
            with self._lock:
                buf = self._errors.get(index)
                if buf is None:
                    buf = self._errors[index] = torch.zeros(
                        2, dtype=torch.int32, device=torch.device("cuda", index)
                    )
        return buf

    # ---- resolution --------------------------------------------------------------------------------
    def variant(self, request: Request, device: torch.device | int | None = None) -> Variant:
        """The variant a request runs on this device: `find`, then the first-use self-test."""
        facts = self.device(device)
        key = (facts.index, request)
        v = self._variants.get(key)
        if v is None:
            with self._lock:
                v = find(request, facts.arch)
                fallback = selftest.fallback_to_test(v)
                if fallback is not None and fallback.name in generated():
                    v = self._self_tested(v, fallback, facts)
                self._variants[key] = v
        return v

    def prepare(self, device: torch.device | int | None = None) -> None:
        """Allocate what first use on a device needs (error counters, the self-test arena), so a bind
        after ScratchPool.lock() allocates nothing. ScratchPool.reserve calls it."""
        index = _index(device)
        self.errors_buffer(index)
        if index not in self._arenas:
            self._arenas[index] = selftest.Arena(torch.device("cuda", index))

    def selftest_arena(self, device: torch.device | int | None = None) -> selftest.Arena:
        self.prepare(device)
        return self._arenas[_index(device)]

    def _self_tested(self, v: Variant, fallback: Variant, facts: DeviceFacts) -> Variant:
        use = self.selftests.lookup(facts.selftest_key, v, fallback)
        if use is None:
            if torch.cuda.is_current_stream_capturing():
                raise selftest.SelfTestError(
                    f"{v.name} is used for the first time on this machine inside a CUDA graph capture, where "
                    "its first-use self-test cannot run: call the op (or bind it) once before capturing"
                )
            self.prepare(facts.index)
            launcher = self.launcher(v, facts.arch.default_config, facts.index)
            try:
                ok, detail = selftest.run(
                    launcher, self.errors_buffer(facts.index), self._arenas[facts.index]
                )
            except Exception as exc:  # a native path that cannot even run: report it, use the fallback
                ok, detail = False, f"the self-test raised {type(exc).__name__}: {exc}"
            use = v if ok else fallback
            if not ok:
                selftest.warn_failed(v, fallback, facts.selftest_key, detail)
            self.selftests.store(facts.selftest_key, v, use, ok, detail)
        return use

    def tuning_table(self, device: torch.device | int | None = None) -> dict:
        """(variant, bucket) -> {(heads, heads written, compress ratio): LaunchConfig} tuned on a GPU like this one,
        and (variant, bucket, bits) -> the same tuned for those numerics bits (empty without such entries)."""
        facts = self.device(device)
        table = self._tuning_tables.get(facts.index)
        if table is None:
            try:
                db = tuning.TuningDatabase.load(self.tuning_db)
                env = tuning.environment_for(facts.name, facts.sm_count, facts.capability)
                table = db.table_for(env) if db.entries else {}
            except Exception as exc:  # a broken database never breaks serving
                warnings.warn(f"tuning database not used: {exc}", tuning.TuningDatabaseWarning)
                table = {}
            self._tuning_tables[facts.index] = table
        return table

    def config(
        self,
        v: Variant,
        device: torch.device | int | None,
        n_tokens: int,
        heads: int | None,
        written: int | None,
        compress_ratio: int = 1,
        numerics: int | None = None,
    ) -> LaunchConfig:
        """The tuned config of n_tokens' bucket at (heads, heads written) or the nearest, of the call's
        compress ratio or else of ratio 1 (tuning.pick), else the default; an entry tuned for the call's
        `numerics` bits first."""
        table, bucket = self.tuning_table(device), 1 << bucket_index(n_tokens)
        if numerics is not None:
            tuned = tuning.pick(table.get((v.name, bucket, numerics)), heads, written, compress_ratio)
            if tuned is not None:
                return tuned
        return (
            tuning.pick(table.get((v.name, bucket)), heads, written, compress_ratio) or v.arch.default_config
        )

    def launcher(
        self, v: Variant, config: LaunchConfig, device: torch.device | int | None = None
    ) -> Launcher:
        facts = self.device(device)
        key = (facts.index, v, config)
        launcher = self._launchers.get(key)
        if launcher is None:
            with self._lock:
                launcher = self._launchers.get(key)
                if launcher is None:
                    fn = self._load(KernelKey(v.name, config, facts.target))
                    launcher = Launcher(v, config, facts.target, facts.index, fn, facts.sm_count)
                    self._launchers[key] = launcher
        return launcher

    def _load(self, key: KernelKey):
        """The cache's kernel for key; a failure of the file system under it (a miss in a read-only cache,
        a cache that cannot be written) as a KernelLoadError naming the kernel."""
        try:
            return self.cache.load(key)
        except (KernelNotBuiltError, CacheWriteError) as exc:  # (typed, and OSErrors: said the same way)
            raise KernelLoadError(
                f"kernel {key.variant} [{key.config.key}] for {key.target} could not be loaded or built: {exc}"
            ) from exc
        except AttnPrologueError:
            raise
        except OSError as exc:
            raise KernelLoadError(
                f"kernel {key.variant} [{key.config.key}] for {key.target} could not be loaded or built: {exc}"
            ) from exc

    def launchers(
        self,
        request: Request,
        device: torch.device | int | None = None,
        *,
        heads: int | None = None,
        written: int | None = None,
        config: LaunchConfig | None = None,
        slots32: bool = False,
        positions32: bool = False,
        numerics: int | None = None,
        compress_ratio: int = 1,
        fold_numerics: bool = False,
    ) -> tuple[Launcher, ...]:
        """The launcher of every token-count bucket (index = bucket_index(n)); `config` forces one.
        slots32 / positions32: compiled for int32 slot ids / positions (the same tuned configs, the other
        width). numerics:
        the calls' parity-choice bits (None: the format defaults'); a config that folds other bits
        serves them through another module (serving_config). fold_numerics: each bucket's config folded
        to these bits (compiled on first use where `build` did not), unless it fixes its own."""
        facts = self.device(device)
        v = self.variant(request, facts.index)
        if config is not None and (why := v.refusal(config)):
            raise UnsupportedError(why)
        configs = [
            config or self.config(v, facts.index, 1 << i, heads, written, compress_ratio, numerics)
            for i in range(MAX_BUCKET_LOG2 + 1)
        ]
        bits = v.default_numerics if numerics is None else numerics
        if fold_numerics:
            configs = [c.folded_to(bits, v.default_numerics) for c in configs]
        return tuple(
            self.launcher(
                v,
                self.serving_config(
                    v, replace(c, slots32=slots32, positions32=positions32), bits, facts.target
                ),
                facts.index,
            )
            for c in configs
        )

    def serving_config(self, v: Variant, c: LaunchConfig, bits: int, target: str) -> LaunchConfig:
        """The module of config c for calls with these `numerics` bits: c itself unless it folds other
        bits (defaults_only, folded_numerics). Then the first that is built of: c folded to these bits
        (`build --numerics SPEC` compiles it), c reading them at run time, the arch's default config
        (every build compiles it) reading them at run time."""
        folds = v.default_numerics if c.defaults_only else c.folded_numerics
        if folds < 0 or folds == bits:
            return c
        twin = replace(c, defaults_only=False, folded_numerics=-1)
        for choice in (replace(twin, folded_numerics=bits), twin):
            if self.cache.has(KernelKey(v.name, choice, target)):
                return choice
        return replace(v.arch.default_config, slots32=c.slots32, positions32=c.positions32)


def _index(device) -> int:
    if isinstance(device, int):
        return device
    if device is not None and device.type != "cuda":
        raise InputError(
            f"the kernels run on CUDA tensors, not {device.type} ones (attn_prologue.qnorm_rope_kv_insert "
            "and the torch ops run the PyTorch reference on CPU tensors)"
        )
    if not torch.cuda.is_available():
        raise UnsupportedError("no CUDA device is available: the kernels need an NVIDIA GPU")
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


_default: Runtime | None = None


def default_runtime() -> Runtime:
    """The process-wide runtime (made on first use)."""
    global _default
    if _default is None:
        _default = Runtime()
    return _default
