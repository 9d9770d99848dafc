"""Where a result came from: the command line, the code (git commit, uncommitted changes), the date,
the GPU and the versions. Every lab tool writes it into its result file under "provenance", so a
number can be traced to what produced it without a note beside it."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from .. import env, tuning
from ..jit import compiler

# the attn_prologue package: runtime/ of the checkout in an editable install
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def provenance(argv: list[str] | None = None, device=None) -> dict:
    """The provenance of a result made now by this process on `device` (default: the current one).

    argv defaults to sys.argv; "command" is then the interpreter's own command line (sys.orig_argv:
    `python -m attn_prologue bench ...` as typed), shell-quoted. A script that runs Python as one of
    its steps passes its own argv, which is then both "argv" and, quoted, "command"."""
    if argv is None:
        argv, command = list(sys.argv), shlex.join(sys.orig_argv)
    else:
        argv, command = list(argv), shlex.join(argv)
    return {
        "argv": argv,
        "command": command,
        **git_state(PACKAGE_DIR),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_facts(device),
        "versions": versions(),
        "tuning_database": tuning_database_facts(),
    }


def tuning_database_facts() -> dict:
    """The tuning database the dispatcher reads ($ATTN_PROLOGUE_TUNING_DB or the shipped one): its
    path, whether it is the shipped one, and the sha256 of its bytes (None: no such file)."""
    path = tuning.database_path()
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        digest = None
    return {"path": str(path), "shipped": Path(path) == tuning.shipped_database_path(), "sha256": digest}


def git_state(directory: Path) -> dict:
    """{"git_commit", "git_dirty"} of the git work tree holding `directory`. Both are None when
    there is none, when `directory` is not tracked in it (an install inside someone else's
    repository) or when git is missing. Untracked files do not make it dirty: result files written
    into the checkout would, on every run after the first."""
    unknown = {"git_commit": None, "git_dirty": None}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(directory), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    told = copied_tree_state()
    if told is not None:  # the copier knows better than a .git that may have come along stale
        return told
    try:
        commit = git("rev-parse", "HEAD")
        if not git("ls-files", "--", "."):
            return unknown
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return unknown
    return {"git_commit": commit, "git_dirty": dirty}


ENV_SOURCE = "ATTN_PROLOGUE_SOURCE"


def copied_tree_state() -> dict | None:
    """For a copied tree (e.g. on a GPU machine, whose copy may carry a stale .git or none): the state
    the copier recorded in $ATTN_PROLOGUE_SOURCE as `<commit>` or `<commit>+dirty` (a full or abbreviated
    hash), marked as told
    rather than read. It wins over git when set."""
    told = env.get(ENV_SOURCE)
    commit, _, flag = told.partition("+")
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit) or flag not in ("", "dirty"):  # (a short hash too)
        return None
    return {"git_commit": commit, "git_dirty": flag == "dirty", "git_state_from": ENV_SOURCE}


def device_facts(device=None) -> dict | None:
    """Name, compute capability and SM count of a CUDA device (None without CUDA); for a CPU device,
    the machine and its cores."""
    if device is not None and torch.device(device).type == "cpu":
        cores = os.cpu_count()
        return {"name": f"CPU ({platform.machine()}, {cores} cores)", "cpu_count": cores}
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
    }


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **compiler.dsl_versions(),
        "attn-prologue": importlib.metadata.version("attn-prologue"),
    }
