"""The docs' `python gpu` blocks (tests/test_docs.py compiles them on the CPU) run on a GPU: the
serving example of docs/serving.md end to end, as a user would paste it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..test_docs import of

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block", of("python gpu"))
def test_a_gpu_block_runs(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
