"""The README's numbers come from the committed result files and the code: its short results table and
docs/results.md's tables are what tools/readme_results.py renders from results/ (a number edited by
hand, or a result file replaced without the pages, fails here), and the counts the docs state
(variants, cache formats) are the code's. The README stays a front door: short, a CPU quickstart
first, the test command CI runs, and every tool listed in docs/README.md with what it writes."""

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
RESULTS_PAGE = (REPO / "docs" / "results.md").read_text()
RESULTS = REPO / "results"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _tool():
    spec = importlib.util.spec_from_file_location("readme_results", REPO / "tools" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_sections_are_the_ones_rendered_from_the_files():
    tool = _tool()
    assert tool.section(README) and tool.section(RESULTS_PAGE), "a results section has no markers"
    assert tool.section(README) == tool.render_short(), "run `python tools/readme_results.py --write`"
    assert tool.section(RESULTS_PAGE) == tool.render(), "run `python tools/readme_results.py --write`"


def test_the_readme_table_sums_the_full_tables():
    """Its counts are the files' (the GPU suite, every speed target's shapes met)."""
    short, full = _tool().section(README), _tool().section(RESULTS_PAGE)
    suite = json.loads((RESULTS / "gpu-suite-h200.json").read_text())
    assert f"| {suite['passed']} passed, {suite['failures'] + suite['errors']} failed (at " in short
    speed = full[full.index("### Speed") : full.index("### Host cost")]
    met = [
        re.search(r"\| (\d+) of (\d+) \|", line)
        for line in speed.splitlines()
        if line.startswith("| ") and " of " in line
    ]
    assert f"| {sum(int(m[1]) for m in met)} of {sum(int(m[2]) for m in met)} met |" in short
    assert "(results/gpu-suite-h200.json)" in short and "(../results/gpu-suite-h200.json)" in full


def test_the_rendered_figures_are_the_files():
    """The renderer reads what it claims (so the section's equality above means something)."""
    section = _tool().section(RESULTS_PAGE)
    suite = json.loads((RESULTS / "gpu-suite-h200.json").read_text())
    assert f"{suite['passed']} passed, {suite['failures'] + suite['errors']} failed" in section
    build_record = json.loads((RESULTS / "build-cpu.json").read_text())
    assert f"| {build_record['kernels']} | {build_record['wall_seconds']:.0f} s |" in section
    host = [json.loads((RESULTS / "host-ratio" / f"native-2654f5f-{i}.json").read_text()) for i in (1, 2, 3)]
    ratios = "/".join(f"{h['ratio_to_add']['bound op']:.2f}x" for h in host)
    assert f"| bound op (`ap.bind`) | <= 0.60x | {ratios} |" in section
    # the interleaved-Q ratios and how many meet the bound, computed here from the file the row names
    row = next(line for line in section.splitlines() if line.startswith("| interleaved vs head-major Q"))
    name = re.search(r"\(\.\./results/(bench-h200-\w+\.json)\)", row).group(1)
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
    # the whole suite, not a subset (-n: pytest-xdist's workers; the README's command has two)
    assert re.fullmatch(r"python -m pytest -q( -n \d+)?", record["command"]), record["command"]
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


def _readme_commands(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # (it imports its sibling time_build)
    spec = importlib.util.spec_from_file_location("readme_commands", REPO / "tools" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.readme_commands(REPO / "README.md")


def test_the_readme_is_a_front_door(monkeypatch):
    """About 150 lines; the first code block is the CPU quickstart, runnable after the install it names
    (tests/test_docs.py runs it with no GPU visible); then the two commands, as CI runs the tests."""
    lines = README.splitlines()
    assert len(lines) <= 170, f"the README has {len(lines)} lines: move detail into docs/"
    first = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert lines[first] == "```python" and first < 20, (
        "the first block is the quickstart, on the first screen"
    )
    assert "`pip install torch==2.13.0 && pip install -e .`" in "\n".join(lines[:first])
    main, tests = _readme_commands(monkeypatch)
    assert main.startswith("pip install torch==2.13.0 && pip install -e . && ") and "build" in main
    assert tests in (REPO / ".ci" / "run").read_text(), ".ci/run runs the README's test command verbatim"
    assert "../shared" not in README and "shared/" not in README


def test_every_tool_is_listed_with_what_it_writes():
    """docs/README.md's Tools table names every script in tools/ (one that writes nothing cited is
    removed, not left unlisted)."""
    table = (REPO / "docs" / "README.md").read_text().split("## Tools", 1)[1]
    listed = set(re.findall(r"^\| `([\w.]+)` \|", table, re.M))
    helpers = {"noop_ffi_kernel.c"}  # built by host_ratio.py and native_cpu_cost.py, named in their row
    assert listed | helpers == {p.name for p in (REPO / "tools").iterdir() if p.is_file()}
    assert all("noop_ffi_kernel.c" in table for _ in helpers)
