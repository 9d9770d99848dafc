"""`generate`: render every supported variant into generated/, deterministically, writing only what
changed and pruning what no longer exists; `generate --check` compares without writing."""

from __future__ import annotations

import difflib
import time
from importlib import resources
from pathlib import Path

from .render import render_registry, render_variant
from .variants import variant_space

REGENERATE = "python -m attn_prologue generate"
KERNELS_INIT = '"""Generated kernel modules, one per variant (see ../MANIFEST)."""\n'


def default_out_dir() -> Path:
    return Path(str(resources.files("attn_prologue.generated")))


def render_all() -> dict[str, str]:
    """Relative path -> file text for everything under generated/ that generate owns."""
    variants = variant_space()
    files = {
        "MANIFEST": "".join(f"{v.name}\n" for v in variants),
        "registry.py": render_registry(variants),
        "kernels/__init__.py": KERNELS_INIT,
    }
    for v in variants:
        files[f"kernels/{v.name}.py"] = render_variant(v)
    return files


def _owned_on_disk(out: Path) -> set[str]:
    on_disk = {"MANIFEST", "registry.py"} & {p.name for p in out.iterdir()} if out.exists() else set()
    kernels = out / "kernels"
    if kernels.exists():
        on_disk |= {f"kernels/{p.name}" for p in kernels.glob("*.py")}
    return on_disk


def write(out: Path | None = None) -> dict:
    out = out or default_out_dir()
    t0 = time.perf_counter()
    files = render_all()
    written = 0
    for rel, text in files.items():
        path = out / rel
        if path.exists() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        written += 1
    stale = sorted(_owned_on_disk(out) - set(files))
    for rel in stale:
        (out / rel).unlink()
    return {
        "variants": len(files) - 3,
        "written": written,
        "removed": len(stale),
        "seconds": time.perf_counter() - t0,
        "out": str(out),
    }


def check(out: Path | None = None, max_diff_lines: int = 40) -> tuple[bool, str]:
    """(up to date?, report). The report is a short diff and the command to run."""
    out = out or default_out_dir()
    files = render_all()
    problems: list[str] = []
    diff_lines: list[str] = []
    for rel, text in sorted(files.items()):
        path = out / rel
        if not path.exists():
            problems.append(f"missing: generated/{rel}")
            continue
        current = path.read_text()
        if current != text:
            problems.append(f"stale:   generated/{rel}")
            if len(diff_lines) < max_diff_lines:
                diff_lines += list(
                    difflib.unified_diff(
                        current.splitlines(),
                        text.splitlines(),
                        f"generated/{rel}",
                        f"rendered/{rel}",
                        lineterm="",
                        n=1,
                    )
                )
    for rel in sorted(_owned_on_disk(out) - set(files)):
        problems.append(f"extra:   generated/{rel}")
    if not problems:
        return True, f"generated/ is up to date ({len(files) - 3} variants)"
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    report = "\n".join(
        shown + diff_lines[:max_diff_lines] + [f"generated/ is out of date: run `{REGENERATE}`"]
    )
    return False, report
