"""Time the README's test command's pytest step (`python -m pytest -q -n 2`) and record it: wall time,
pass/fail/skip counts, the session build (kernels reused from the main command's cache, its seconds),
the slowest tests, and the machine, with provenance.

    python tools/time_tests.py --json results/tests-cpu.json                       # an idle machine
    python tools/time_tests.py --concurrent-build --json results/tests-cpu-concurrent.json

`--concurrent-build` keeps a full `python -m attn_prologue build` running beside the tests, each into
an empty cache of its own and restarted whenever one finishes (a busy machine), and records those
builds' times too. `--clean` makes the
session build compile everything instead of reusing the main command's kernels (what CI does). Run
it from the repository root after the README's first command. The README's test-time claims come
from these files (tests/test_readme.py).
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
import xml.etree.ElementTree as ET
from pathlib import Path

from attn_prologue.lab.provenance import provenance
from time_build import BesideBuild, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.support.build import ENV_CLEAN, ENV_RECORD  # noqa: E402  (the session build's switches)

PYTEST = ["-m", "pytest", "-q", "-n", "2"]  # the README's test command's pytest step, verbatim


def counts(junit: Path) -> dict:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    c = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": c["tests"] - c["failures"] - c["errors"] - c["skipped"], **c}


def slowest(output: str, n: int = 10) -> list[dict]:
    """The slowest phases from pytest's --durations table."""
    rows = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$", output, re.M)
    return [{"seconds": float(s), "phase": phase, "test": test} for s, phase, test in rows[:n]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the record")
    parser.add_argument(
        "--concurrent-build", action="store_true", help="run a full clean `build` beside the tests"
    )
    parser.add_argument("--clean", action="store_true", help="the session build compiles every kernel (CI)")
    parser.add_argument(
        "pytest_args", nargs="*", help="after --: extra pytest arguments (a subset; recorded in `command`)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="attn-prologue-tests-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, ENV_RECORD: str(tmp / "session-build.json")}
        if args.clean:
            env[ENV_CLEAN] = "1"
        beside = BesideBuild(tmp / "beside") if args.concurrent_build else None
        load_before = os.getloadavg()
        extra = ["--junitxml", str(tmp / "junit.xml"), "--durations", "10"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, *PYTEST, *args.pytest_args, *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
        )
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
        concurrent = beside.stop() if beside is not None else None
        if not (tmp / "junit.xml").exists():
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return proc.returncode or 1
        record_file = tmp / "session-build.json"
        session = json.loads(record_file.read_text()) if record_file.exists() else None
        summary = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
        record = {
            "provenance": provenance(),
            "machine": {**machine(), "load_average_1min": {"before": load_before[0], "after": load_after[0]}},
            "command": shlex.join(["python", *PYTEST, *args.pytest_args]),
            "clean_build": args.clean,
            "wall_seconds": round(wall, 1),
            "returncode": proc.returncode,
            "counts": counts(tmp / "junit.xml"),
            "summary": summary[-1] if summary else None,
            "session_build": session,
            "concurrent_build": concurrent,
            "slowest": slowest(proc.stdout),
        }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    for line in proc.stdout.splitlines():  # pytest's short summary (-rfE): which tests failed
        if line.startswith(("FAILED ", "ERROR ")):
            print(line)
    c = record["counts"]
    print(
        f"pytest: {c['passed']} passed, {c['failures']} failed, "
        f"{c['errors']} errors, {c['skipped']} skipped in {wall:.0f} s wall on {os.cpu_count()} CPUs "
        f"(exit {proc.returncode}) -> {args.json}"
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
