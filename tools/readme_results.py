"""The results tables, rendered from the committed result files (every row names its file), so
that no number in them is typed by hand: docs/results.md's full tables and the README's short one.

    python tools/readme_results.py           # print docs/results.md's section
    python tools/readme_results.py --write   # put both between their markers (README.md, docs/results.md)

tests/test_readme.py fails when either section is not what this renders. After a new result file
(tools/time_build.py, tools/time_tests.py, `bench --json`, tests/gpu/run_suite.sh), run `--write`.
The history behind each file (earlier runs, commits) is in results/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
PAGE = REPO / "docs" / "results.md"  # the full tables; the README has the short one
BEGIN = "<!-- results: rendered by tools/readme_results.py from results/; edit those, then run it -->"
END = "<!-- results: end -->"
# the newest first: a target measured on as many shapes in two files is read from the newer
BENCHES = (
    "bench-h200-writers.json",
    "bench-h200-targets.json",
    "bench-h200-records.json",
    "bench-h200-modes.json",
)
HOST_RATIO = "host-ratio/native-2654f5f-{}.json"  # the three runs of the current native path
HOST_ROWS = (  # (ratio key, what it is)
    ("one-call function", "one-call function `ap.qnorm_rope_kv_insert`"),
    ("bound op", "bound op (`ap.bind`)"),
    ("torch op", "`torch.ops.attn_prologue.qnorm_rope_kv_insert`"),
    ("one-call kv function", "KV-only function `ap.kv_rope_insert`"),
    ("bound kv op", "bound KV-only op (`ap.bind_kv`)"),
    ("torch kv op", "`torch.ops.attn_prologue.kv_rope_insert`"),
)


BASE = "../results/"  # how the page being rendered reaches results/ (docs/results.md; README: results/)


def _file(name: str) -> str:
    return f"[`{name}`]({BASE}{name})"


def _json(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _table(head: tuple[str, ...], rows: list[tuple]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def _unit(target: str):
    """How a target's values read: (number format, unit)."""
    if "of copy" in target:
        return (lambda x: f"{100 * x:.1f}"), "%"
    if target.endswith(": us") or "us per call" in target:
        return (lambda x: f"{x:.2f}"), " us"
    return (lambda x: f"{x:.2f}"), "x"


def _span(values, target: str) -> str:
    fmt, unit = _unit(target)
    lo, hi = fmt(min(values)), fmt(max(values))
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def correctness() -> list[str]:
    rows = []
    for name, what in (
        ("gpu-suite-h200.json", "the GPU suite (`tests/gpu`, on an H200): every sm_90a variant and launch knob "
         "bit-exact against the reference, bad inputs, graphs, the native path"),
        ("gpu-database-h200.json", "every (module, launch config) the shipped tuning database picks, at its "
         "bucket's size (`tests/gpu/test_database_gpu.py`, on an H200)"),
    ):  # fmt: skip
        run = _json(name)  # a run_suite.sh result file
        rows.append((what, f"{run['passed']} passed, {run['failures'] + run['errors']} failed "
                     f"(at {run['provenance']['git_commit'][:7]}, {run['provenance']['date'][:10]})", _file(name)))  # fmt: skip
    root = ET.parse(RESULTS / "compat-gpu-h200.xml").getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    failed = int(s.get("failures")) + int(s.get("errors"))
    rows.append(("vLLM's op names on the kernels (`tests/gpu/test_compat_gpu.py`, on an H200)",
                 f"{int(s.get('tests')) - failed - int(s.get('skipped'))} passed, {failed} failed",
                 _file("compat-gpu-h200.xml")))  # fmt: skip
    cpu = _json("tests-cpu.json")
    if cpu:
        c = cpu["counts"]
        rows.append(("the CPU tests (the README's test command)",
                     f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped (GPU tests)",
                     _file("tests-cpu.json")))  # fmt: skip
    return _table(("what", "result", "file"), rows)


def _speed_targets() -> dict[str, tuple[str, list[dict]]]:
    """target -> (the bench file that measured it on the most shapes, its checked rows)."""
    sys.path.insert(0, str(REPO))
    from attn_prologue.lab.targets import check_targets

    by_target: dict[str, tuple[str, list[dict]]] = {}
    for name in BENCHES:
        checked = check_targets(_json(name))
        for target in dict.fromkeys(r["target"] for r in checked):
            mine = [r for r in checked if r["target"] == target]
            if len(mine) > len(by_target.get(target, ("", []))[1]):
                by_target[target] = (name, mine)
    return by_target


