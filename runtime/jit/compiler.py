"""The tensor-free compile boundary: (variant, config, target) -> exported shared object.

`compile_entry` builds fake arguments from the generated module, always passes `--gpu-arch`,
never launches anything, and writes `kernel.so` (TVM-FFI calling convention) plus the PTX/cubin
facts into a directory. It needs the DSL but no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from ..launch import LaunchConfig
from ..variants import TARGETS, parse_name
from . import artifacts

KERNELS_PACKAGE = "attn_prologue.generated.kernels"
SYMBOL = "attn_prologue_kernel"  # exported function name inside every kernel.so
DSL_PACKAGES = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-cu13",
    "apache-tvm-ffi",
)


class CompileError(RuntimeError):
    pass


def module_path(variant: str) -> Path:
    spec = importlib.util.find_spec(f"{KERNELS_PACKAGE}.{variant}")
    if spec is None or spec.origin is None:
        raise KeyError(
            f"no generated module for variant {variant!r} (run `python -m attn_prologue generate`)"
        )
    return Path(spec.origin)


def kernel_lib_path() -> Path:
    return Path(__file__).parent.parent / "device" / "kernel_lib.py"


def kernel_base_path() -> Path:
    return Path(__file__).parent.parent / "device" / "kernel_base.py"


def shared_sources() -> tuple[Path, ...]:
    """What every generated module is compiled from besides itself: the device helpers and the
    methods every Kernel inherits."""
    return kernel_lib_path(), kernel_base_path()


@functools.cache
def source_hash(variant: str) -> str:
    """sha256 of everything the compiled code is made from: the module and the shared sources."""
    h = hashlib.sha256()
    h.update(module_path(variant).read_bytes())
    for path in shared_sources():
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def dsl_fingerprint() -> str:
    """Versions of the installed DSL packages; objects from another DSL build are never reused."""
    parts = []
    for pkg in DSL_PACKAGES:
        try:
            parts.append(f"{pkg}=={importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{pkg}==absent")
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def host_tag() -> str:
    """The host a linked .so runs on (OS and CPU architecture): a cache built on x86-64 is no use
    on an aarch64 GB10, so this is part of every cache key."""
    return f"{platform.system().lower()}-{platform.machine()}"


def dsl_versions() -> dict:
    out = {}
    for pkg in DSL_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def runtime_library_dir() -> Path:
    import nvidia_cutlass_dsl  # namespace package: use __path__, not __file__

    for base in nvidia_cutlass_dsl.__path__:
        for sub in ("cu13", "cu12"):
            lib = Path(base) / sub / "lib"
            if (lib / "libcute_dsl_runtime.so").exists():
                return lib
    raise CompileError("libcute_dsl_runtime.so not found in the nvidia-cutlass-dsl installation")


@functools.lru_cache(maxsize=1)
def preload_runtime() -> Path:
    """Load libcute_dsl_runtime.so globally so exported kernels resolve their launcher symbols."""
    lib = runtime_library_dir() / "libcute_dsl_runtime.so"
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return lib


def toolchain_available() -> bool:
    """Can this process compile kernels (the CuTe DSL importable)? A serving host with prebuilt
    kernels only may not have it."""
    return importlib.util.find_spec("cutlass") is not None


def load_module(variant: str):
    return importlib.import_module(f"{KERNELS_PACKAGE}.{variant}")


def compile_entry(variant: str, config: LaunchConfig, target: str, out_dir: Path) -> dict:
    """Compile one (variant, config, target) into out_dir/kernel.so; return the metadata."""
    if target not in TARGETS:
        raise CompileError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    import cutlass.cute as cute

    preload_runtime()
    mod = load_module(variant)
    claimed = parse_name(variant).arch.targets  # the name says which targets its module is for
    if target not in claimed:
        raise CompileError(f"{variant} is built for {', '.join(claimed)}, not {target}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attn-prologue-dump-") as dump:
        options = f"--gpu-arch {target} --enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir {dump}"
        try:
            # no_jit_engine: the DSL would also link the host code in-process (a second object emit and a
            # JIT link, ~0.2 s a kernel) whenever it thinks this machine could run `target` (on a host
            # without a GPU it assumes sm_100); nothing here calls the compiled function in-process
            compiled = cute.compile(
                mod.Kernel(config), *mod.fake_arguments(config), options=options, no_jit_engine=True
            )
        except Exception as exc:  # the DSL raises many types; keep the message, name the entry
            raise CompileError(f"compiling {variant} [{config.key}] for {target} failed: {exc}") from exc
        ptx = compiled.artifacts.PTX
        cubin = compiled.artifacts.CUBIN
        obj = out_dir / "kernel.o"
        compiled.export_to_c(str(obj), SYMBOL)
    compile_seconds = time.perf_counter() - t0
    so = out_dir / "kernel.so"
    link = subprocess.run(["g++", "-shared", "-o", str(so), str(obj)], capture_output=True, text=True)
    if link.returncode != 0:
        raise CompileError(f"linking {so} failed: {link.stderr.strip()}")
    obj.unlink()
    (out_dir / "kernel.ptx").write_text(ptx)
    return {
        "variant": variant,
        "config": config.key,
        "target": target,
        "dsl_fingerprint": dsl_fingerprint(),
        "dsl_versions": dsl_versions(),
        "host": host_tag(),
        "source_hash": source_hash(variant),
        "compile_seconds": round(compile_seconds, 3),
        "resources": artifacts.cubin_resources(cubin),
        "ptx": artifacts.ptx_facts(ptx),
        "so_sha256": hashlib.sha256(so.read_bytes()).hexdigest(),
        "built_by_pid": os.getpid(),
    }
