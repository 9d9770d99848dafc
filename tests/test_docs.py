"""The docs as tests: every fenced block of README.md, docs/*.md and results/README.md is read from
the markdown and checked by what its fence says it is (docs/README.md, "Code blocks, for
contributors"), so a renamed option, a changed signature or a stale schema fails here:

- `python`: runs on the CPU, in a fresh interpreter; `python gpu`: compiled here, run by
  tests/gpu/test_docs_gpu.py; `python fragment` (also `python gpu fragment`): compiled;
  `python signature`: equal to the function's signature; `schema`: equal to the registered op's;
- `sh`: each command's arguments parsed, then run; `sh slow` and `sh gpu`: parsed, scripts and
  tools checked (`--help`), never run;
- `text`: diagrams and formulas.

Inline `python -m attn_prologue ...` spans in the prose are parsed too."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import inspect
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import attn_prologue as ap
import pytest
import tomllib
import torch
from attn_prologue.cli import build_parser
from attn_prologue.codegen import package

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "README.md"]
KINDS = {"python", "python gpu", "python fragment", "python gpu fragment", "python signature", "schema"}
KINDS |= {"sh", "sh slow", "sh gpu", "text"}
FENCE = re.compile(r"^```(.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    kind: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if m:
                end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
                out.append(Block(page, i + 1, m[1].strip(), "\n".join(lines[i + 1 : end]) + "\n"))
                i = end
            i += 1
    return out


BLOCKS = blocks()


def of(*kinds: str) -> list:
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.kind in kinds]


def test_every_block_says_what_it_is():
    assert len(BLOCKS) > 20  # the pages were read
    unmarked = [f"{b.id}: ```{b.kind}" for b in BLOCKS if b.kind not in KINDS]
    assert not unmarked, "mark each block (docs/README.md, Code blocks): " + ", ".join(unmarked)


@pytest.mark.parametrize("block", of("python"))
def test_a_cpu_block_runs(block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU form, also on a machine with a GPU
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("block", of("python gpu", "python fragment", "python gpu fragment"))
def test_a_gpu_block_or_fragment_compiles(block):
    compile(block.code, block.id, "exec")


def _documented_signature(code: str) -> list[tuple[str, inspect.Signature]]:
    """`name(params) -> ret` blocks as (dotted name, signature), read by ast."""
    out = []
    for m in re.finditer(r"^([\w.]+)\((.*?)\)(?: -> [^\n]+)?$", code, re.M | re.S):
        fn = ast.parse(f"def f({m[2]}): pass").body[0]
        a = fn.args
        params = []
        defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
        for arg, default in zip(a.args, defaults):
            params.append(inspect.Parameter(arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                            default=inspect.Parameter.empty if default is None else ast.literal_eval(default)))  # fmt: skip
        for arg, default in zip(a.kwonlyargs, a.kw_defaults):
            params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                            default=inspect.Parameter.empty if default is None else ast.literal_eval(default)))  # fmt: skip
        out.append((m[1], inspect.Signature(params)))
    return out


def _resolve(dotted: str):
    obj = {"attn_prologue": ap}[dotted.split(".")[0]]
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("block", of("python signature"))
def test_a_documented_signature_is_the_functions(block):
    documented = _documented_signature(block.code)
    assert documented, f"{block.id}: no `name(...)` signature found"
    for name, sig in documented:
        real = inspect.signature(_resolve(name))
        plain = real.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in real.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
        assert str(sig) == str(plain), f"{block.id}: {name}"


def _registered_schemas() -> dict[str, str]:
    ops = torch.ops.attn_prologue
    return {
        f"attn_prologue::{n}": str(getattr(ops, n).default._schema)
        for n in ("qnorm_rope_kv_insert", "kv_rope_insert")
    }


@pytest.mark.parametrize("block", of("schema"))
def test_a_documented_schema_is_the_registered_one(block):
    registered = _registered_schemas()
    documented = re.split(r"\n(?=attn_prologue::)", " ".join(block.code.split(" ")).strip())
    seen = set()
    for text in documented:
        name = text.split("(")[0]
        assert " ".join(text.split()) == registered[name], f"{block.id}: {name}"
        seen.add(name)
    assert seen == set(registered)  # every op of the namespace is documented


# ---- commands ------------------------------------------------------------------------------------
def commands(code: str) -> list[tuple[dict, list[str]]]:
    """(environment, argv) per command: `\\` continuations joined, comments dropped, `&&` split."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        while tokens:
            cut = tokens.index("&&") if "&&" in tokens else len(tokens)
            cmd, tokens = tokens[:cut], tokens[cut + 1 :]
            env = {}
            while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):
                k, v = cmd.pop(0).split("=", 1)
                env[k] = v
            out.append((env, cmd))
    return out


def parse_cli(args: list[str], where: str) -> None:
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: `attn_prologue {shlex.join(args)}` does not parse (exit {exc.code})")


def _markers() -> set[str]:
    toml = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {m.split(":")[0] for m in toml["tool"]["pytest"]["ini_options"]["markers"]}


