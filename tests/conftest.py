"""Shared test setup. GPU tests are marked `gpu` and skipped (never passed) without a CUDA device."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu/run_suite.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The session's full build (tests/support/build.py), shared by every test that inspects it."""
    from .support.build import build_once

    return build_once(tmp_path_factory)
