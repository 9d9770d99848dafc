"""Make a virtual environment that holds this package under serving engines' pins, and the engines.

    python tools/engine_env.py VENV --pins vllm==0.33.0 --pins sglang==0.5.23 \\
        --engine vllm==0.33.0 --engine vllm==0.34.0 --engine sglang==0.5.23

1. Each named release's wheel is downloaded without its dependencies (`pip download --no-deps`) into a
   cache (`--wheel-cache`, default ~/.cache/attn_prologue/engine-wheels), once.
2. The constraints: every `==` pin that a `--pins` wheel's own metadata (Requires-Dist) puts on a
   package this package depends on, read from the wheel, never retyped. Two engines pinning one
   package differently is an error. torch is the exception: the engines pin CUDA builds (gigabytes,
   and useless without a GPU), so the CPU build `CPU_TORCH` stands in for them (this package declares
   `torch>=2.6`, which their pins satisfy too).
3. VENV gets the CPU torch, this package with its test extra under those constraints, and the small
   pure-Python packages the engines' Python modules import (`ENGINE_IMPORTS`, pinned here).
4. Each `--engine` wheel goes, without dependencies, into its own folder VENV/engines/NAME-VERSION,
   with what only that engine imports (`ENGINE_EXTRAS`): put one on PYTHONPATH to test against that
   release (vLLM 0.33.0 and 0.34.0 cannot share a venv).

It writes VENV/engine-env.json: the constraints and where they came from, and each engine's folder.
Never run `pip install vllm` (or sglang) with its dependencies on a CPU machine: it pulls the CUDA torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_TORCH = "torch==2.13.0"
# what `import vllm.plugins`, vLLM's DSv4 modules and sglang's plugin and DSv4 modules import on a CPU
# machine, beyond this package's own dependencies (found by importing them in a bare venv)
ENGINE_IMPORTS = [
    "aiohttp==3.14.5", "blake3==1.0.11", "cachetools==8.0.3", "cbor2==6.3.0", "cloudpickle==3.1.3",
    "einops==0.8.2", "fastapi==0.165.0", "llguidance==1.9.1", "msgspec==0.23.0", "openai==3.63.0",
    "packaging==26.4", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0", "prometheus_client==0.26.0",
    "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pydantic==2.14.4", "PyYAML==6.0.4",
    "pyzmq==27.3.0", "regex==2026.12.2", "requests==2.34.2", "sentencepiece==0.2.3", "tqdm==4.70.1",
    "transformers==5.20.2", "urllib3==2.8.0", "uvloop==0.23.0",
]  # fmt: skip
ENGINE_IMPORTS_NO_DEPS = ["xgrammar==0.2.8", "openai-harmony==0.0.8"]  # their own pins would pull torch
# what one engine's modules import beyond those, at that engine's own pins where they differ from
# another's (SGLang pins openai 2.8.0, vLLM wants >= 2.25): installed without dependencies into the
# engine's own folder, so they are on the path only beside that engine
ENGINE_EXTRAS = {
    "sglang": [
        "asttokens==3.0.2", "compressed-tensors==0.18.0", "dill==0.4.1", "distro==1.9.0", "executing==2.3.0",
        "gguf==0.19.0", "httpcore==1.0.9", "httpx==0.29.0", "huggingface_hub==1.33.0", "ipython==9.19.1",
        "ipython_pygments_lexers==1.1.1", "jedi==0.20.1", "kernels==0.19.1", "loguru==0.7.3",
        "matplotlib-inline==0.2.2", "openai==2.8.0", "orjson==3.13.0", "parso==0.8.7", "pexpect==4.9.0",
        "prompt_toolkit==3.0.53", "ptyprocess==0.7.0", "pure_eval==0.2.4", "sentencepiece==0.2.1",
        "stack-data==0.6.3", "tokenizers==0.23.2", "tomlkit==0.15.3", "traitlets==5.16.1",
        "torchvision==0.28.0", "transformers==5.19.0", "triton==3.9.0", "wcwidth==0.9.5",
    ],
    "tokenspeed-kernel": ["tokenspeed-triton==3.8.10.post20260920"],
}  # fmt: skip


def run(*cmd: str, env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def wheel(spec: str, cache: Path) -> Path:
    """The cached wheel of `name==version`, downloaded once."""
    name, version = spec.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(cache),
            spec,
        )
        found = [p for p in cache.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel of {spec} in {cache}, found {[p.name for p in found]}")
    return found[0]


def requires(whl: Path) -> list[str]:
    """The wheel's unconditional Requires-Dist lines (no extra, no environment marker)."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and ";" not in line
    ]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def our_dependencies() -> set[str]:
    """The names this package depends on (pyproject.toml), the DSL's split wheels included."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {canonical(re.match(r"[A-Za-z0-9_.-]+", d).group(0)) for d in deps}
    if "nvidia-cutlass-dsl" in names:
        names |= {f"nvidia-cutlass-dsl-libs-{part}" for part in ("base", "core", "cu12", "cu13")}
    return names


def constraints(pin_wheels: list[Path]) -> dict[str, tuple[str, str]]:
    """name -> (pin, the wheel it came from) for every == pin on one of our dependencies."""
    ours, out = our_dependencies(), {}
    for whl in pin_wheels:
        for req in requires(whl):
            m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*==\s*([^\s,;]+)$", req)
            if not m or canonical(m.group(1)) not in ours or canonical(m.group(1)) == "torch":
                continue
            name, version = canonical(m.group(1)), m.group(3)
            if name in out and out[name][0] != version:
                raise SystemExit(f"{whl.name} pins {name}=={version}, {out[name][1]} pins {out[name][0]}")
            out[name] = (version, whl.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path)
    ap.add_argument("--pins", action="append", default=[], metavar="NAME==VERSION",
                    help="an engine release whose pins constrain this package's dependencies")  # fmt: skip
    ap.add_argument("--engine", action="append", default=[], metavar="NAME==VERSION",
                    help="an engine release to unpack into VENV/engines/NAME-VERSION")  # fmt: skip
    ap.add_argument(
        "--wheel-cache", type=Path, default=Path("~/.cache/attn_prologue/engine-wheels").expanduser()
    )
    args = ap.parse_args()

    pins = constraints([wheel(s, args.wheel_cache) for s in args.pins])
    venv = args.venv.resolve()
    run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    lines = [CPU_TORCH] + [f"{name}=={version}" for name, (version, _) in sorted(pins.items())]
    venv.joinpath("constraints.txt").write_text("\n".join(lines) + "\n")
    # pip reads PIP_CONSTRAINT too (a machine may set one): ours joins it rather than replacing it
    env = dict(os.environ)
    env["PIP_CONSTRAINT"] = " ".join(
        filter(None, [env.get("PIP_CONSTRAINT", ""), str(venv / "constraints.txt")])
    )
    run(py, "-m", "pip", "install", "-q", CPU_TORCH, env=env)
    run(py, "-m", "pip", "install", "-q", "-e", f"{REPO}[test]", env=env)
    if args.engine:
        run(py, "-m", "pip", "install", "-q", *ENGINE_IMPORTS, env=env)
        run(py, "-m", "pip", "install", "-q", "--no-deps", *ENGINE_IMPORTS_NO_DEPS, env=env)
    folders = {}
    for spec in args.engine:
        folder = venv / "engines" / spec.replace("==", "-")
        if not folder.is_dir():
            extras = ENGINE_EXTRAS.get(spec.split("==")[0], [])
            run(py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder),
                str(wheel(spec, args.wheel_cache)), *extras, env=env)  # fmt: skip
        folders[spec] = str(folder)
    # what the venv holds now, against the pins (pip would have refused a conflict; say it plainly)
    freeze = subprocess.run([py, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    installed = {canonical(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", freeze, re.M)}
    wrong = {n: (v, installed.get(n)) for n, (v, _) in pins.items() if n in installed and installed[n] != v}
    if wrong:
        raise SystemExit(f"installed versions differ from the pins: {wrong}")
    record = {
        "constraints": {n: {"version": v, "pinned_by": w} for n, (v, w) in sorted(pins.items())},
        "torch": {"constraint": CPU_TORCH, "why": "the engines pin CUDA builds of torch"},
        "installed": {n: installed.get(n) for n in sorted(our_dependencies()) if n in installed},
        "engines": folders,
    }
    venv.joinpath("engine-env.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