def speed() -> list[str]:
    rows = []
    for target, (name, mine) in _speed_targets().items():
        label = target + (" (host-dependent)" if mine[0]["kind"] == "host" else "")
        bound = f"{'>=' if mine[0]['side'] == 'min' else '<='} {_span([mine[0]['bound']], target)}"
        met = sum(r["met"] for r in mine)
        rows.append(
            (label, bound, _span([r["measured"] for r in mine], target), f"{met} of {len(mine)}", _file(name))
        )
    return _table(
        ("target (H200, bf16, D=512, block 64; CUDA-graph replay)", "bound", "measured", "met", "file"), rows
    )


def host_cost() -> list[str]:
    runs = [_json(HOST_RATIO.format(i)) for i in (1, 2, 3)]
    rows = []
    for key, what in HOST_ROWS:
        bound = runs[0]["targets"][key]["bound"]
        ratios = [r["ratio_to_add"][key] for r in runs]
        met = sum(r["targets"][key]["met"] for r in runs)
        rows.append((what, f"<= {bound:.2f}x", "/".join(f"{x:.2f}x" for x in ratios), f"{met} of 3"))
    files = ", ".join(_file(HOST_RATIO.format(i)) for i in (1, 2, 3))
    return _table(("eager T=1 call (H=P=64, D=512), host time / torch's `x.add_(1)`", "bound", "three runs", "met"), rows) + [
        "",
        f"Files: {files} (`python tools/host_ratio.py`).",
    ]  # fmt: skip


def _machine(m: dict) -> str:
    return f"{m['cpus']} cores, {m['cpu']}"


def build_time() -> list[str]:
    rows = []
    for name in ("build-cpu.json", "build-cpu-sm90a.json"):
        b = _json(name)
        if b is None:
            continue
        native = ", ".join(f"{p} {s:.0f} s" for p, s in b.get("native_seconds", {}).items()) or "not recorded"
        rows.append((f"`{b['build_command'].replace(' (into an empty cache)', '')}`, empty cache",
                     b["kernels"], f"{b['wall_seconds']:.0f} s", f"{b['compile_seconds']['median']:.2f} s", native,
                     _machine(b["machine"]), _file(name)))  # fmt: skip
    return _table(
        ("command", "kernels", "wall", "median per kernel", "native parts", "machine", "file"), rows
    )


def test_time() -> list[str]:
    rows = []
    for name, how in (
        ("tests-cpu.json", "idle machine"),
        ("tests-cpu-concurrent.json", "beside a full build"),
    ):
        t = _json(name)
        if t is None:
            rows.append((how, "not measured yet", f"`python tools/time_tests.py{' --concurrent-build' if 'conc' in name else ''} --json results/{name}`", "", ""))  # fmt: skip
            continue
        s = t["session_build"] or {}
        reuse = f"{s.get('reused', 0)} of {s.get('kernels', '?')} kernels reused" if s else "no session build"
        c = t["counts"]
        rows.append((f"{how}: `{t['command']}`", f"{t['wall_seconds'] / 60:.1f} min", f"{c['passed']} passed, {c['skipped']} skipped",
                     reuse, f"{_machine(t['machine'])}; {_file(name)}"))  # fmt: skip
    return _table(("the test command's pytest step", "wall", "tests", "session build", "machine, file"), rows)


def readme_commands() -> list[str]:
    rows = []
    for name, how in (
        ("readme-commands-cpu.json", "idle machine"),
        ("readme-commands-cpu-concurrent.json", "beside a full build kept running"),
    ):
        r = _json(name)
        if r is None:
            continue
        main, install, pytest_step = (r["steps"] + [None, None, None])[:3]
        total = install["wall_seconds"] + pytest_step["wall_seconds"] if pytest_step else None
        rows.append((how, f"{main['wall_seconds'] / 60:.1f} min, exit {main['returncode']}",
                     f"{total / 60:.1f} min, exit {pytest_step['returncode']}" if total else "not run",
                     "passed" if r["passed"] else "**failed**",
                     f"{r['provenance']['git_commit'][:7]}; {_file(name)}"))  # fmt: skip
    return _table(
        ("the two commands, verbatim", "main command", "test command", "verdict", "commit, file"), rows
    )


