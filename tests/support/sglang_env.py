"""Importing the real sglang package on a CPU-only machine, for tests/test_plugin_sglang.py.

The modules the SGLang plugin hooks import `sglang.srt.configs`, which imports torchvision. PyPI's
torchvision wheel is its CUDA build: against a CPU torch its `_C` extension does not load, and
`torchvision/_meta_registrations.py` then fails on `register_fake("torchvision::nms")` (and
`qnms`), which it registers whether the extension loaded or not. `import_sglang` defines those two
operator schemas when, and only when, that is why the import failed; no torchvision operator runs
in these tests. With a torchvision whose extension loads (a CPU build, or a CUDA machine) it does
nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

_TORCHVISION_SCHEMAS = ("nms", "qnms")
_library: list[torch.library.Library] = []  # kept alive: the schemas live as long as it does


def _import_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None or "torchvision" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in _TORCHVISION_SCHEMAS:
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _library.append(lib)
        importlib.import_module("torchvision")


def import_sglang():
    """The sglang package, or skip the calling test module when it (or a dependency) is absent."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed", allow_module_level=True)
    _import_torchvision()
    return pytest.importorskip("sglang")
