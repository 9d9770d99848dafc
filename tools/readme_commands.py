"""Run the README's two commands as a new user would and record what happened: a fresh clone of this
repository's HEAD, a fresh virtual environment, an empty kernel cache, then the main command and the
test command, each read from the README (section "The two commands"), with wall times, exit codes and
counts, the machine and provenance.

    python tools/readme_commands.py --json results/readme-commands-cpu.json
    python tools/readme_commands.py --concurrent-build --json results/readme-commands-cpu-concurrent.json

The main command and the test command's install steps run verbatim (`bash -c`). The test command's
last step, `python -m pytest -q -n 2`, runs through tools/time_tests.py (the same pytest command plus
`--junitxml` and `--durations`, which only report), which also writes the test-time record
(`--tests-json`, default results/tests-cpu.json, or results/tests-cpu-concurrent.json with
`--concurrent-build`). With `--concurrent-build` a full clean `build` into an empty cache of its own
runs beside both commands the whole time (restarted whenever one finishes), the busy machine of a
developer who builds while testing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attn_prologue.lab.provenance import git_state, provenance
from time_build import BesideBuild, machine
from time_tests import PYTEST

REPO = Path(__file__).resolve().parents[1]
PYTEST_STEP = shlex.join(["python", *PYTEST])  # what tools/time_tests.py runs: the README's must match


def readme_commands(readme: Path) -> tuple[str, str]:
    """The main command and the test command: the two shell blocks of "## The two commands"."""
    text = readme.read_text()
    section = text[text.index("## The two commands") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"^```sh[^\n]*\n(.*?)^```", section, re.M | re.S)
    if len(blocks) != 2:
        raise SystemExit(f"expected 2 command blocks under 'The two commands', found {len(blocks)}")
    return tuple(b.strip() for b in blocks)  # type: ignore[return-value]


def run(command: str, cwd: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if not ln.startswith("WARNING: Location")]  # pip's index notes
    return {
        "command": command,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "returncode": proc.returncode,
        "output_tail": lines[-12:],
    }


def _shown(path: Path) -> str:
    """A path as the record shows it: relative to the repository when inside it (results/...)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the record")
    parser.add_argument(
        "--tests-json", help="the test-time record tools/time_tests.py writes (default: by mode)"
    )
    parser.add_argument(
        "--concurrent-build", action="store_true", help="keep a clean full build running beside"
    )
    args = parser.parse_args()
    tests_json = Path(
        args.tests_json
        or REPO / "results" / f"tests-cpu{'-concurrent' if args.concurrent_build else ''}.json"
    )
    main_cmd, test_cmd = readme_commands(REPO / "README.md")
    if not test_cmd.endswith(PYTEST_STEP):
        raise SystemExit(f"the test command no longer ends with {PYTEST_STEP!r}: {test_cmd}")
    install_steps = test_cmd[: -len(PYTEST_STEP)].rstrip().removesuffix("&&").rstrip()
    with tempfile.TemporaryDirectory(prefix="attn-prologue-readme-") as tmp:
        tmp = Path(tmp)
        clone = tmp / "clone"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
        venv_bin = tmp / "venv" / "bin"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            PATH=f"{venv_bin}:{env.get('PATH', '')}",
            VIRTUAL_ENV=str(tmp / "venv"),
            ATTN_PROLOGUE_CACHE=str(tmp / "cache"),
        )  # fmt: skip  (an empty cache: a new user's)
        beside = BesideBuild(tmp / "beside") if args.concurrent_build else None
        load_before = os.getloadavg()
        steps = [run(main_cmd, clone, env)]
        if steps[0]["returncode"] == 0:
            steps.append(run(install_steps, clone, env))
        if beside is not None:
            beside_main = beside.stop()
        if steps[-1]["returncode"] == 0 and len(steps) == 2:
            tool = [str(venv_bin / "python"), "tools/time_tests.py", "--json", str(tmp / "tests.json")]
            tool += ["--concurrent-build"] if args.concurrent_build else []
            step = run(" ".join(tool), clone, env)
            step["command"] = (
                f"{PYTEST_STEP} (through tools/time_tests.py{' --concurrent-build' if args.concurrent_build else ''})"
            )
            steps.append(step)
            if (tmp / "tests.json").exists():
                tests_json.write_text((tmp / "tests.json").read_text())
        record = {
            "provenance": {**provenance(), **git_state(clone)},  # the clone's commit: what ran
            "machine": {**machine(), "load_average_1min_before": load_before[0]},
            "fresh": "a git clone of HEAD, a new virtual environment, an empty ATTN_PROLOGUE_CACHE",
            "concurrent_build": beside_main if beside is not None else None,
            "steps": steps,
            "tests_record": _shown(tests_json) if len(steps) == 3 else None,
            "passed": all(s["returncode"] == 0 for s in steps) and len(steps) == 3,
        }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    for s in steps:
        print(f"{s['wall_seconds']:8.1f} s  exit {s['returncode']}  {s['command']}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