def short() -> list[str]:
    """The README's table: one row per kind of result, the detail in docs/results.md."""
    suite, cpu, build = _json("gpu-suite-h200.json"), _json("tests-cpu.json"), _json("build-cpu.json")
    rows = [("the GPU suite on an H200 (bit-exact against the reference, bad inputs, graphs)",
             f"{suite['passed']} passed, {suite['failures'] + suite['errors']} failed (at "
             f"{suite['provenance']['git_commit'][:7]})", _file("gpu-suite-h200.json"))]  # fmt: skip
    if cpu:
        c = cpu["counts"]
        rows.append(("the CPU tests (the test command)",
                     f"{c['passed']} passed, {c['failures'] + c['errors']} failed in {cpu['wall_seconds'] / 60:.1f} min",
                     _file("tests-cpu.json")))  # fmt: skip
    checked = [r for _, mine in _speed_targets().values() for r in mine]
    rows.append(("speed targets on an H200, each shape of each target",
                 f"{sum(r['met'] for r in checked)} of {len(checked)} met", "[the tables](docs/results.md#speed)"))  # fmt: skip
    host = [_json(HOST_RATIO.format(i)) for i in (1, 2, 3)]
    met = sum(h["targets"][key]["met"] for h in host for key, _ in HOST_ROWS)
    rows.append(("host cost of an eager call, in `x.add_(1)`s (three runs)",
                 f"{met} of {3 * len(HOST_ROWS)} met", "[the table](docs/results.md#host-cost-per-eager-call)"))  # fmt: skip
    rows.append(("`build`, every kernel for every default target, no GPU",
                 f"{build['kernels']} kernels in {build['wall_seconds']:.0f} s ({_machine(build['machine'])})",
                 _file("build-cpu.json")))  # fmt: skip
    fresh = _json("readme-commands-cpu.json")
    if fresh:
        main, install, pytest_step = (fresh["steps"] + [None, None, None])[:3]
        tests = (
            f"{(install['wall_seconds'] + pytest_step['wall_seconds']) / 60:.1f} min"
            if pytest_step
            else "not run"
        )
        rows.append(("the two commands on a fresh clone",
                     f"{'passed' if fresh['passed'] else '**failed**'}: {main['wall_seconds'] / 60:.1f} min and "
                     f"{tests} (at {fresh['provenance']['git_commit'][:7]})", _file("readme-commands-cpu.json")))  # fmt: skip
    return _table(("what", "result", "file"), rows)


def render_short() -> str:
    """The README's section, markers included."""
    global BASE
    BASE, saved = "results/", BASE
    try:
        return "\n".join([BEGIN, "", *short(), "", END])
    finally:
        BASE = saved


def render() -> str:
    """docs/results.md's section, markers included."""
    parts = [
        BEGIN,
        "",
        "### Correctness",
        "",
        *correctness(),
        "",
        "### Speed",
        "",
        "Each target as `python -m attn_prologue targets <file>` checks it; a copy is a device copy of the bytes "
        "the op must move, measured in the same run.",
        "",
        *speed(),
        "",
        "Against vLLM's own kernels: no committed result file compares them yet.",
        "",
        "### Host cost per eager call",
        "",
        *host_cost(),
        "",
        "### Build time",
        "",
        "`python tools/time_build.py`; no GPU needed.",
        "",
        *build_time(),
        "",
        "### Test time",
        "",
        "`python tools/time_tests.py`.",
        "",
        *test_time(),
        "",
        "### The two commands on a new machine",
        "",
        "`python tools/readme_commands.py`: a fresh clone, virtual environment and kernel cache; the test "
        "command's pytest step through `tools/time_tests.py`.",
        "",
        *readme_commands(),
        "",
        END,
    ]
    return "\n".join(parts)


def section(text: str) -> str:
    """The README's rendered section, markers included ("" if the markers are missing)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write", action="store_true", help="replace both pages' sections (default: print docs/results.md's)"
    )
    args = parser.parse_args()
    if not args.write:
        print(render())
        return 0
    for page, text in ((REPO / "README.md", render_short()), (PAGE, render())):
        old = page.read_text()
        if not section(old):
            print(f"{page.name} has no section between {BEGIN!r} and {END!r}", file=sys.stderr)
            return 1
        page.write_text(old.replace(section(old), text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
