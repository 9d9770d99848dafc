"""SASS instructions per stored value of a kernel module, read from its compiled cubin on the CPU.

What is counted. The kernels of the default launch configs are loop-free (a warp runs one unit:
passes_per_warp passes of 32 / LANES_PER_ROW rows each, unrolled), so one warp's unit is a path through
the DAG of the kernel's basic blocks (a persistent config's loop body, one unit, is counted once with
the code around it). The count of a row kind ("kv" rows, "q" rows, with or without a
compress ratio) is the number of instructions in every block that a steady-state pass of that kind
can reach from the entry: a block is left out when it belongs to another kind of pass (`q_pass`,
`pad_pass`, `kv_pass` of the generated module, read from the line info), to the compressed writers'
group-boundary code (for a ratio of 1), or to code that runs only for rare inputs: a subroutine
call (the IEEE division's slow path for denormal, huge or special operands; the 64-bit division of
slots >= 2^31), the global atomics of the error counter, and a warp-wide shuffle's fallback for a
diverged warp (`BRA.DIV`'s target: the kernels shuffle in warp-uniform code). Predicated-off instructions are issued
all the same and count. The union of reachable blocks is what a warp issues when its lanes take both
sides of a branch (the rope tail vs the quantized vectors, the lanes that store a scale). The parity
choices' code is warp-uniform: a block that lies wholly inside the body of an `if` that tests a
`numerics` bit as set (and the Kernel methods called only from such bodies) runs only when a caller
asks for that choice, so `instructions` counts the format defaults' path and
`instructions_every_choice` the union; choice code the compiler if-converts into a shared block
(predicated) counts in both, as it is issued. An interleaved module that stages two or more Q rows a
warp (KernelBase.store_rows_interleaved) keeps straight stores for head counts that are not a multiple
of them, behind a warp-uniform test of the head count: the Q count is the staged path's, without the
blocks of store_q_row, which only that branch calls there (`straight_q_blocks`).

Per value: that count divided by the values one lane handles in one unit (passes_per_warp x D /
LANES_PER_ROW), i.e. thread instructions per value; a warp issues count warp instructions per unit of
passes_per_warp x 32 / LANES_PER_ROW rows. Not modelled: dual issue does not exist on these parts,
but issue slots lost to dependencies and memory stalls are not counted (a lower bound on issue time,
not an estimate of it).

The line info comes from a twin compiled with `--generate-line-info`, checked to disassemble to the
same instructions as the module in the kernel cache (it does: line info changes no code).
Reading the SASS (nvdisasm, cubins, instructions and their classes) is attn_prologue.lab.sass_reader.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path

from .. import dispatch
from ..jit import compiler
from ..jit.kernel_cache import KernelCache, KernelKey
from ..launch import LaunchConfig
from ..variants import parse_name
from .sass_reader import (  # noqa: F401  (the reader's public names, as this module's too)
    Instruction,
    SassError,
    SassToolMissing,
    cached_cubin,
    disassemble,
    embedded_cubin,
    instruction_class,
    line_info_cubin,
    nvdisasm,
    tool_versions,
)

# ---- basic blocks and the reachable set ----------------------------------------------------------------
_TARGET = re.compile(r"`\(([.$][\w.$]+)\)")
_PREDICATE_OPERAND = re.compile(r"^!?U?P[0-7T]\s*,")
COLD_OPCODES = re.compile(r"^(CALL|ATOMG|ATOM|REDG|RED)$")  # rare-input code: slow paths, error counts
# the Kernel methods of each pass (a kv-only module's kv_pass hands its rows to kv_rows)
PASSES = {"q_pass": "q_pass", "pad_pass": "pad_pass", "kv_pass": "kv_pass", "kv_rows": "kv_pass"}
# the generated-module lines that only compressed writers run: the group-boundary test and the group start,
# and the methods of a large call's boundary scan
COMPRESS_MARKERS = ("% args.compress_ratio", "// args.compress_ratio")
COMPRESS_METHODS = ("scan_boundaries", "scanned_row")


@dataclasses.dataclass
class Block:
    instrs: list[Instruction]
    succ: list[int]
    region: str | None = None  # the pass it belongs to (None: shared)
    compress: bool = False
    cold: bool = False
    choice: bool = False  # only reached when a parity-choice bit is set


def basic_blocks(instrs: list[Instruction], labels: dict[str, int]) -> list[Block]:
    main = [i for i in instrs if i.function == "main"]
    index = {ins.address: k for k, ins in enumerate(main)}
    leaders = {0} | {index[a] for a in labels.values() if a in index}
    for k, ins in enumerate(main):
        if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMX") and k + 1 < len(main):
            leaders.add(k + 1)
    starts = sorted(leaders)
    block_of = {s: b for b, s in enumerate(starts)}
    blocks = []
    for b, s in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else len(main)
        body = main[s:end]
        last = body[-1]
        succ = []
        if last.base in ("BRX", "JMX"):
            raise SassError(f"indirect branch at {last.address:#x}: {last.text}")
        if last.base == "BRA":
            target = _TARGET.search(last.operands)
            if target is None or labels.get(target[1]) not in index:
                raise SassError(f"branch without a known target at {last.address:#x}: {last.text}")
            succ.append(block_of[index[labels[target[1]]]])
        # conditional: a predicate guard, a uniform predicate operand (`BRA.U !UP0, ...`), or BRA.DIV
        # (taken only when the warp is diverged at a warp-wide shuffle or vote: to a fallback)
        divergent = last.opcode.startswith("BRA.DIV")
        conditional = bool(last.predicate) or divergent or bool(_PREDICATE_OPERAND.match(last.operands))
        fallthrough = last.base not in ("BRA", "EXIT", "RET") or conditional
        if fallthrough and end < len(main):
            succ.append(block_of[end])
        cold = any(COLD_OPCODES.match(i.base) for i in body)
        blocks.append(Block(body, succ, cold=cold))
    # the diverged-warp fallbacks are rare-input code: these kernels' warps converge at their shuffles
    for block in blocks:
        last = block.instrs[-1]
        if last.opcode.startswith("BRA.DIV"):
            blocks[block.succ[0]].cold = True
    return blocks


_MEMORY = re.compile(r"^(LDG|STG|LD|ST|ATOMG|ATOM|REDG|RED)$")


def before_wait(instrs: list[Instruction], labels: dict[str, int]) -> list[Instruction]:
    """The global memory instructions that some path from the kernel's entry reaches before it passes
    the PDL wait (griddepcontrol.wait, SASS `ACQBULK`): what a kernel may do while the previous kernel
    still runs. Every path is followed (the greatest fixed point of "all predecessors have waited")."""
    blocks = basic_blocks(instrs, labels)
    preds: list[list[int]] = [[] for _ in blocks]
    for b, block in enumerate(blocks):
        for s in block.succ:
            preds[s].append(b)
    waits = [any(i.base == "ACQBULK" for i in block.instrs) for block in blocks]
    waited = [b != 0 for b in range(len(blocks))]  # on entry to block b, every path has waited
    changed = True
    while changed:
        changed = False
        for b in range(1, len(blocks)):
            now = all(waited[p] or waits[p] for p in preds[b]) if preds[b] else False
            if now != waited[b]:
                waited[b], changed = now, True
    early = []
    for b, block in enumerate(blocks):
        if waited[b]:
            continue
        for ins in block.instrs:
            if ins.base == "ACQBULK":
                break
            if _MEMORY.match(ins.base):
                early.append(ins)
    return early


@functools.cache
def _module_lines(path: str) -> tuple[dict[int, str], frozenset[int]]:
    """Per line of a generated module: the Kernel method it is in, and the compressed-writer lines."""
    where, method, compress = {}, None, set()
    for n, text in enumerate(Path(path).read_text().splitlines(), 1):
        if m := re.match(r"    def (\w+)\(", text):
            method = m[1]
        elif re.match(r"\S", text):
            method = None
        where[n] = method
        if method in COMPRESS_METHODS or any(marker in text for marker in COMPRESS_MARKERS):
            compress.add(n)
    return where, frozenset(compress)


def _bit_test(test: ast.expr) -> str | None:
    """ "set" for an `if` test that holds only when a `numerics` bit is set (`(args.numerics & X) != 0`,
    alone or and-ed with other conditions), "clear" for `(args.numerics & X) == 0` alone (its else
    branch then runs only when one is set), None otherwise."""
    if isinstance(test, ast.BinOp) and isinstance(test.op, ast.BitAnd):
        return "set" if "set" in (_bit_test(test.left), _bit_test(test.right)) else None
    if not (isinstance(test, ast.Compare) and "args.numerics &" in ast.unparse(test.left)):
        return None
    if ast.unparse(test.comparators[0]) != "0":
        return None
    return {ast.NotEq: "set", ast.Eq: "clear"}.get(type(test.ops[0]))


def _self_calls(node: ast.AST) -> list[str]:
    return [
        n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    ]


@functools.cache
def _choice_lines(path: str) -> frozenset[tuple[str, int]]:
    """(file name, line) of a generated module and of kernel_base (the methods its Kernel inherits)
    that run only when a parity-choice bit is set: the branches of the `if`s that test one as set (or
    the else of one that tests them clear), and the Kernel methods called from nowhere else."""
    trees = {f.name: ast.parse(f.read_text()) for f in (Path(path), compiler.kernel_base_path())}
    lines: set[tuple[str, int]] = set()
    guarded, calls = Counter(), Counter()
    for name, tree in trees.items():
        calls.update(_self_calls(tree))
        for node in ast.walk(tree):
            kind = _bit_test(node.test) if isinstance(node, ast.If) else None
            for stmt in {"set": getattr(node, "body", []), "clear": getattr(node, "orelse", [])}.get(
                kind, []
            ):
                lines.update((name, n) for n in range(stmt.lineno, stmt.end_lineno + 1))
                guarded.update(_self_calls(stmt))
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.FunctionDef)
                and guarded[node.name]
                and guarded[node.name] == calls[node.name]
            ):
                lines.update((name, n) for n in range(node.lineno, node.end_lineno + 1))
    return frozenset(lines)


def label_blocks(blocks: list[Block], module_path: Path) -> None:
    """Each block's pass and whether it is compressed-writer or parity-choice code, from the line
    info of its instructions in the generated module and in the methods its Kernel inherits
    (kernel_base); a block with none there, or only in the RoPE helpers both passes call, inherits
    from its predecessors when they agree."""
    files = {Path(module_path).name, compiler.kernel_base_path().name}
    preds: dict[int, list[int]] = {b: [] for b in range(len(blocks))}
    for b, blk in enumerate(blocks):
        for s in blk.succ:
            preds[s].append(b)
    shared = (None, "rotate_tail", "load_tail_cos_sin")
    for b, blk in enumerate(
        blocks
    ):  # address order: predecessors first but for a persistent loop's back edge
        own = [i.line for i in blk.instrs if i.line and Path(i.line[0]).name in files]
        if own:
            lines = {f: _module_lines(f) for f in {f for f, _ in own}}  # (where, compress) per file
            methods = [lines[f][0].get(n) for f, n in own]
            passes = Counter(PASSES[m] for m in methods if m in PASSES)
            blk.compress = sum(n in lines[f][1] for f, n in own) * 2 > len(own)
            choice = _choice_lines(str(module_path))
            blk.choice = all((Path(f).name, n) in choice for f, n in own)
            if passes or any(m not in shared for m in methods):
                blk.region = passes.most_common(1)[0][0] if passes else None
                continue
        earlier = [p for p in preds[b] if p < b]
        regions = {blocks[p].region for p in earlier}
        if len(regions) == 1:
            blk.region = regions.pop()
        if not own and earlier:
            blk.compress = all(blocks[p].compress for p in earlier)
            blk.choice = all(blocks[p].choice for p in earlier)


def reachable(
    blocks: list[Block], row: str, compress: bool, choices: bool = False, avoid: frozenset[int] = frozenset()
) -> list[int]:
    """Blocks a steady-state pass of `row` kind can reach from the entry (`choices`: with every
    parity choice's code too; otherwise the format defaults' path), never through a block of `avoid`."""
    ok = [
        not blk.cold
        and blk.region in (None, row)
        and (compress or not blk.compress)
        and (choices or not blk.choice)
        and b not in avoid
        for b, blk in enumerate(blocks)
    ]
    seen, stack = set(), [0]
    while stack:
        b = stack.pop()
        if b in seen or not ok[b]:
            continue
        seen.add(b)
        stack.extend(blocks[b].succ)
    return sorted(seen)


def _method_blocks(blocks: list[Block], path: Path, method: str) -> frozenset[int]:
    """The blocks with an instruction from `method` of the file at `path` (line info)."""
    where = _module_lines(str(path))[0]
    return frozenset(
        b
        for b, blk in enumerate(blocks)
        if any(
            i.line and Path(i.line[0]).name == path.name and where.get(i.line[1]) == method
            for i in blk.instrs
        )
    )


def straight_q_blocks(blocks: list[Block], module_path: Path) -> frozenset[int]:
    """In a module that stages its interleaved Q rows, the blocks of the straight stores (store_q_row)
    kept for head counts that are not a multiple of the rows a warp stages. Raises if the staged
    stores are not reachable without them (the compiler moved straight-store code above the branch)."""
    straight = _method_blocks(blocks, Path(module_path), "store_q_row")
    staged = _method_blocks(blocks, compiler.kernel_base_path(), "store_rows_interleaved")
    if not staged or not staged & set(reachable(blocks, "q_pass", False, choices=True, avoid=straight)):
        raise SassError(
            f"{Path(module_path).name}: the staged Q stores are not reachable apart from the straight ones"
        )
    return straight


# ---- the count ------------------------------------------------------------------------------------------
@functools.cache
def _sass(
    variant: str, config: LaunchConfig, target: str, kernel: str
) -> tuple[tuple[Instruction, ...], tuple]:
    instrs, labels = disassemble(line_info_cubin(variant, config, target), kernel)
    return tuple(instrs), tuple(labels.items())


def same_code(a: list[Instruction], b: list[Instruction]) -> bool:
    return [(i.address, i.text) for i in a] == [(i.address, i.text) for i in b]


def count(
    variant: str,
    config: LaunchConfig,
    target: str,
    *,
    row: str = "kv",
    compress: bool = False,
    cache: KernelCache | None = None,
    kernel: str = "kernel",
) -> dict:
    """Instructions per lane and unit of one row kind (module docstring), their classes, and per value.
    With `cache`, the module's entry there (if built) is checked to have the same SASS as the twin.
    `kernel="scan_kernel"`: a kv-only module's kernel for compressed writers' large calls, where a
    unit's pass is its window's scan and one round of boundary rows."""
    v = parse_name(variant)
    if row not in ("kv", "q") or (row == "q" and not v.op.has_q):
        raise ValueError(f"row must be 'kv'{' or q' if v.op.has_q else ''} for {variant}, got {row!r}")
    if compress and v.op.has_q:
        raise ValueError("compress ratios are a kv-only writer's argument")
    if kernel == "scan_kernel" and not compress:
        raise ValueError("the scan kernel runs compressed writers only (compress=True)")
    instrs, labels = _sass(variant, config, target, kernel)
    instrs = list(instrs)
    matches = None
    if cache is not None:
        built = cached_cubin(cache, KernelKey(variant, config, target))
        if built is not None:
            matches = same_code(disassemble(built, kernel)[0], instrs)
    blocks = basic_blocks(instrs, dict(labels))
    label_blocks(blocks, compiler.module_path(variant))
    region = f"{row}_pass"
    if not any(b.region == region for b in blocks):
        raise SassError(
            f"{variant}: no code attributed to {region} (did the template's method names change?)"
        )
    if not v.op.has_q and not any(b.compress for b in blocks):
        raise SassError(f"{variant}: no compressed-writer code found (markers {COMPRESS_MARKERS} changed?)")
    mod = compiler.load_module(variant)
    kernel_obj = mod.Kernel(config)  # its lanes and stage, by the rules the kernel itself runs
    staged = row == "q" and kernel_obj.q_staged
    avoid = straight_q_blocks(blocks, compiler.module_path(variant)) if staged else frozenset()
    hot = [i for b in reachable(blocks, region, compress, avoid=avoid) for i in blocks[b].instrs]
    every_choice = sum(
        len(blocks[b].instrs) for b in reachable(blocks, region, compress, choices=True, avoid=avoid)
    )
    lanes = kernel_obj.q_lanes if row == "q" else kernel_obj.row_lanes  # a row's lanes
    values = mod.HEAD_DIM // lanes * config.passes_per_warp  # a unit's passes are unrolled: all counted
    main = [i for i in instrs if i.function == "main"]
    calls = Counter(
        _TARGET.search(i.operands)[1].split("$__")[-1]
        for i in main
        if i.base == "CALL" and _TARGET.search(i.operands)
    )
    return {
        "variant": variant,
        "kernel": kernel,
        "config": config.key,
        "target": target,
        "row": row,
        "compress": compress,
        "instructions": len(hot),
        "values_per_lane": values,
        "per_value": round(len(hot) / values, 2),
        "instructions_every_choice": every_choice,  # the union with every parity choice's code
        "classes": dict(sorted(Counter(instruction_class(i.base) for i in hot).items())),
        "ieee_divisions": sum(i.base == "FCHK" for i in hot),  # each div.rn.f32 fast path checks once
        "mufu": sum(i.base == "MUFU" for i in hot),
        "subroutine_call_sites": dict(sorted(calls.items())),
        "static_main": len(main),
        "static_subroutines": len(instrs) - len(main),
        "matches_cache": matches,
    }


def of_shape(shape, config: LaunchConfig | None = None) -> dict:
    """What `bench` reports per row (a bench.Shape): instructions per value of the module its call
    runs on this GPU, with the config the dispatcher picks for its token count (or `config`): KV
    rows, and Q rows for the qkv op. Without nvdisasm, or for SASS this module cannot read, the
    reason instead (a count is never guessed)."""
    rt = dispatch.default_runtime()
    v = rt.variant(shape.request)
    qkv = shape.op == "qkv"
    cfg = config or shape.launch_config()
    compress = shape.compress_ratio != 1
    scan = compress and shape.n > compiler.load_module(v.name).SPECULATIVE_ROWS  # the scan kernel runs it
    kernel = "scan_kernel" if scan else "kernel"
    out = {"variant": v.name, "kernel": kernel, "config": cfg.key}
    try:
        for row in ("q", "kv") if qkv else ("kv",):
            c = count(
                v.name, cfg, rt.device().target, row=row, compress=compress, cache=rt.cache, kernel=kernel
            )
            out[row] = {
                k: c[k] for k in ("per_value", "instructions", "classes", "ieee_divisions", "matches_cache")
            }
    except (SassToolMissing, SassError) as exc:
        return {**out, "error": str(exc)}
    return out


def summary(counts: dict | None) -> str:
    """The bench table's cell: "q 16.3, kv 25.2" instructions per value, or why there is none."""
    if not counts:
        return ""
    if "error" in counts:
        return "n/a"
    return ", ".join(f"{row} {counts[row]['per_value']:.1f}" for row in ("q", "kv") if row in counts)
