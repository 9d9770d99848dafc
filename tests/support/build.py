"""The session's full build, shared by the build and emitted-code tests: every generated variant for
every target it claims, plus the configs the shipped tuning database names, compiled once per
session through the CLI into a temporary kernel cache. No GPU is needed.

Three things keep it usable on a slow or busy machine:

- Reuse. Entries that the main command (`python -m attn_prologue build`) already put into the user's
  kernel cache (`$ATTN_PROLOGUE_CACHE`, default ~/.cache/attn_prologue/kernels) with the same keys
  (variant, config, target, module source, DSL build, host) are copied into the temporary cache, and
  so are the native parts in it; `build` then compiles only what is missing. The user's cache is
  only read, never written. `ATTN_PROLOGUE_TEST_CLEAN_BUILD=1` builds everything from nothing (CI).
- No fixed timeout: the limit grows with the kernels left to compile and shrinks with the cores
  (`build_timeout`); `ATTN_PROLOGUE_TEST_BUILD_TIMEOUT=<seconds>` overrides it, `0` removes it.
- One report: a failed build is reported in full by the first test that needs it; every other test
  that needs it fails with one line naming that test (conftest.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from attn_prologue import native
from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space
from attn_prologue.errors import AttnPrologueError
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey

REPO = Path(__file__).resolve().parents[2]
ENV_CLEAN = "ATTN_PROLOGUE_TEST_CLEAN_BUILD"
ENV_TIMEOUT = "ATTN_PROLOGUE_TEST_BUILD_TIMEOUT"
ENV_RECORD = (
    "ATTN_PROLOGUE_TEST_BUILD_RECORD"  # a JSON file the session build's facts go to (tools/time_tests.py)
)

# CI compiles every generated variant for every target it claims (the project's main job) and
# inspects what each one emits.
VARIANTS = variant_space()
ENTRIES = build.build_keys(VARIANTS)  # (variant, key) for every default/tuned config and target
ENTRY_IDS = [f"{k.variant}-{k.target}-{k.config.key}" for _, k in ENTRIES]
CHEAP = next(k for v, k in ENTRIES if v.name == "kv_d512r64_bf16_bf16_sm90")  # a kernel quick to build

# The limit is a guard against a hung build, not a speed check: an idle 2-core x86-64 VM compiles a
# kernel in about 1.3 core-seconds and the loaded one of issue 29 in about 5.6; the fixed part covers
# the DSL's import per worker and the native parts (35 s there).
FIXED_SECONDS = 600
CORE_SECONDS_PER_KERNEL = 15


def kernels_only_env() -> dict[str, str]:
    """The environment for a `build` subprocess that compiles the kernels alone: no C++ torch-op library
    (ATTN_PROLOGUE_NATIVE=0; the native parts have their own tests, tests/test_native_cpu.py)."""
    return {**os.environ, "ATTN_PROLOGUE_NATIVE": "0"}


def build_timeout(kernels: int, cpus: int | None = None) -> float | None:
    """Seconds the session build may take for `kernels` left to compile (None: no limit)."""
    given = os.environ.get(ENV_TIMEOUT)
    if given is not None:
        seconds = float(given)
        return None if seconds <= 0 else seconds
    return FIXED_SECONDS + CORE_SECONDS_PER_KERNEL * kernels / max(1, cpus or os.cpu_count() or 1)


@dataclass
class Built:
    root: Path
    cache: KernelCache
    output: str
    seconds: float
    reused: int = 0  # entries copied from the user's kernel cache instead of compiled


class BuildFailed(Exception):
    """The session build did not finish; the message holds the end of its output."""


def build_cli(root: Path, timeout: float | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`attn_prologue build --cache-dir root`, in a process group of its own so that on a timeout (or
    an interrupt) ninja and the compile workers are killed with it."""
    cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(root)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # the limit, or Ctrl-C: the group started apart, so end it here
        os.killpg(
            proc.pid, signal.SIGTERM
        )  # (ninja runs each job in a group of its own and ends them on SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.perf_counter() - t0


def _copy_private(src: Path, dst: Path, stop: Path) -> None:
    """Copy the regular files of directory src into dst, creating dst and its parents up to `stop`
    as 0700 and the files as 0600 (the kernel cache's own modes)."""
    missing = []
    d = dst
    while not d.exists() and d != stop.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        os.mkdir(d, 0o700)
    for f in src.iterdir():
        if f.is_file() and not f.is_symlink():
            shutil.copyfile(f, dst / f.name, follow_symlinks=False)
            os.chmod(dst / f.name, 0o600)


