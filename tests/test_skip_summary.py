"""The test command's output ends on its counts: skips are counted by reason, a line each
(tests/conftest.py), and pytest's own summary lists failures and errors only (pyproject's -r)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_skips_are_counted_by_reason_and_the_output_ends_on_the_counts(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(
        test_some="""
        import pytest

        @pytest.mark.parametrize("i", range(5))
        def test_gpu(i):
            pytest.skip("needs a CUDA GPU")

        def test_other():
            pytest.skip("not recorded yet")

        def test_fine():
            pass
        """
    )
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    result = pytester.runpytest("-q", *re.findall(r"-r\w+", addopts))
    out = result.stdout.lines
    assert [line for line in out if "SKIPPED" in line] == []  # no line per skipped test
    at = out.index(next(line for line in out if "skipped, by reason" in line))
    assert out[at + 1 : at + 3] == ["    5  needs a CUDA GPU", "    1  not recorded yet"]
    assert re.fullmatch(r"1 passed, 6 skipped in [\d.]+s", out[-1])


def test_pytest_is_not_asked_for_a_line_per_skip():
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert all(
        "s" not in flags and "a" not in flags and "A" not in flags
        for flags in re.findall(r"-r(\w+)", addopts)
    )
