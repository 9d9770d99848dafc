"""The package's import graph, read from the source with `ast` (nothing is imported): every
`import` / `from ... import` of an attn_prologue module, at module level or inside a function."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# package-dir mapping of pyproject.toml: import name -> source folder
ROOTS = {
    "attn_prologue": REPO / "runtime",
    "attn_prologue.codegen": REPO / "codegen",
    "attn_prologue.generated": REPO / "generated",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    top_level: bool  # False: the import sits inside a function body


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@functools.cache  # ~400 generated modules to parse: once a session, not once a test
def edges() -> tuple[Edge, ...]:
    mods = modules()
    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                # `from pkg import sub` imports the submodule when one exists
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != module and t.startswith("attn_prologue"):
                    out.append(Edge(module, t, id(node) in top))
    return tuple(out)


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Longest import chain below each module (0: imports nothing of ours). Raises on a cycle."""
    memo: dict[str, int] = {}
    visiting: list[str] = []

    def depth(m: str) -> int:
        if m in memo:
            return memo[m]
        if m in visiting:
            raise ValueError("import cycle: " + " -> ".join(visiting[visiting.index(m) :] + [m]))
        visiting.append(m)
        memo[m] = 1 + max((depth(d) for d in graph.get(m, ())), default=-1)
        visiting.pop()
        return memo[m]

    for m in graph:
        depth(m)
    return memo
