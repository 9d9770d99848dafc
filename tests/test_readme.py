"""The README's numbers come from the committed result files and the code: its results section is
what tools/readme_results.py renders from results/ (a number edited by hand, or a result file
replaced without the README, fails here), and the counts the docs state (variants, cache formats)
are the code's."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space
from attn_prologue.formats import FORMATS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
RESULTS = REPO / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _tool():
    spec = importlib.util.spec_from_file_location("readme_results", REPO / "tools" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_section_is_the_one_rendered_from_the_files():
    tool = _tool()
    assert tool.section(README), "the README has no results section between the markers"
    assert tool.section(README) == tool.render(), "run `python tools/readme_results.py --write`"


def test_the_rendered_figures_are_the_files():
    """The renderer reads what it claims (so the section's equality above means something)."""
    section = _tool().section(README)
    suite = json.loads((RESULTS / "gpu-suite-h200.json").read_text())
    assert f"{suite['passed']} passed, {suite['failures'] + suite['errors']} failed" in section
    build_record = json.loads((RESULTS / "build-cpu.json").read_text())
    assert f"| {build_record['kernels']} | {build_record['wall_seconds']:.0f} s |" in section
    host = [json.loads((RESULTS / "host-ratio" / f"native-2654f5f-{i}.json").read_text()) for i in (1, 2, 3)]
    ratios = "/".join(f"{h['ratio_to_add']['bound op']:.2f}x" for h in host)
    assert f"| bound op (`ap.bind`) | <= 0.60x | {ratios} |" in section
    # the interleaved-Q ratios and how many meet the bound, computed here from the file the row names
    row = next(line for line in section.splitlines() if line.startswith("| interleaved vs head-major Q"))
    name = re.search(r"\(results/(bench-h200-\w+\.json)\)", row).group(1)
    by_shape = {}
    for r in json.loads((RESULTS / name).read_text())["results"]:
        if (
            r["shape"]["op"] == "qkv"
            and r["shape"]["n"] >= 2048
            and r["shape"]["cache_format"] == "fp8_ds_mla"
        ):
            if r["shape"]["apply_q_norm"] and r["shape"]["apply_q_rope"]:
                by_shape[(r["shape"]["n"], r["shape"]["q_layout"])] = r["op"]["median_us"]
    ratios = sorted(by_shape[(n, "interleaved")] / by_shape[(n, "head_major")] for n in (2048, 8192))
    lo, hi = f"{ratios[0]:.2f}", f"{ratios[1]:.2f}"
    span = f"{lo}x" if lo == hi else f"{lo}-{hi}x"  # (the renderer writes one value for an equal range)
    met = sum(r <= 1.03 for r in ratios)
    assert f"vs head-major Q, T >= 2048: time ratio | <= 1.03x | {span} | {met} of 2" in row


def test_the_build_record_is_of_todays_variant_space():
    record = json.loads((RESULTS / "build-cpu.json").read_text())
    assert record["kernels"] == len(build.build_keys(variant_space()))


@pytest.mark.parametrize("name", ["tests-cpu.json", "tests-cpu-concurrent.json"])
def test_a_test_time_record_is_of_the_readme_command(name):
    path = RESULTS / name
    if not path.exists():
        pytest.skip(f"results/{name} not recorded yet (python tools/time_tests.py)")
    record = json.loads(path.read_text())
    assert record["command"] == "python -m pytest -q"  # the whole suite, not a subset
    assert record["returncode"] == 0 and record["counts"]["failures"] == record["counts"]["errors"] == 0
    assert (record["concurrent_build"] is not None) == ("concurrent" in name)


def test_counts_the_docs_state_are_the_codes():
    variants, formats = len(variant_space()), len(FORMATS)
    seen = 0
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for m in re.finditer(r"\ball (\d+)(?= variants| and why)", text):
            assert int(m[1]) == variants, f"{page.name}: 'all {m[1]}' variants, the code has {variants}"
            seen += 1
        for m in re.finditer(r"\b(\w+) (?:paged KV-cache |cache )formats\b", text):
            if m[1] in WORDS or m[1].isdigit():
                n = int(m[1]) if m[1].isdigit() else WORDS.index(m[1])
                assert n == formats, f"{page.name}: '{m[0]}', the code has {formats} formats"
                seen += 1
    assert seen >= 4  # README (variants, formats), glossary, docs/README, formats.md


def test_the_performance_page_shows_the_committed_sass_census():
    """docs/performance.md's census table is rendered from results/sass-instructions-cpu.json."""
    spec = importlib.util.spec_from_file_location("sass_census", REPO / "tools" / "sass_census.py")
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    page = (REPO / "docs" / "performance.md").read_text()
    assert page == census.render_docs(RESULTS / "sass-instructions-cpu.json"), (
        "run `python tools/sass_census.py --render-docs`"
    )