def check(env: dict, cmd: list[str], block: Block, tmp_path: Path) -> None:
    """Parse one command; run it too when the block is `sh`."""
    where, runs = block.id, block.kind == "sh"
    if (
        cmd[:3] in (["python", "-m", "attn_prologue"], ["python3", "-m", "attn_prologue"])
        or cmd[0] == "attn-prologue"
    ):
        args = cmd[3:] if cmd[0] != "attn-prologue" else cmd[1:]
        parse_cli(args, where)
        if runs:
            (tmp_path / "results").symlink_to(REPO / "results")  # paths as written, from the repo root
            proc = subprocess.run([sys.executable, "-m", "attn_prologue", *args], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=600, env={**os.environ, **env})  # fmt: skip
            assert proc.returncode == 0, (
                f"{where}: {shlex.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            )
        return
    assert not runs, f"{where}: a `sh` block runs only attn_prologue commands; mark `{cmd[0]}` slow or gpu"
    if cmd[0] == "torchrun":
        i = cmd.index("-m")
        assert cmd[i + 1] == "attn_prologue", where
        parse_cli(cmd[i + 2 :], where)
    elif cmd[:3] == ["python", "-m", "pytest"]:
        used = set(re.findall(r"\w+", " ".join(cmd[i + 1] for i, t in enumerate(cmd) if t == "-m" and i > 1)))
        assert used - {"not", "and", "or"} <= _markers(), where
    elif cmd[0] == "python" and cmd[1].startswith("tools/"):
        proc = subprocess.run(
            [sys.executable, cmd[1], "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and "usage:" in proc.stdout, (
            f"{where}: {cmd[1]} --help\n{proc.stderr[-2000:]}"
        )
        unknown = [opt for opt in cmd[2:] if opt.startswith("--") and opt.split("=")[0] not in proc.stdout]
        assert not unknown, f"{where}: {cmd[1]} has no option {unknown}"
    elif cmd[:2] == ["pip", "install"]:
        for arg in cmd[2:]:
            if arg.endswith(".whl"):
                assert_wheel_glob(arg, block)
            elif arg.startswith("."):
                extras = re.fullmatch(r"\.(?:\[(\w+)\])?", arg)
                assert extras, where
                optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
                    "optional-dependencies"
                ]
                assert extras[1] is None or extras[1] in optional, where
            else:
                assert arg == "-e" or re.fullmatch(r"torch==[\d.]+", arg), f"{where}: pip install {arg}"
    elif cmd[:2] == ["pip", "uninstall"]:  # a part the DSL brings that a page says may go: one it requires
        names = [arg for arg in cmd[2:] if not arg.startswith("-")]
        dsl = [re.match(r"[\w.-]+", r)[0] for r in importlib.metadata.requires("nvidia-cutlass-dsl") or ()]
        assert names and set(names) <= set(dsl), f"{where}: {names} (the DSL requires {dsl})"
    elif cmd[0].startswith("tests/gpu/"):
        script = REPO / cmd[0]
        assert os.access(script, os.X_OK), where
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, where
    elif cmd[0] == "nvcc":
        assert all((REPO / a).exists() for a in cmd if a.endswith(".cu")), where
    elif cmd[0] == "./launch_floor":
        assert any(c[:1] == ["nvcc"] and "launch_floor" in c for _, c in commands(block.code)), where
    else:
        pytest.fail(f"{where}: the docs test does not know how to check `{shlex.join(cmd)}` (teach it)")


def assert_wheel_glob(pattern: str, block: Block) -> None:
    """The wheel a `pip install dist/...*.whl` names is the one the block's package-kernels writes."""
    made = next(c for _, c in commands(block.code) if "package-kernels" in c)
    targets = made[made.index("--targets") + 1].split(",")
    out = made[made.index("--out") + 1]
    wheel = f"{out.rstrip('/')}/{package.wheel_file_name(targets, ap.__version__)}"
    assert fnmatch.fnmatch(wheel, pattern), f"{block.id}: `{pattern}` does not match {wheel}"


@pytest.mark.parametrize("block", of("sh", "sh slow", "sh gpu"))
def test_a_command_block_parses_and_cpu_ones_run(block, tmp_path):
    cmds = commands(block.code)
    assert cmds, block.id
    for env, cmd in cmds:
        check(env, cmd, block, tmp_path)


def test_inline_commands_in_the_prose_parse():
    spans = []
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for m in re.finditer(r"`((?:python -m attn_prologue|attn-prologue) [^`]+)`", " ".join(prose.split())):
            if not re.search(r"\.\.\.|<|\[| [A-Z]\b", m[1]):  # placeholders: prose, not a command
                spans.append((page.name, m[1]))
    assert len(spans) > 10
    for where, span in spans:
        args = shlex.split(span)
        parse_cli(args[3:] if args[0] == "python" else args[1:], where)


def test_the_ops_module_defines_the_package_functions():
    """op.md: `attn_prologue.ops.*` are the package's functions, not another form."""
    assert ap.ops.qnorm_rope_kv_insert is ap.qnorm_rope_kv_insert
    assert ap.ops.kv_rope_insert is ap.kv_rope_insert
