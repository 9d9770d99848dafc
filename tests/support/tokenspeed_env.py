"""Importing the real tokenspeed_kernel package on a machine without a GPU, for
tests/test_plugin_tokenspeed.py.

`import tokenspeed_kernel` detects the device while it imports (`platform.current_platform()`, at
module level in many of its modules) and raises RuntimeError without an NVIDIA, AMD or Ascend
device. The only thing stubbed is that detection, through TokenSpeed's own test hook
`Platform.override`, set before the package's `__init__` runs:

1. while importing, a platform of no vendor: modules that import vendor libraries at import time
   when the platform is NVIDIA (deep_ep, TensorRT-LLM, FlashInfer, DeepGEMM, FlashMLA: CUDA
   extensions that need the driver's libcuda) skip them, as they do on any non-NVIDIA machine. The
   op's package `tokenspeed_kernel.ops.attention.dsv4` is imported then too, which registers its
   in-tree kernels (`triton_dsv4_swa_cache_insert`; `cuda_dsv4_swa_cache_insert` only on NVIDIA with
   its extension loaded, i.e. with a driver). Not all of `registry.load_builtin_kernels()`: other
   families' Triton modules probe Triton's GPU backend while they import, which needs a driver;
2. afterwards, an NVIDIA Hopper platform (`NVIDIA_HOPPER`), so that selection sees what an H100 has.

Everything else (the registry, selection, `discover_plugins`, the op's checks and dispatch) is
TokenSpeed's code as shipped. With a GPU the package is imported as it is, nothing stubbed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch


def _platform_module():
    """tokenspeed_kernel.platform without running the package's __init__ (it imports only torch)."""
    if "tokenspeed_kernel.platform" in sys.modules:
        return sys.modules["tokenspeed_kernel.platform"]
    spec = importlib.util.find_spec("tokenspeed_kernel")
    bare = types.ModuleType("tokenspeed_kernel")
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__spec__ = spec
    sys.modules["tokenspeed_kernel"] = bare
    try:
        return importlib.import_module("tokenspeed_kernel.platform")
    finally:
        del sys.modules["tokenspeed_kernel"]  # the real package imports next, reusing the submodule


def stub_platform(p, vendor: str, arch: tuple[int, int], features=frozenset()):
    return p.PlatformInfo(
        vendor=vendor,
        arch_version=p.ArchVersion(*arch),
        device_name=f"stub {vendor} {arch[0]}.{arch[1]} (no GPU: tests/support/tokenspeed_env.py)",
        device_count=1,
        total_memory=80 << 30,
        memory_bandwidth=0.0,
        sm_count=132,
        max_threads_per_sm=2048,
        max_shared_memory_per_sm=228 << 10,
        sm_features=frozenset(features),
        runtime_features=frozenset(),
        interconnect=p.InterconnectInfo(topology="single_gpu"),
    )


def nvidia_hopper():
    p = _platform_module()
    return stub_platform(p, "nvidia", (9, 0), p._get_cuda_sm_features(p.ArchVersion(9, 0)))


def import_tokenspeed_kernel():
    """The tokenspeed_kernel package, device detection stubbed where there is no GPU (module
    docstring); skips the calling test module when it or what its import needs is absent."""
    if importlib.util.find_spec("tokenspeed_kernel") is None:
        pytest.skip("tokenspeed_kernel is not installed", allow_module_level=True)
    if torch.cuda.is_available() or "tokenspeed_kernel" in sys.modules:
        return pytest.importorskip("tokenspeed_kernel")
    p = _platform_module()
    p.Platform.override(stub_platform(p, "none", (0, 0)))
    try:
        module = importlib.import_module("tokenspeed_kernel")
        importlib.import_module("tokenspeed_kernel.ops.attention.dsv4")
    except ImportError as exc:  # e.g. tokenspeed-triton, which its import needs, not installed
        pytest.skip(f"tokenspeed_kernel cannot be imported here: {exc}", allow_module_level=True)
    module.platform = p
    p.Platform.override(nvidia_hopper())
    return module
