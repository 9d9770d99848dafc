"""The native fast path: the per-call checks and kernel call in C, and the torch ops' CUDA kernels in C++.

- `fastpath` (fastpath.c, a CPython module, with its parts fastpath_plans.h and fastpath_keys.h):
  what the one-call functions and the bound ops do per call after their first, validated call of a
  shape (fastpath.h holds the checks; ops.py and api.py the Python spelling of the same checks,
  which runs where the module is unavailable). Built with the C compiler Python was built with,
  against tvm_ffi's headers only: torch tensors are read through torch's DLPack exchange API, so one
  build serves every torch that has that API. Built on first use (under a second) or by
  `attn-prologue build`.
- `torch_ops` (torch_ops.cpp): the CUDA kernels of `torch.ops.attn_prologue.*` in C++, so the
  dispatcher reaches compiled code, and a tensor reader the fast-path module then uses instead of
  the exchange API (a tensor read in place: the exchange API's pybind11 cast and GIL round trip per
  tensor make a no-op plan call 2.2-2.6x as long, tools/native_cpu_cost.py). Built against the
  installed torch (its C++ ABI, libtorch_python and this Python's headers), by `attn-prologue build` (9-14 s on the H200
  machines, 25 s on a 2-core VM); loaded at import when built, else the ops' CUDA kernels are Python
  functions (torch_op.py) and the module reads tensors through the exchange API.

Both live inside the kernel cache (`<ATTN_PROLOGUE_CACHE>/native/`, never beside it: a directory the
user did not name), keyed by their sources, the compiler, Python, tvm_ffi (and torch) versions and the
host, under the kernel cache's trust rules (read through checked descriptors, private directories,
nothing owned by another user unless the cache is shared, a hash in meta.json), and are loaded from
the verified bytes (jit/loading.py). `ATTN_PROLOGUE_NATIVE=0` turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

from filelock import FileLock

from .. import env
from ..errors import AttnPrologueError
from ..jit import cleaning, loading
from ..jit.compiler import host_tag
from ..jit.kernel_cache import KernelCache
from ..jit.trusted_fs import write_private

ENV_NATIVE = "ATTN_PROLOGUE_NATIVE"
SOURCES = Path(__file__).parent
FASTPATH_MODULE = "attn_prologue_fastpath"  # the PyInit_ name in fastpath.c


class NativeBuildError(AttnPrologueError, RuntimeError):
    """A native part could not be built (the message holds the compiler's output)."""


class NativeUnavailableWarning(UserWarning):
    """The native fast path could not be built or loaded; the Python paths are used instead."""


def enabled() -> bool:
    return env.get(ENV_NATIVE)


def _compiler(var: str, fallback: str) -> list[str]:
    """$CC / $CXX, else the compiler Python was built with if this host has it, else cc / c++."""
    given = os.environ.get(var) or sysconfig.get_config_var(var) or fallback
    try:
        command = shlex.split(given)
    except ValueError as exc:  # e.g. an unclosed quote
        raise NativeBuildError(
            f"{var}={given!r} is not a command ({exc}): unset it or name a compiler"
        ) from None
    if not command:
        raise NativeBuildError(
            f"{var}={given!r} names no compiler: unset it or name one (e.g. {var}={fallback})"
        )
    return command if shutil.which(command[0]) else [fallback]


def _tvm_ffi_dirs() -> tuple[Path, Path]:
    import tvm_ffi

    base = Path(tvm_ffi.__file__).parent
    return base / "include", base / "lib"


def _versions() -> dict:
    return {
        "host": host_tag(),
        "python": sysconfig.get_config_var("EXT_SUFFIX"),
        "tvm_ffi": importlib.metadata.version("apache-tvm-ffi"),
    }


def _torch_versions() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "torch_dir": str(Path(torch.__file__).parent),
        "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
    }


def _fastpath_command(out: Path) -> list[str]:
    inc, lib = _tvm_ffi_dirs()
    return [
        *_compiler("CC", "cc"), "-O2", "-std=c11", "-shared", "-fPIC", "-Wall", "-Werror",
        "-Wno-unused-parameter", "-Wno-missing-field-initializers",
        f"-I{sysconfig.get_paths()['include']}", f"-I{inc}", str(SOURCES / "fastpath.c"),
        f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}", "-o", str(out),
    ]  # fmt: skip


