"""Shared test setup. GPU tests are marked `gpu` and skipped (never passed) without a CUDA device."""

import collections
import os

import pytest
import torch

pytest_plugins = ("pytester",)  # tests/test_session_build.py runs small sessions of its own

GPU_SKIP_REASON = (
    "needs a CUDA GPU: on a machine with one, `tests/gpu/run_suite.sh gpu-suite.json` builds its kernels "
    "and runs every GPU test (docs/runtime.md, GPU tests)"
)


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch takes its share of the cores: with each worker's torch
    on all of them (its default), tests/test_lean_quant_cpu.py took 195 s instead of 78 s on 2 cores."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Skips counted by reason, a line each, so that the run ends on its counts rather than on a page
    of skip lines (pyproject's -r asks pytest's own summary for failures and errors only)."""
    reasons = collections.Counter(skip_reason(r) for r in terminalreporter.stats.get("skipped", ()))
    if reasons:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")


def skip_reason(report) -> str:
    """A skip's reason, as pytest's -rs prints it."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.fixture(scope="session")
def session_build(tmp_path_factory, request):
    """The session's full build (tests/support/build.py), or the BuildFailed it ended with: kept, not
    raised, so that `built` reports it once instead of once per dependent test. pytest-xdist's workers
    (the README runs the tests on two) share one build."""
    from .support.build import BuildFailed, build_once

    try:
        return build_once(tmp_path_factory, workers=hasattr(request.config, "workerinput"))
    except BuildFailed as exc:
        return exc


@pytest.fixture
def built(session_build, request):
    """The session build, shared by every test that inspects it. If it failed, the first test that
    needs it fails with the build's output and every later one with a line naming that test."""
    if not isinstance(session_build, Exception):
        return session_build
    first = getattr(session_build, "reported_by", None)
    if first is None:
        session_build.reported_by = request.node.nodeid
        pytest.fail(f"the session build failed: {session_build}", pytrace=False)
    pytest.fail(f"the session build failed (its output: the error of {first})", pytrace=False)
