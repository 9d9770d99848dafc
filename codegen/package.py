"""`package-kernels`: a built kernel cache (chosen targets) as an installable wheel.

Serving hosts then install prebuilt kernels instead of compiling for minutes: the wheel holds the
cache entries under a package whose `ROOT` points at them and declares an `attn_prologue.kernels`
entry point, which `KernelCache` consults (read-only, as a shared cache) before compiling. It pins
the attn-prologue version it was built from, and entries are keyed by module source hash, DSL
build and host platform anyway, so a mismatched install is a miss, never a wrong kernel.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import sysconfig
import zipfile
from pathlib import Path

from attn_prologue.jit.kernel_cache import ENTRY_POINT_GROUP, KernelCache

from . import build
from .variants import variant_space

ENTRY_FILES = ("kernel.so", "kernel.ptx", "meta.json")


def wheel_name_parts(targets: list[str]) -> tuple[str, str]:
    """(distribution name, import package) for a set of targets, e.g. attn-prologue-kernels-sm90a."""
    tag = "-".join(t.replace("_", "") for t in sorted(targets))
    return f"attn-prologue-kernels-{tag}", f"attn_prologue_kernels_{tag.replace('-', '_')}"


def wheel_file_name(targets: list[str], version: str) -> str:
    """The wheel `package` writes, e.g. attn_prologue_kernels_sm120f-0.1.0-py3-none-linux_x86_64.whl."""
    dist, _ = wheel_name_parts(targets)
    return f"{dist.replace('-', '_')}-{version}-py3-none-{_platform_tag()}.whl"


def _platform_tag() -> str:
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")  # a .so is host-specific


def package(
    cache: KernelCache, targets: list[str], out_dir: Path, variants=None, jobs: int | None = None
) -> Path:
    """Build what is missing for `targets`, then write the wheel into out_dir; returns its path."""
    variants = variants if variants is not None else variant_space()
    build.run(cache, jobs=jobs, targets=set(targets), variants=variants)
    keys = [k for _, k in build.build_keys(variants, set(targets))]
    version = importlib.metadata.version("attn-prologue")
    dist, pkg = wheel_name_parts(targets)
    platform_tag = _platform_tag()
    files: dict[str, bytes] = {
        f"{pkg}/__init__.py": (
            f'"""Prebuilt attn-prologue {version} kernels for {", ".join(sorted(targets))} (see `package-kernels`)."""\n\n'
            'from pathlib import Path\n\nROOT = Path(__file__).parent / "cache"\n'
        ).encode()
    }
    for k in keys:
        entry = cache.entry_dir(k)
        for name in ENTRY_FILES:
            files[f"{pkg}/cache/{k.relpath().as_posix()}/{name}"] = (entry / name).read_bytes()
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        f"Summary: Prebuilt attn-prologue kernels for {', '.join(sorted(targets))} ({len(keys)} kernels)\n"
        f"Requires-Dist: attn-prologue=={version}\n"
    ).encode()
    files[f"{info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: attn_prologue package-kernels\nRoot-Is-Purelib: false\nTag: py3-none-{platform_tag}\n"
    ).encode()
    files[f"{info}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{dist} = {pkg}\n".encode()
    record = io.StringIO()
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{name},sha256={digest},{len(data)}\n")
    record.write(f"{info}/RECORD,,\n")
    files[f"{info}/RECORD"] = record.getvalue().encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / wheel_file_name(targets, version)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return wheel
