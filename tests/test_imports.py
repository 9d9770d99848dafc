"""The import graph: no cycle, every edge goes down the wings, imports at module level.

Wings, bottom up: device code (imports nothing of ours but device code), the generated modules (device code only)
and registry, data (variant space, formats, numerics, reference), the compile boundary (jit, and
native: building and loading the C fast path),
serving (dispatcher, launchers, entry points), then the lab and codegen on top, and the command
line above everything."""

from __future__ import annotations

from .support import imports as im

DATA = {"errors", "env", "parity", "presets", "formats", "launch", "variants", "numerics", "codecs", "reference",
        "index_q", "index_q_hadamard"}  # fmt: skip
SERVING = {
    "tuning", "scratch", "validate", "overlap", "binding", "bound_kv", "bound_index_q", "launcher", "selftest", "dispatch", "ops", "api", "torch_op",
    "index_q_ops", "selftest_index_q",
    "compat",  # other engines' schemas on top of the serving API: nothing of ours imports it
    "plugins",  # engine plugins on top of the serving API, loaded by the engines' entry points only
    "_exports",  # the package's public names (the package re-exports them)
}  # fmt: skip
# wing -> wings it may import
ALLOWED = {
    "device": {"device"},  # kernel_base's methods call kernel_lib's helpers
    "generated": {"device", "generated"},
    "data": {"data", "generated"},
    "jit": {"data", "jit"},
    "serving": {"data", "jit", "serving"},
    "lab": {"data", "jit", "serving", "device", "lab"},
    "codegen": {"data", "jit", "serving", "codegen"},
    "cli": {"data", "jit", "serving", "device", "lab", "codegen", "cli"},
}
# imports inside a function, and why each stays there
DEFERRED = {
    # the registry is written by codegen, which imports variants before the registry exists
    ("attn_prologue.variants", "attn_prologue.generated.registry"),
    # the copy yardstick is a CuTe kernel: importing it imports the DSL (~1 s), which the targets
    # checker and the lab's CPU tests never need
    ("attn_prologue.lab.timing", "attn_prologue.lab.copy_kernel"),
    # the package imports its public names (and torch) unless the process is the command line, which
    # parses first and imports them itself (runtime/__init__.py)
    ("attn_prologue", "attn_prologue._exports"),
}


def wing(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "serving"  # the package: its public names are the serving API
    if parts[1] in ("device", "generated", "jit", "lab", "codegen"):
        return parts[1]
    if parts[1] == "native":  # the C fast path's build and load: part of the compile boundary
        return "jit"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    if parts[1] in DATA:
        return "data"
    assert parts[1] in SERVING, f"{module}: no wing (add it to DATA or SERVING in this test)"
    return "serving"


def graph(edges) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in im.modules()}
    for e in edges:
        g[e.importer].add(e.imported)
    return g


def test_no_import_cycle():
    floors = im.floors(graph(im.edges()))  # raises naming the cycle
    assert max(floors.values()) >= 3  # the graph was read (not vacuous)


def test_every_import_goes_down_the_wings():
    bad = [
        f"{e.importer} ({wing(e.importer)}) imports {e.imported} ({wing(e.imported)})"
        for e in im.edges()
        if wing(e.imported) not in ALLOWED[wing(e.importer)]
    ]
    assert not bad, "\n".join(bad)


def test_imports_are_at_module_level():
    """Only the command line defers imports (each command imports what it needs), plus DEFERRED."""
    deferred = {(e.importer, e.imported) for e in im.edges() if not e.top_level and wing(e.importer) != "cli"}
    assert deferred <= DEFERRED, sorted(deferred - DEFERRED)


def test_the_serving_path_imports_no_codegen_lab_or_jinja():
    serving = [m for m in im.modules() if wing(m) in ("serving", "data", "jit", "device")]
    assert len(serving) > 15
    for m in serving:
        text = im.modules()[m].read_text()
        assert "jinja2" not in text and "matplotlib" not in text, m
