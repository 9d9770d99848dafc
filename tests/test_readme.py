"""The README's numbers come from committed result files: the kernel count and build time from
results/build-cpu.json (written by tools/time_build.py), the GPU suite count and the host-time
ratios from the H200 files. A number edited by hand, or a result file replaced without the README,
fails here."""

from __future__ import annotations

import json
import re
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
    text = " ".join(README.split())
    cited = re.search(r"three runs at (\w+) \(`results/host-ratio/native-\1-\*\.json`", text)
    assert cited, "the README cites three native host-ratio runs"
    commit = cited.group(1)
    files = sorted((RESULTS / "host-ratio").glob(f"native-{commit}-*.json"))
    runs = [json.loads(p.read_text()) for p in files]
    assert len(runs) == 3
    for r in runs:  # what the figures are: the native path and the C++ torch-op kernels, at that commit
        assert r["provenance"]["git_commit"].startswith(commit) and not r["provenance"]["git_dirty"]
        assert r["native"] == {"fastpath": True, "torch_op_cuda_kernels": "C++"}
    ratio = [r["ratio_to_add"] for r in runs]

    def each(name):
        return "/".join(f"{r[name]:.2f}" for r in ratio) + "x"

    def span(name):
        return f"{min(r[name] for r in ratio):.2f}-{max(r[name] for r in ratio):.2f}x"

    for claim in (
        f"one-call function {each('one-call function')}",
        f"KV-only {span('one-call kv function')}",
        f"bound KV op {span('bound kv op')}",
        f"torch KV op {span('torch kv op')}",
        f"bound op {each('bound op')}",
        f"torch op {span('torch op')}",
        f"is {span('native plan alone (C checks + launch)')}",
    ):
        assert claim in text, claim
