"""Time the main job's build from an empty kernel cache and record it: wall time (the kernels, then
the native parts), kernels built per target, each kernel's compile time, and the machine, with
provenance.

    python tools/time_build.py --json results/build-cpu.json
    python tools/time_build.py --targets sm_90a --json results/build-cpu-sm90a.json   # one GPU type
    python tools/time_build.py --json out.json --keep-cache /tmp/after   # keep the kernels it built

The README's build-time and kernel-count claims come from these files (tests/test_readme.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from attn_prologue.lab.provenance import provenance


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    """The facts a CPU timing depends on (tools/time_tests.py records the same)."""
    return {"cpus": os.cpu_count(), "cpu": cpu_model(), "system": platform.platform()}


class BesideBuild:
    """A full clean `python -m attn_prologue build` kept running beside other work until `stop()`:
    each into an empty cache under `root` (removed once done), restarted whenever one finishes."""

    def __init__(self, root: Path):
        self.root, self.runs, self._stop = root, [], threading.Event()
        self.command = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir"]
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            cache = self.root / f"cache-{len(self.runs)}"
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [*self.command, str(cache)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            while proc.poll() is None and not self._stop.wait(1.0):
                pass
            finished = proc.poll() is not None
            if not finished:
                proc.terminate()
                proc.wait()
            self.runs.append({"wall_seconds": round(time.perf_counter() - t0, 1),
                              "returncode": proc.returncode if finished else None})  # fmt: skip
            shutil.rmtree(cache, ignore_errors=True)

    def stop(self) -> dict:
        """End the build in progress; what ran: the command, and each build's time and exit status
        (None: stopped before it finished)."""
        self._stop.set()
        self._thread.join()
        return {
            "command": shlex.join(["python", *self.command[1:4]]) + " (each into an empty cache of its own)",
            "builds": self.runs,
            "completed": sum(r["returncode"] == 0 for r in self.runs),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the record")
    parser.add_argument("--targets", help="passed to `build --targets` (default: build's default targets)")
    parser.add_argument("--keep-cache", type=Path, help="build into this new directory and keep it (default: a "
                        "temporary one, removed), e.g. for tools/same_kernels.py")  # fmt: skip
    args = parser.parse_args()
    if args.keep_cache is not None and args.keep_cache.exists():
        parser.error(f"--keep-cache {args.keep_cache} exists: the build must start from an empty cache")
    with tempfile.TemporaryDirectory(prefix="attn-prologue-build-") as tmp:
        report = Path(tmp) / "report.json"
        cache = args.keep_cache if args.keep_cache is not None else Path(tmp) / "cache"
        cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(cache),
               "--report", str(report)] + (["--targets", args.targets] if args.targets else [])  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return proc.returncode
        metas = json.loads(report.read_text())
    per_target: dict[str, int] = {}
    for m in metas:
        per_target[m["target"]] = per_target.get(m["target"], 0) + 1
    seconds = sorted(m["compile_seconds"] for m in metas)
    record = {
        "provenance": provenance(),
        "machine": machine(),
        "build_command": shlex.join(["python", *cmd[1:4], *cmd[8:]]) + " (into an empty cache)",
        "wall_seconds": round(wall, 1),
        "kernels_wall_seconds": float(re.search(r"kernels ready .* in ([\d.]+)s wall", proc.stdout)[1]),
        "native_seconds": {
            p: float(t)
            for p, t in re.findall(r"^build: native (\w+) -> .* \(([\d.]+)s\)$", proc.stdout, re.M)
        },
        "kernels": len(metas),
        "kernels_per_target": dict(sorted(per_target.items())),
        "compile_seconds": {
            "sum": round(sum(seconds), 1),
            "median": seconds[len(seconds) // 2],
            "max": seconds[-1],
            "per_kernel": {
                f"{m['variant']}:{m['target']}:{m['config']}": m["compile_seconds"] for m in metas
            },
        },
    }
    Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    print(f"built {len(metas)} kernels in {wall:.1f} s wall on {os.cpu_count()} CPUs ({cpu_model()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