def reuse_user_cache(root: Path) -> int:
    """Copy into the cache at `root` every session entry the user's kernel cache holds intact with
    the same key, and the native parts built in it; the number of entries copied. Reads the
    user's cache only; a copy that does not verify in its new place is removed (then compiled)."""
    if os.environ.get(ENV_CLEAN, "0") not in ("0", ""):
        return 0
    user, mine = KernelCache(), KernelCache(root)
    if user.root.resolve() == root.resolve() or not user.root.is_dir():
        return 0
    copied = 0
    try:
        for _, key in ENTRIES:
            if user.read_meta(key) is None:
                continue
            _copy_private(user.entry_dir(key), mine.entry_dir(key), root)
            if mine.read_meta(key) is None:
                shutil.rmtree(mine.entry_dir(key))
                continue
            copied += 1
        if native.enabled():  # the native parts live inside the kernel cache root (runtime/native)
            for part in native.PARTS:
                found = native.built_path(part, user.root)
                if found is not None:
                    _copy_private(found.parent, root / found.parent.relative_to(user.root), root)
    except AttnPrologueError as exc:  # an untrusted user cache: read nothing more from it
        print(f"\n[build] not reusing {user.root}: {exc}")
    return copied


def build_once(tmp_path_factory, workers: bool = False) -> Built:
    """Build the session's cache, or raise BuildFailed with the end of the build's output. Under
    pytest-xdist (`workers`), the first worker to get here builds into a folder every worker of the
    run shares and records the outcome; the others wait on its lock and take that record, so the
    kernels are compiled once per run, not once per worker."""
    if not workers:
        return _build(tmp_path_factory.mktemp("session-build") / "kernels")
    shared = tmp_path_factory.getbasetemp().parent / "session-build"  # the run's, above each worker's
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        record = shared / "outcome.json"
        if record.exists():
            done = json.loads(record.read_text())
            if "failed" in done:
                raise BuildFailed(done["failed"])
            return Built(shared / "kernels", KernelCache(shared / "kernels"), done["output"], done["seconds"],
                         done["reused"])  # fmt: skip
        shared.mkdir(mode=0o700, exist_ok=True)
        shutil.rmtree(shared / "kernels", ignore_errors=True)  # left by a worker that died building it
        try:
            built = _build(shared / "kernels")
        except BuildFailed as exc:
            record.write_text(json.dumps({"failed": str(exc)}))
            raise
        facts = {"output": built.output, "seconds": built.seconds, "reused": built.reused}
        record.write_text(json.dumps(facts))
        return built


def _build(root: Path) -> Built:
    root.mkdir(mode=0o700)
    reused = reuse_user_cache(root)
    timeout = build_timeout(len(ENTRIES) - reused)
    try:
        proc, seconds = build_cli(root, timeout)
    except subprocess.TimeoutExpired as exc:
        raise BuildFailed(
            f"the session build of {len(ENTRIES) - reused} kernels took longer than {timeout:.0f} s "
            f"(set {ENV_TIMEOUT}=<seconds>, or 0 for no limit):\n{((exc.stdout or '') + (exc.stderr or ''))[-4000:]}"
        ) from None
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildFailed(f"`attn_prologue build` exited {proc.returncode}:\n{output[-6000:]}")
    source = f"; {reused} reused from {KernelCache().root} (read-only)" if reused else ""
    print(f"\n[build] {len(ENTRIES)} kernels ({len(VARIANTS)} variants) in {seconds:.1f}s{source}")
    if os.environ.get(ENV_RECORD):
        facts = {"kernels": len(ENTRIES), "reused": reused, "build_seconds": round(seconds, 1)}
        Path(os.environ[ENV_RECORD]).write_text(json.dumps(facts) + "\n")
    return Built(root, KernelCache(root), output, seconds, reused)


def meta_of(built: Built, key: KernelKey) -> dict:
    meta = built.cache.read_meta(key)
    assert meta is not None, f"{key.variant} [{key.target}] has no intact cache entry"
    return meta


def ptx_of(built: Built, key: KernelKey) -> str:
    return (built.cache.entry_dir(key) / "kernel.ptx").read_text()
