"""The README's numbers come from committed result files: the kernel count and build time from
results/build-cpu.json (written by tools/time_build.py), the GPU suite count and the host-time
ratios from the H200 files. A number edited by hand, or a result file replaced without the README,
fails here."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
RESULTS = REPO / "results"


def test_the_build_claim_is_the_recorded_build():
    record = json.loads((RESULTS / "build-cpu.json").read_text())
    kernels = len(build.build_keys(variant_space()))
    assert record["kernels"] == kernels  # the record is of today's variant space
    m = re.search(r"builds its (\d+) kernels in (\d+) s wall on (\d+) cores", README)
    assert m, "the README states the main job's build as 'builds its N kernels in T s wall on C cores'"
    assert (int(m[1]), int(m[2]), int(m[3])) == (
        kernels,
        round(record["wall_seconds"]),
        record["machine"]["cpus"],
    )


def test_the_gpu_suite_and_host_ratio_claims_are_the_recorded_ones():
    suite = json.loads((RESULTS / "gpu-suite-h200.json").read_text())
    assert f"`results/gpu-suite-h200.json`: {suite['passed']} passed" in README and suite["failures"] == 0
    runs = [
        json.loads(p.read_text())["ratio_to_add"]
        for p in sorted((RESULTS / "host-ratio").glob("torch-library-*.json"))  # the files the README cites
    ]
    assert len(runs) == 3
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    assert f"bound op {median['bound op']:.2f}x" in README
    assert f"one-call function {median['one-call function']:.2f}x" in README
    assert f"torch op {median['torch op']:.1f}x" in README