def _torch_ops_command(out: Path) -> list[str]:
    import torch

    inc, lib = _tvm_ffi_dirs()
    tdir = Path(torch.__file__).parent
    return [
        *_compiler("CXX", "c++"), "-O2", "-std=c++20", "-shared", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{tdir / 'include'}", f"-I{tdir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{inc}", str(SOURCES / "torch_ops.cpp"),
        f"-L{tdir / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-L{lib}", "-ltvm_ffi",
        f"-Wl,-rpath,{lib}", f"-Wl,-rpath,{tdir / 'lib'}", "-o", str(out),
    ]  # fmt: skip


PARTS = {  # name -> (file name, sources, build command, the versions its key holds)
    "fastpath": (FASTPATH_MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"),
                 ("fastpath.c", "fastpath_plans.h", "fastpath_keys.h", "fastpath.h"), _fastpath_command,
                 _versions),
    "torch_ops": ("attn_prologue_torch_ops.so", ("torch_ops.cpp", "fastpath.h"), _torch_ops_command,
                  lambda: {**_versions(), **_torch_versions()}),
}  # fmt: skip


def entry_key(part: str) -> tuple[str, dict]:
    name, sources, command, versions = PARTS[part]
    facts = {"part": part, **versions(), "compiler": command(Path(name))[0]}
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for s in sources:
        h.update((SOURCES / s).read_bytes())
    return h.hexdigest()[:20], facts


def _cache(root: Path | None = None) -> KernelCache:
    """The kernel cache the parts live in (`root`: a kernel cache root; default: the configured one)."""
    return KernelCache(root)


def _entry(part: str) -> tuple[str, ...]:
    return ("native", part, entry_key(part)[0])


def verified(part: str, root: Path | None = None) -> tuple[Path, bytes] | None:
    """The part's built object and its bytes, read through checked descriptors, if an intact, trusted
    entry exists (None: not built for this environment; UntrustedCacheError: not trusted)."""
    cache = _cache(root)
    files = cache.read_files(_entry(part), ("meta.json", PARTS[part][0]))
    if files is None or files["meta.json"] is None:
        return None
    try:
        meta = json.loads(files["meta.json"])
        so = files[meta["file"]] if meta["file"] == PARTS[part][0] else None
        if so is None or meta["sha256"] != hashlib.sha256(so).hexdigest():
            return None
    except (ValueError, RecursionError, KeyError, TypeError):
        return None
    return cache.root.joinpath(*_entry(part), PARTS[part][0]), so


def built_path(part: str, root: Path | None = None) -> Path | None:
    """The part's built object if an intact, trusted entry exists (UntrustedCacheError otherwise)."""
    found = verified(part, root)
    return None if found is None else found[0]


_build_lock = threading.Lock()


def build(part: str, root: Path | None = None) -> Path:
    """Build the part into the cache unless an intact entry exists; its path. NativeBuildError
    (the compiler's output) when it does not compile."""
    with _build_lock:
        found = built_path(part, root)
        if found is not None:
            return found
        key, facts = entry_key(part)
        cache = _cache(root)
        if cache.trust == "shared":
            raise NativeBuildError(
                f"the native {part} is not in the shared cache {cache.root} (a shared cache is read-only: "
                f"its owner builds it with `attn-prologue build`)"
            )
        parent = cache.make_private_dirs(*_entry(part)[:-1])
        with FileLock(str(parent / f"{key}.lock"), timeout=cache.lock_timeout, mode=0o600):
            found = built_path(part, root)
            if found is not None:
                return found
            name = PARTS[part][0]
            cleaning.remove_dead(cache.tree, _entry(part)[:-1], r"\.[0-9a-f]{20}-(\d+)-\w+")  # killed builds
            tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{key}-{os.getpid()}-"))  # 0700
            try:
                command = PARTS[part][2](tmp / name)
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise NativeBuildError(
                        f"building the native {part} failed ({shlex.join(command)}):\n{done.stderr[-4000:]}"
                    )
                os.chmod(tmp / name, 0o600)
                meta = {**facts, "file": name, "sha256": _sha256(tmp / name), "command": command}
                write_private(tmp / "meta.json", json.dumps(meta, indent=1))
                entry = parent / key
                if entry.exists():  # an incomplete or corrupt entry: replace it
                    shutil.rmtree(entry)
                os.rename(tmp, entry)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return entry / name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_verified(found: tuple[Path, bytes], loader):
    """loader(path) on a path holding exactly a part's verified bytes (`verified`; jit/loading.py)."""
    cache = _cache()
    private = (lambda: cache.tree.opened(".load", create=True)) if cache.trust == "own" else None
    return loading.load(found[1], loader, private)


def _extension_module(path: str):
    loader = importlib.machinery.ExtensionFileLoader(FASTPATH_MODULE, path)
    spec = importlib.util.spec_from_file_location(FASTPATH_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_tensor_reader = 0  # the loaded C++ torch-op library's ap_dltensor_from_pyobject (0: not loaded)


def use_tensor_reader(library: ctypes.CDLL) -> None:
    """Hand the fast-path module the tensor reader of the C++ torch-op library just loaded (it reads a
    tensor in place; torch's DLPack exchange API serves without it)."""
    global _tensor_reader
    reader = reader_of(library)
    _tensor_reader = ctypes.cast(reader, ctypes.c_void_p).value or 0
    module = fastpath() if fastpath.cache_info().currsize else None  # not yet made: it takes the reader then
    if module is not None:
        module.set_unpacker(_tensor_reader)


def reader_of(library: ctypes.CDLL):
    """The C++ torch-op library's tensor reader (NativeBuildError: a library without it is not ours)."""
    try:
        return library.ap_dltensor_from_pyobject
    except AttributeError:
        raise NativeBuildError(
            f"the native torch_ops library has no ap_dltensor_from_pyobject ({library})"
        ) from None


def _unavailable(why: str) -> None:
    warnings.warn(
        f"attn_prologue: the native fastpath is unavailable ({why}); using the Python path",
        NativeUnavailableWarning,
        stacklevel=3,
    )


@functools.lru_cache(maxsize=1)
def fastpath():
    """The fast-path module, initialised with torch's DLPack exchange API; None (with one warning:
    this runs once per process) when it is turned off, cannot be built here, or torch lacks the API."""
    if not enabled():
        return None
    import torch

    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if api is None:
        _unavailable(f"torch {torch.__version__} has no DLPack exchange API")
        return None
    try:
        build("fastpath")
        found = verified("fastpath")
        if found is None:
            raise NativeBuildError("the fast-path entry just built does not verify")
        module = load_verified(found, _extension_module)
        module.init(api, torch.Tensor)
        module.set_unpacker(_tensor_reader)
    except (
        AttnPrologueError,
        OSError,
        ImportError,
        RuntimeError,
        AttributeError,
    ) as exc:  # (no init: not ours)
        _unavailable(str(exc).splitlines()[0])
        return None
    sys.modules.setdefault(FASTPATH_MODULE, module)
    return module
