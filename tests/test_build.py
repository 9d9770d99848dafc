"""CPU tests of `build` and the kernel cache: every generated variant compiles for every target it
claims, the PTX/cubin facts hold, the ninja graph is complete, a second build does nothing, broken
entries are rebuilt, concurrent builders agree, and loading compiles nothing.

The full build (every variant, every target: sm_90a, sm_100a, sm_120a, sm_121a, native and portable,
plus the configs the shipped tuning database names) runs once per session through the CLI into a
temporary kernel cache that the tests share. No GPU is needed.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (also under --import-mode=importlib)
import _build_workers  # noqa: E402
from attn_prologue.codegen import build, generate
from attn_prologue.codegen.plan import make_plan
from attn_prologue.codegen.variants import variant_space
from attn_prologue.formats import FORMATS, ElementCode, ScaleCode
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import CorruptEntryWarning, KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig, all_configs
from attn_prologue.variants import TARGETS, Conversions, Op, QOut, Variant, parse_name

REPO = Path(__file__).resolve().parents[1]

# CI compiles every generated variant for every target it claims (the project's main job, ~2-3
# minutes on a 2-core machine) and inspects what each one emits.
VARIANTS = variant_space()
ENTRIES = build.build_keys(VARIANTS)  # (variant, key) for every default/tuned config and target
ENTRY_IDS = [f"{k.variant}-{k.target}-{k.config.key}" for _, k in ENTRIES]


def test_build_covers_every_axis_on_every_target():
    by_target = collections.defaultdict(list)
    for v, k in ENTRIES:
        by_target[k.target].append(v)
    assert set(by_target) == set(TARGETS)
    for target, vs in by_target.items():
        assert {v.cache_format for v in vs} == {n for n, f in FORMATS.items() if f.has_kernel_template}, (
            target
        )
        assert {(v.op, v.q_out) for v in vs} == {
            (Op.QKV, QOut.IO),
            (Op.QKV, QOut.FP8),
            (Op.KV, QOut.IO),
            (Op.KV_NORM, QOut.IO),
        }
        assert {v.io_dtype for v in vs} == {v.io_dtype for v in variant_space()}
        assert {v.head_dim for v in vs} == {512, 128}
    assert {(v.arch.value, v.conversions.value) for v in VARIANTS} == {
        ("sm90", "portable"),
        ("sm100", "native"),
        ("sm100", "portable"),
        ("sm120", "native"),
        ("sm120", "portable"),
    }


def test_compile_entry_refuses_a_target_the_variant_name_does_not_claim(tmp_path):
    with pytest.raises(compiler.CompileError, match="is built for sm_90a, not sm_100a"):
        compiler.compile_entry("kv_d512r64_bf16_bf16_sm90", LaunchConfig(), "sm_100a", tmp_path / "entry")
    assert not (tmp_path / "entry").exists()  # refused before anything was compiled


# ---- the session's build ---------------------------------------------------------------------------
@dataclass
class Built:
    root: Path
    cache: KernelCache
    output: str
    seconds: float


def _build_cli(root: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(root)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Built:
    root = tmp_path_factory.mktemp("kernel-cache")
    proc, seconds = _build_cli(root)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    print(f"\n[test_build] built {len(ENTRIES)} kernels ({len(VARIANTS)} variants) in {seconds:.1f}s")
    return Built(root, KernelCache(root), output, seconds)


def _meta(built: Built, key: KernelKey) -> dict:
    meta = built.cache.read_meta(key)
    assert meta is not None, f"{key.variant} [{key.target}] has no intact cache entry"
    return meta


def _ptx(built: Built, key: KernelKey) -> str:
    return (built.cache.entry_dir(key) / "kernel.ptx").read_text()


@pytest.mark.slow
def test_build_reports_every_kernel(built):
    assert f"build: {len(VARIANTS)} variants" in built.output
    assert f"build: {len(ENTRIES)} kernels ready" in built.output
    table = built.output[built.output.index("target ") :]
    for target in TARGETS:
        assert re.search(rf"^{target}\s+{sum(k.target == target for _, k in ENTRIES)}\s", table, re.M), target


@pytest.mark.slow
def test_every_variant_is_built_for_every_target_it_claims(built):
    for v in VARIANTS:
        keys = [k for w, k in ENTRIES if w == v]
        default = v.arch.default_config.key
        defaults = [k for k in keys if k.config.key == default]
        assert sorted(k.target for k in defaults) == sorted(v.arch.targets)
        tuned = build.tuned_configs()
        for k in keys:
            meta = _meta(built, k)
            assert (meta["variant"], meta["target"], meta["config"]) == (v.name, k.target, k.config.key)
            assert k.config.key == default or k.config in tuned[(v.name, k.target)]
            assert meta["dsl_fingerprint"] == compiler.dsl_fingerprint()
            assert meta["source_hash"] == compiler.source_hash(v.name)
            assert re.search(rf"^\.target {k.target}$", _ptx(built, k), re.M)
            so = built.cache.entry_dir(k) / "kernel.so"
            assert so.read_bytes()[:4] == b"\x7fELF"
            assert meta["resources"]["registers"] > 0  # the cubin's attributes were found


# ---- PTX and cubin facts, per entry ----------------------------------------------------------------
def _tail_slots(plan: dict) -> int:
    return sum(1 for s in range(plan["slots"]) if (s + 1) * plan["lanes_per_row"] > plan["tail_vector"])


def expected_min_128bit_loads(v: Variant) -> int:
    """Distinct 128-bit read-only loads of one pass of each kind: row vectors + cos and sin vectors."""
    plan = make_plan(v)
    per_row = plan["slots"] + 2 * _tail_slots(plan)
    n = per_row  # kv
    if v.op is Op.KV_NORM:
        n += plan["slots"]  # norm weights
    if v.op.has_q:
        n += per_row
    return n


def expected_store_bits(v: Variant) -> set[int]:
    f = v.format
    bits = {{ElementCode.E4M3: 64, ElementCode.E2M1: 32, ElementCode.BF16: 128}[f.element]}  # data: 8 values
    if f.rope_tail_bf16:
        bits.add(128)  # 8 bf16 of the rope tail
    if f.scale is ScaleCode.UE8M0:
        bits.add(8)
    elif f.scale is ScaleCode.F32_POW2:
        bits.add(32)
    if v.op.has_q:
        bits.add(64 if v.q_out is QOut.FP8 else 128)  # 8 e4m3 or 8 x 16-bit values of q_out
        bits.add(128)  # pad heads are zeroed 16 bytes at a time
    return bits


def _widths(meta: dict, prefix: str) -> set[int]:
    return {
        int(k.rsplit(".", 1)[1]) for k in meta["ptx"]["global_access_bits"] if k.rsplit(".", 1)[0] == prefix
    }


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_global_accesses_are_128_bit(built, v, key):
    meta, ptx = _meta(built, key), _ptx(built, key)
    facts = meta["ptx"]
    cfg = key.config
    # q, kv and cos/sin (and norm weights): 128-bit loads. Rows take the streaming path (.cs) when the
    # config says so, the rest the read-only path (.nc) when it says so; nothing else does.
    assert facts["max_load_bits"] == 128
    scalars = {64} | ({32} if v.format.needs_tensor_scale or v.q_out is QOut.FP8 else set())
    assert _widths(meta, "ld.cs") == ({128} if cfg.streaming else set())
    assert _widths(meta, "ld.nc") == ({128} if cfg.non_coherent else set())
    assert ("ld.global.nc." in ptx) == cfg.non_coherent
    # the other loads are scalars: slot and position (int64), kv_scale / q_scale (float32); cos/sin
    # (and rows without streaming) take the plain path when not read-only
    assert _widths(meta, "ld") == scalars | (set() if cfg.non_coherent else {128})
    n_128 = sum(
        n for k, n in facts["global_access_bits"].items() if k.startswith("ld") and k.endswith(".128")
    )
    assert n_128 >= expected_min_128bit_loads(v)
    # stores: q_out rows and 128-bit pad zeros (streaming when configured), 8-value cache vectors, scale bytes / words
    stores = _widths(meta, "st") | _widths(meta, "st.cs")
    assert stores == expected_store_bits(v)
    streamed = ({64, 128} if v.q_out is QOut.FP8 else {128}) if cfg.streaming and v.op.has_q else set()
    assert _widths(meta, "st.cs") == streamed
    assert facts["max_store_bits"] == max(expected_store_bits(v))
    if v.op.has_q and v.q_out is QOut.IO:
        assert facts["max_store_bits"] == 128
        assert ("st.global.cs.v4.b32" if cfg.streaming else "st.global.v4.b32") in ptx


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_native_conversions_only_in_native_modules(built, v, key):
    meta, ptx = _meta(built, key), _ptx(built, key)
    native = v.conversions is Conversions.NATIVE
    assert native == (v.arch.value in ("sm100", "sm120") and not v.name.endswith("_portable"))
    wants_ue8m0 = native and v.format.scale in (ScaleCode.UE8M0, ScaleCode.F32_POW2)
    wants_e2m1 = native and v.format.element is ElementCode.E2M1
    assert (meta["ptx"]["cvt_ue8m0x2"] > 0) == wants_ue8m0 == ("cvt.rp.satfinite.ue8m0x2" in ptx)
    assert (meta["ptx"]["cvt_e2m1x2"] > 0) == wants_e2m1 == ("cvt.rn.satfinite.e2m1x2" in ptx)
    if wants_e2m1:
        assert meta["ptx"]["cvt_e2m1x2"] >= 4  # 8 values per 32-bit word, two per cvt
    # e4m3 is native everywhere: wherever an e4m3 value is written
    wants_e4m3 = v.format.element is ElementCode.E4M3 or v.q_out is QOut.FP8
    assert (meta["ptx"]["cvt_e4m3x2"] > 0) == wants_e4m3


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_no_local_memory(built, v, key):
    meta = _meta(built, key)
    assert meta["ptx"]["local_memory"] is False
    assert meta["resources"]["frame_bytes"] == 0
    assert meta["resources"]["min_stack_bytes"] == 0
    assert meta["resources"]["local_sections"] == 0
    assert not re.search(r"\b(ld|st)\.local\b", _ptx(built, key))


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_launch_config_is_compiled_in(built, v, key):
    assert_config_in_ptx(_ptx(built, key), key.config)


def assert_config_in_ptx(ptx: str, cfg: LaunchConfig) -> None:
    assert re.findall(r"\.reqntid (\d+), 1, 1", ptx) == [str(32 * cfg.warps_per_cta)]
    assert (len(re.findall(r"griddepcontrol\.(wait|launch_dependents)", ptx)) == 2) == cfg.pdl


# ---- 64-bit token offsets, by data flow in the PTX --------------------------------------------------
# Every global access whose address depends on the block index (%ctaid: which token/row this warp
# handles) must (a) scale that index in 64-bit arithmetic somewhere on the way (mul.lo/mad.lo .s64,
# mul.wide, shl.b64), and (b) never scale it in 32-bit by a byte-sized factor (an immediate >= 64,
# e.g. `shl.b32 ..., 8` for a 256-byte row) or by a register that is not a 32-bit kernel parameter
# (e.g. a 64-bit stride truncated to 32 bits). Index arithmetic in 32 bits (warp -> pass -> row,
# row -> (token, head) with the int32 head count) stays allowed: it is bounded by T * H.
_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+([^;]*);")
_REG = re.compile(r"%(?:[a-z]+\d+|ctaid\.[xyz])")
_GLOBAL = re.compile(r"(ld|st|atom|red)\.global\b")
_SCALE32 = re.compile(r"((mul|mad)(24)?\.lo\.[su]32|shl\.b32)$")
_SCALE64 = re.compile(r"((mul|mad)\.lo\.[su]64|(mul|mad)\.wide\.[su]32|shl\.b64)$")


def _instructions(ptx: str) -> list[dict]:
    body = ptx[ptx.index("{", ptx.index(".entry")) :]
    out = []
    for line in body.splitlines():
        m = _INSTR.match(line.split("//")[0])
        if not m:
            continue
        op, args = m.groups()
        text = args.strip()
        if op.startswith(("st.", "red.")):
            dests = []
        elif text.startswith("{"):
            dests = _REG.findall(text[: text.index("}")])
        else:
            dests = _REG.findall(text.split(",", 1)[0])
        rest = text
        for d in dests:
            rest = rest.replace(d, "", 1)
        addr = re.search(r"\[([^\]]*)\]", text)
        out.append(
            {
                "op": op,
                "args": text,
                "dests": dests,
                "uses": _REG.findall(rest),
                "addr": _REG.findall(addr.group(1)) if addr else [],
            }
        )
    return out


def address_problems(ptx: str) -> tuple[int, list[str]]:
    """(global accesses checked, problems) for the rule above."""
    ins = _instructions(ptx)
    defs = collections.defaultdict(list)
    for i, x in enumerate(ins):
        for r in x["dests"]:
            defs[r].append(i)
    taint: set[str] = set()
    changed = True
    while changed:  # registers whose value depends on %ctaid
        changed = False
        for x in ins:
            if any(u.startswith("%ctaid") or u in taint for u in x["uses"]):
                for r in x["dests"]:
                    if r not in taint:
                        taint.add(r)
                        changed = True

    def tainted(x):
        return any(u.startswith("%ctaid") or u in taint for u in x["uses"])

    def backward_slice(regs):
        seen, stack, found = set(), list(regs), set()
        while stack:
            r = stack.pop()
            if r not in seen:
                seen.add(r)
                for i in defs.get(r, ()):
                    found.add(i)
                    stack.extend(ins[i]["uses"])
        return [ins[i] for i in sorted(found)]

    checked, problems = 0, []
    for x in ins:
        if not _GLOBAL.match(x["op"]):
            continue
        sl = backward_slice(x["addr"])
        if not any(tainted(y) for y in sl):
            continue  # e.g. norm weights, scale tensors: no token index in the address
        checked += 1
        where = f"{x['op']} [{x['args'].split('[', 1)[1].split(']')[0]}]"
        if not any(_SCALE64.match(y["op"]) and tainted(y) for y in sl):
            problems.append(f"{where}: the token index is never scaled in 64-bit arithmetic")
        for y in sl:
            if not (_SCALE32.match(y["op"]) and tainted(y)):
                continue
            for o in [a.strip() for a in y["args"].split(",")][1:3]:
                if re.fullmatch(r"-?\d+|0x[0-9a-fA-F]+", o):
                    factor = 1 << int(o, 0) if y["op"].startswith("shl") else abs(int(o, 0))
                    if factor >= 64:
                        problems.append(
                            f"{where}: `{y['op']} {y['args']}` scales a token index by {factor} in 32 bits"
                        )
                elif o.startswith("%") and o not in taint:
                    sources = [ins[i]["op"] for i in defs.get(o, ())]
                    if not sources or not all(re.fullmatch(r"ld\.param\.[bsu]32", s) for s in sources):
                        problems.append(
                            f"{where}: `{y['op']} {y['args']}` multiplies a token index by {o} ({sources}) in 32 bits"
                        )
    return checked, problems


_PTX_HEAD = """.version 9.0
.target sm_90a
.address_size 64
.visible .entry k(
\t.param .u64 k_param_0,
\t.param .u64 k_param_1,
\t.param .u32 k_param_2
)
{
\t.reg .b32 \t%r<20>;
\t.reg .b64 \t%rd<20>;
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b64 \t%rd5, [k_param_1];
\tld.param.b32 \t%r9, [k_param_2];
\tmov.u32 \t%r1, %ctaid.x;
\tmov.u32 \t%r8, %tid.x;
"""
_PTX_TAIL = "\tld.global.nc.v4.b32 \t{%r3, %r4, %r5, %r6}, [%rd3];\n\tret;\n}\n"
PTX_CASES = {
    # row index widened, then times the 64-bit stride: fine
    "widened": (
        "\tcvt.s64.s32 \t%rd2, %r1;\n\tmul.lo.s64 \t%rd4, %rd2, %rd5;\n\tadd.s64 \t%rd3, %rd1, %rd4;\n",
        0,
    ),
    # index math in 32 bits (x 2 warps, x heads), then a 64-bit multiply by the row bytes: fine
    "index_math": (
        "\tshl.b32 \t%r2, %r1, 1;\n\tmul.lo.s32 \t%r7, %r2, %r9;\n\tmul.wide.s32 \t%rd4, %r7, 256;\n\tadd.s64 \t%rd3, %rd1, %rd4;\n",
        0,
    ),
    # the overflow seen in the probe: token index * 256 bytes in 32 bits
    "shl_b32": ("\tshl.b32 \t%r2, %r1, 8;\n\tcvt.u64.u32 \t%rd2, %r2;\n\tadd.s64 \t%rd3, %rd1, %rd2;\n", 2),
    # a 64-bit stride truncated to 32 bits and multiplied there (then widened)
    "truncated_stride": (
        "\tcvt.u32.u64 \t%r7, %rd5;\n\tmul.lo.s32 \t%r2, %r1, %r7;\n\tmul.wide.s32 \t%rd4, %r2, 2;\n\tadd.s64 \t%rd3, %rd1, %rd4;\n",
        1,
    ),
    # lane offsets in 32 bits are not token offsets
    "lane_offset": (
        "\tshl.b32 \t%r2, %r8, 4;\n\tcvt.u64.u32 \t%rd2, %r2;\n\tadd.s64 \t%rd3, %rd1, %rd2;\n",
        None,
    ),
}


@pytest.mark.parametrize("case", list(PTX_CASES))
def test_address_checker_on_small_ptx(case):
    body, n_problems = PTX_CASES[case]
    checked, problems = address_problems(_PTX_HEAD + body + _PTX_TAIL)
    if n_problems is None:
        assert checked == 0 and problems == []
    else:
        assert checked == 1
        assert len(problems) == n_problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_token_offsets_are_64_bit(built, v, key):
    ptx = _ptx(built, key)
    checked, problems = address_problems(ptx)
    # every row load and every cache/q_out store is token-indexed
    assert checked >= expected_min_128bit_loads(v) - (make_plan(v)["slots"] if v.op is Op.KV_NORM else 0)
    assert not problems, "\n".join(problems[:10])
    assert _meta(built, key)["ptx"]["mul_wide_s64_or_64bit_mad"] > 0


_SIGNATURE = re.compile(rb"__call__\((.*?)\)`")


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_compiled_function_checks_equal_token_counts(built, v, key):
    """The exported function's argument spec (what TVM-FFI checks before launching): q_in, kv and
    positions of the qkv op share one row-count variable, so a call whose counts differ is refused
    there; the Python hot paths rely on it. Other ops keep independent counts."""
    so = (built.cache.entry_dir(key) / "kernel.so").read_bytes()
    spec = _SIGNATURE.search(so)
    assert spec, "no argument spec in kernel.so"
    dims = dict(re.findall(rb"(\w+): Tensor\(\[(\w+)", spec.group(1)))
    if v.op is Op.QKV:
        assert dims[b"q_in"] == dims[b"kv"] == dims[b"positions"], spec.group(1)
        assert len({dims[b"q_in"], dims[b"slot_mapping"], dims[b"q_out"]}) == 3, spec.group(1)
    else:
        assert dims[b"kv"] != dims[b"positions"], spec.group(1)


# ---- the build graph ----------------------------------------------------------------------------------
_COLON = object()


def _ninja_words(text: str) -> list:
    """Split a ninja `build` line into words, undoing `$ `, `$:` and `$$`; an unescaped ':' is _COLON."""
    words, cur, i = [], "", 0
    while i < len(text):
        c = text[i]
        if c == "$":
            cur += text[i + 1]
            i += 2
            continue
        if c in " :":
            if cur:
                words.append(cur)
                cur = ""
            if c == ":":
                words.append(_COLON)
        else:
            cur += c
        i += 1
    if cur:
        words.append(cur)
    return words


def parse_graph(path: Path) -> tuple[dict, list[dict]]:
    variables, edges = {}, []
    for line in path.read_text().splitlines():
        if line.startswith("build "):
            words = _ninja_words(line[len("build ") :])
            colon = words.index(_COLON)
            edges.append(
                {"outputs": words[:colon], "rule": words[colon + 1], "inputs": words[colon + 2 :], "vars": {}}
            )
        elif line.startswith("  ") and edges and "=" in line:
            name, _, value = line.strip().partition(" = ")
            edges[-1]["vars"][name] = value
        elif re.match(r"^[a-z_]+ = ", line):
            name, _, value = line.partition(" = ")
            variables[name] = value
    return variables, edges


def _check_graph(root: Path, keys: list[tuple[Variant, KernelKey]]):
    cache = KernelCache(root)
    graph = root / "build" / "build.ninja"
    _, edges = parse_graph(graph)
    expected = {str(cache.meta_path(k)): (v, k) for v, k in keys}
    outputs = collections.Counter(o for e in edges for o in e["outputs"])
    assert set(outputs) == set(expected)
    assert all(n == 1 for n in outputs.values()), [o for o, n in outputs.items() if n > 1][:5]
    lib = str(compiler.kernel_lib_path())
    for e in edges:
        assert e["rule"] == "compile"
        specs = shlex.split(e["vars"]["entries"])
        assert int(e["vars"]["count"]) == len(specs) == len(e["outputs"])
        from_specs = set()
        for spec in specs:
            variant, target, cfg = spec.split(":")
            from_specs.add(str(cache.meta_path(KernelKey(variant, LaunchConfig.from_key(cfg), target))))
        assert from_specs == set(e["outputs"])  # the edge compiles exactly what it promises
        vs = {expected[o][0] for o in e["outputs"]}
        assert {build.shard_of(v) for v in vs} == {e["vars"]["shard"]}
        assert set(e["inputs"]) == {str(compiler.module_path(v.name)) for v in vs} | {lib}
    # ninja itself reads the same graph: the same outputs, and commands a shell splits correctly
    run = [sys.executable, "-m", "ninja", "-C", str(graph.parent), "-f", graph.name, "-t"]
    targets = subprocess.run(run + ["targets", "all"], capture_output=True, text=True, check=True).stdout
    assert sorted(line.rsplit(": ", 1)[0] for line in targets.splitlines()) == sorted(expected)
    commands = subprocess.run(
        run + ["commands"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(commands) == len(edges)
    prefix = [sys.executable, "-m", "attn_prologue", "compile-entries", "--cache-dir", str(root)]
    argvs = [shlex.split(c) for c in commands]
    assert all(argv[: len(prefix)] == prefix for argv in argvs), argvs[0][: len(prefix)]
    assert sorted(argv[len(prefix) :] for argv in argvs) == sorted(
        shlex.split(e["vars"]["entries"]) for e in edges
    )
    return edges


def test_full_build_graph_is_complete(tmp_path):
    """Every (variant, target) of the manifest is an output of exactly one edge (nothing compiled)."""
    root = tmp_path / "kernel cache: with $pecial chars"
    keys = build.build_keys(variant_space())
    manifest = (generate.default_out_dir() / "MANIFEST").read_text().split()
    pairs = {(v.name, k.target) for v, k in keys}
    assert pairs == {(n, t) for n in manifest for t in parse_name(n).arch.targets}
    assert len(pairs) == 352
    assert (
        len(keys)
        == len({(k.variant, k.target, k.config.key) for _, k in keys})
        == 352
        + sum(len(cs - {parse_name(v).arch.default_config}) for (v, _), cs in build.tuned_configs().items())
    )
    build.write_graph(KernelCache(root), keys, root / "build" / "build.ninja")
    edges = _check_graph(root, keys)
    assert len(edges) == len({build.shard_of(v) for v, _ in keys})
    assert not list(root.rglob("meta.json"))  # writing the graph compiles nothing


@pytest.mark.slow
def test_session_build_graph_matches_the_subset(built):
    _check_graph(built.root, ENTRIES)


@pytest.mark.slow
def test_second_build_does_no_work(built):
    sos = {k: built.cache.entry_dir(k) / "kernel.so" for _, k in ENTRIES}
    before = {k: p.stat().st_mtime_ns for k, p in sos.items()}
    proc, seconds = _build_cli(built.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    print(f"\n[test_build] second build: {seconds:.2f}s")
    assert "ninja: no work to do." in out
    assert not re.search(r"^\[\d+/\d+\] compile ", out, re.M)
    assert {k: p.stat().st_mtime_ns for k, p in sos.items()} == before
    assert f"build: {len(ENTRIES)} kernels ready" in out
    assert seconds < 30, f"a no-op build took {seconds:.1f}s"


# ---- the kernel cache: corrupted entries, concurrent builders ---------------------------------------
CHEAP = next(k for v, k in ENTRIES if v.name == "kv_d512r64_bf16_bf16_sm90")


def _copy_entry(built: Built, key: KernelKey, root: Path) -> KernelCache:
    cache = KernelCache(root)
    shutil.copytree(built.cache.entry_dir(key), cache.entry_dir(key))
    assert cache.read_meta(key) is not None
    return cache


def _flip_middle_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated_so": lambda d: (d / "kernel.so").write_bytes((d / "kernel.so").read_bytes()[:4096]),
    "flipped_byte_in_so": lambda d: _flip_middle_byte(d / "kernel.so"),
    "missing_so": lambda d: (d / "kernel.so").unlink(),
    "truncated_meta": lambda d: (d / "meta.json").write_text((d / "meta.json").read_text()[:100]),
    "empty_meta": lambda d: (d / "meta.json").write_text(""),
    "missing_meta": lambda d: (d / "meta.json").unlink(),
    "meta_of_other_source": lambda d: (d / "meta.json").write_text(
        json.dumps({**json.loads((d / "meta.json").read_text()), "source_hash": "0" * 64})
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupted_entry_is_detected_and_rebuilt(built, tmp_path, how):
    cache = _copy_entry(built, CHEAP, tmp_path / "cache")
    d = cache.entry_dir(CHEAP)
    CORRUPTIONS[how](d)
    assert cache.read_meta(CHEAP) is None
    with pytest.raises(FileNotFoundError):
        cache.load(CHEAP, compile_if_missing=False)  # never hands out a broken object
    with pytest.warns(CorruptEntryWarning, match="incomplete or corrupted"):
        meta = cache.ensure_built(CHEAP)
    assert cache.compiles == 1
    assert cache.read_meta(CHEAP) == meta
    assert hashlib.sha256((d / "kernel.so").read_bytes()).hexdigest() == meta["so_sha256"]
    assert sorted(p.name for p in d.iterdir()) == ["kernel.ptx", "kernel.so", "meta.json"]
    assert [p.name for p in d.parent.iterdir() if p.name.startswith(".tmp-")] == []
    fresh = KernelCache(cache.root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.ensure_built(CHEAP) == meta
    assert fresh.compiles == 0


@pytest.mark.slow
def test_intact_entry_is_not_rebuilt(built, tmp_path):
    cache = _copy_entry(built, CHEAP, tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meta = cache.ensure_built(CHEAP)
    assert cache.compiles == 0
    assert meta == built.cache.read_meta(CHEAP)


@pytest.mark.slow
def test_two_processes_building_one_entry(tmp_path):
    root = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    args = (str(root), CHEAP.variant, CHEAP.config.key, CHEAP.target, barrier, queue)
    procs = [ctx.Process(target=_build_workers.build_entry, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r["compiles"] for r in results) == [0, 1]  # one built it, the other found it
    builder = next(r["pid"] for r in results if r["compiles"] == 1)
    assert {r["built_by_pid"] for r in results} == {builder}
    assert len({r["so_sha256"] for r in results}) == 1
    assert all(r["warnings"] == [] for r in results)
    cache = KernelCache(root)
    assert cache.read_meta(CHEAP)["built_by_pid"] == builder
    siblings = [p.name for p in cache.entry_dir(CHEAP).parent.iterdir() if not p.name.endswith(".lock")]
    assert siblings == [cache.entry_dir(CHEAP).name]  # one entry, no leftover .tmp-* directory


# ---- after `build`, loading compiles nothing -----------------------------------------------------------
LOADER = r"""
import json, sys, time
t0 = time.perf_counter()
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
t1 = time.perf_counter()
spec = json.loads(sys.stdin.read())
cache = KernelCache(spec["root"])
keys = [KernelKey(v, LaunchConfig.from_key(c), t) for v, c, t in spec["keys"]]
t2 = time.perf_counter()
fns = [cache.load(k, compile_if_missing=False) for k in keys]
t3 = time.perf_counter()
again = all(cache.load(k, compile_if_missing=False) is f for k, f in zip(keys, fns))
t4 = time.perf_counter()
v, c, t = spec["missing"]
try:
    cache.load(KernelKey(v, LaunchConfig.from_key(c), t), compile_if_missing=False)
    missing = "loaded"
except FileNotFoundError:
    missing = "FileNotFoundError"
print(json.dumps({
    "compiles": cache.compiles, "disk_loads": cache.disk_loads, "callable": all(map(callable, fns)),
    "same_objects": again, "missing": missing,
    "cutlass": sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")),
    "codegen_or_jinja": sorted(m for m in sys.modules if m.startswith(("attn_prologue.codegen", "jinja2"))),
    "import_s": t1 - t0, "first_load_s": t3 - t2, "memory_hits_s": t4 - t3,
}))
"""


@pytest.mark.slow
def test_loading_built_entries_compiles_nothing(built):
    keys = [(k.variant, k.config.key, k.target) for _, k in ENTRIES]
    other = next(c for c in all_configs() if c != CHEAP.config)
    spec = {"root": str(built.root), "keys": keys, "missing": (CHEAP.variant, other.key, CHEAP.target)}
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", LOADER],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\n[test_build] loaded {len(keys)} built kernels in a fresh process: {r['first_load_s']:.3f}s "
        f"(first load includes importing tvm_ffi), imports {r['import_s']:.3f}s, process {wall:.2f}s, "
        f"memory hits {r['memory_hits_s'] * 1e6 / len(keys):.1f} us each"
    )
    assert r["compiles"] == 0
    assert r["disk_loads"] == len(keys)
    assert r["callable"] and r["same_objects"]
    assert r["missing"] == "FileNotFoundError"
    assert r["cutlass"] == [], "the tvm_ffi loading path imported the DSL compiler"
    assert r["codegen_or_jinja"] == []


# ---- every launch knob compiles on every arch ------------------------------------------------------
KNOB_VARIANTS = [
    "qkv_d512r64_fp8_ds_mla_bf16_sm90",
    "qkv_d512r64_fp8_ds_mla_bf16_sm100",
    "qkv_d512r64_fp8_ds_mla_bf16_sm120",
]


@pytest.mark.slow
def test_every_launch_knob_compiles_on_every_arch(tmp_path):
    """The GPU suite's knob configs (run there against the reference on sm_90a) compile for SM100 and
    SM120 too, with the knobs visible in the PTX and no local memory."""
    from tests.gpu.cases import CONFIG_KEYS

    cmd = [
        sys.executable,
        "-m",
        "attn_prologue",
        "build",
        "--cache-dir",
        str(tmp_path),
        "--targets",
        "sm_90a,sm_100a,sm_120a",
        "--config",
        ",".join(CONFIG_KEYS),
        "--variants",
        *KNOB_VARIANTS,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    cache = KernelCache(tmp_path)
    for variant in KNOB_VARIANTS:
        target = parse_name(variant).arch.targets[0]
        ptxs = {}
        for key in CONFIG_KEYS:
            cfg = LaunchConfig.from_key(key)
            k = KernelKey(variant, cfg, target)
            meta = cache.read_meta(k)
            assert meta is not None and meta["config"] == key, (variant, key)
            ptx = (cache.entry_dir(k) / "kernel.ptx").read_text()
            assert_config_in_ptx(ptx, cfg)
            assert ("ld.global.nc" in ptx) == cfg.non_coherent
            assert meta["ptx"]["local_memory"] is False and meta["resources"]["frame_bytes"] == 0, (
                variant,
                key,
            )
            ptxs[key] = ptx
        assert len(set(ptxs.values())) == len(CONFIG_KEYS)  # every knob changes the code
