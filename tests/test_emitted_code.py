"""What the compiler emits for every built kernel, read from its PTX and cubin: 128-bit global
accesses, native conversions only in native modules, no local memory, the launch config compiled in,
64-bit token offsets (by data flow), the exported signature's shared token count (every launch knob
on every arch: test_emitted_knobs.py)."""

from __future__ import annotations

import collections
import re
import subprocess
import sys

import pytest
from attn_prologue import index_q
from attn_prologue.codegen import build
from attn_prologue.codegen.plan import make_plan
from attn_prologue.formats import ElementCode, ScaleCode
from attn_prologue.index_q import IndexQFlag
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import Conversions, Op, QOut, Variant, parse_name

from .support.build import ENTRIES, ENTRY_IDS, kernels_only_env, meta_of, ptx_of

# the writers' entries and the indexer Q's (its own outputs and access widths: the index_q tests below)
WRITERS = [(e, i) for e, i in zip(ENTRIES, ENTRY_IDS) if e[0].op is not Op.INDEX_Q]
INDEX_Q = [(e, i) for e, i in zip(ENTRIES, ENTRY_IDS) if e[0].op is Op.INDEX_Q]
WRITER_ENTRIES, WRITER_IDS = [e for e, _ in WRITERS], [i for _, i in WRITERS]
INDEX_Q_ENTRIES, INDEX_Q_IDS = [e for e, _ in INDEX_Q], [i for _, i in INDEX_Q]


# ---- PTX and cubin facts, per entry ----------------------------------------------------------------
def _tail_slots(plan: dict, split: int = 1) -> int:
    lanes = plan["lanes_per_row"] * split  # a KV row over `split` warps (LaunchConfig.row_split)
    return sum(1 for s in range(plan["slots"] // split) if (s + 1) * lanes > plan["tail_vector"])


def expected_min_128bit_loads(v: Variant, config: LaunchConfig | None = None) -> int:
    """Distinct 128-bit read-only loads of one pass of each kind: row vectors + cos and sin vectors, in
    each kernel of the module (a kv-only module's plain kernel and its compressed writers' scan kernel)."""
    plan = make_plan(v)
    split = config.row_split if config else 1
    per_row = plan["slots"] // split + 2 * _tail_slots(plan, split)
    n = per_row  # kv
    if v.op is Op.KV_NORM:
        n += plan["slots"]  # norm weights
    if v.op.has_q:  # a Q row's lanes: the config's (LaunchConfig.q_lanes) or the module's
        q_lanes = (config.q_lanes if config else 0) or plan["q_lanes_per_row"]
        q_slots = v.head_dim // (8 * q_lanes)
        q_tail = sum(1 for s in range(q_slots) if (s + 1) * q_lanes > plan["tail_vector"])
        n += q_slots + 2 * q_tail
    return n if v.op.has_q else 2 * n


def expected_store_bits(v: Variant) -> set[int]:
    f = v.format
    bits = {{ElementCode.E4M3: 64, ElementCode.E2M1: 32, ElementCode.BF16: 128}[f.element]}  # data: 8 values
    if f.rope_tail_bf16:
        bits.add(128)  # 8 bf16 of the rope tail
    if f.scale in (ScaleCode.UE8M0, ScaleCode.E4M3):
        bits.add(8)  # scale bytes (and pad bytes)
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
@pytest.mark.parametrize("v, key", WRITER_ENTRIES, ids=WRITER_IDS)
def test_global_accesses_are_128_bit(built, v, key):
    meta, ptx = meta_of(built, key), ptx_of(built, key)
    facts = meta["ptx"]
    cfg = key.config
    # q, kv and cos/sin (and norm weights): 128-bit loads. Rows take the streaming path (.cs) when the
    # config says so, else the read-only path (.nc) when it says so; nothing else does: cos/sin and the
    # norm weights are read before the PDL wait, coherent (ptxas keeps those loads before it)
    assert facts["max_load_bits"] == 128
    scalars = {64} | ({32} if v.format.needs_tensor_scale or v.q_out is QOut.FP8 else set())
    read_only_rows = cfg.non_coherent and not cfg.streaming and not cfg.pdl  # (KernelBase.rows_non_coherent)
    assert _widths(meta, "ld.cs") == ({128} if cfg.streaming else set())
    assert _widths(meta, "ld.nc") == ({128} if read_only_rows else set())
    assert ("ld.global.nc." in ptx) == read_only_rows
    # the other loads: slot and position (int64), kv_scale / q_scale (float32), cos/sin and norm
    # weights (128-bit, plain), and rows on neither path
    assert _widths(meta, "ld") == scalars | {128}
    n_128 = sum(
        n for k, n in facts["global_access_bits"].items() if k.startswith("ld") and k.endswith(".128")
    )
    assert n_128 >= expected_min_128bit_loads(v, cfg)
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
@pytest.mark.parametrize("v, key", WRITER_ENTRIES, ids=WRITER_IDS)
def test_native_conversions_only_in_native_modules(built, v, key):
    meta, ptx = meta_of(built, key), ptx_of(built, key)
    native = v.conversions is Conversions.NATIVE
    assert native == (v.arch.value in ("sm100", "sm120") and not v.name.endswith("_portable"))
    wants_ue8m0 = native and v.format.scale in (ScaleCode.UE8M0, ScaleCode.F32_POW2)
    wants_e2m1 = native and v.format.element is ElementCode.E2M1
    assert (meta["ptx"]["cvt_ue8m0x2"] > 0) == wants_ue8m0 == ("cvt.rp.satfinite.ue8m0x2" in ptx)
    assert (meta["ptx"]["cvt_e2m1x2"] > 0) == wants_e2m1 == ("cvt.rn.satfinite.e2m1x2" in ptx)
    if wants_e2m1:
        assert meta["ptx"]["cvt_e2m1x2"] >= 4  # 8 values per 32-bit word, two per cvt
    # e4m3 is native everywhere: wherever an e4m3 value is written (NVFP4: its group scales)
    nvfp4 = v.format.scale is ScaleCode.E4M3
    wants_e4m3 = v.format.element is ElementCode.E4M3 or v.q_out is QOut.FP8 or nvfp4
    assert (meta["ptx"]["cvt_e4m3x2"] > 0) == wants_e4m3
    # an NVFP4 scale is used as its e4m3 value (decoded back exactly), dividing with IEEE rounding
    # where the format divides (an approximate division misplaces exact ties); lean_quant's quotient is
    # RN(1/s) and one exact correction instead (tests/test_lean_quant_cpu.py), never an approximate one
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == nvfp4
    if nvfp4 and v.format.divide_by_scale:
        assert ("div.rn.f32" in ptx) != key.config.lean_quant
        assert "div.approx" not in ptx and "div.full" not in ptx


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_no_local_memory(built, v, key):
    meta = meta_of(built, key)
    assert meta["ptx"]["local_memory"] is False
    assert meta["resources"]["frame_bytes"] == 0
    assert meta["resources"]["min_stack_bytes"] == 0
    assert meta["resources"]["local_sections"] == 0
    assert not re.search(r"\b(ld|st)\.local\b", ptx_of(built, key))


@pytest.mark.slow
@pytest.mark.parametrize("v, key", ENTRIES, ids=ENTRY_IDS)
def test_launch_config_is_compiled_in(built, v, key):
    assert_config_in_ptx(ptx_of(built, key), key.config)


def assert_config_in_ptx(ptx: str, cfg: LaunchConfig) -> None:
    """In every kernel of the module (a kv-only module has its plain kernel and its scan kernel)."""
    kernels = len(re.findall(r"\.entry\b", ptx))
    assert kernels >= 1
    assert re.findall(r"\.reqntid (\d+), 1, 1", ptx) == [str(32 * cfg.warps_per_cta)] * kernels
    # PDL: one trigger per kernel, and a wait in each kind of pass (before its first row load or write)
    launches, waits = (
        len(re.findall(r"griddepcontrol\.launch_dependents", ptx)),
        len(re.findall(r"griddepcontrol\.wait", ptx)),
    )
    assert (launches, waits >= kernels) == ((kernels, True) if cfg.pdl else (0, False))
    if cfg.pdl:  # the trigger comes first: before any global access or wait of its kernel
        for body in re.split(r"\.entry\b", ptx)[1:]:
            trigger = body.index("griddepcontrol.launch_dependents")
            first_access = re.search(r"\b(ld|st|atom|red)\.global\b|griddepcontrol\.wait", body)
            assert first_access is None or trigger < first_access.start()


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


def _kernel_bodies(ptx: str) -> list[str]:
    """Each kernel's text (a kv-only module has two; registers are named per kernel)."""
    starts = [m.start() for m in re.finditer(r"\.entry\b", ptx)]
    return [ptx[ptx.index("{", a) : b] for a, b in zip(starts, [*starts[1:], len(ptx)], strict=True)]


def _instructions(body: str) -> list[dict]:
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
    """(global accesses checked, problems) for the rule above, summed over the module's kernels."""
    checked, problems = 0, []
    for body in _kernel_bodies(ptx):
        n, found = _kernel_address_problems(_instructions(body))
        checked, problems = checked + n, problems + found
    return checked, problems


def _kernel_address_problems(ins: list[dict]) -> tuple[int, list[str]]:
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
@pytest.mark.parametrize("v, key", WRITER_ENTRIES, ids=WRITER_IDS)
def test_token_offsets_are_64_bit(built, v, key):
    ptx = ptx_of(built, key)
    checked, problems = address_problems(ptx)
    # every row load and every cache/q_out store is token-indexed
    assert checked >= expected_min_128bit_loads(v, key.config) - (
        make_plan(v)["slots"] if v.op is Op.KV_NORM else 0
    )
    assert not problems, "\n".join(problems[:10])
    assert meta_of(built, key)["ptx"]["mul_wide_s64_or_64bit_mad"] > 0


_SIGNATURE = re.compile(rb"__call__\((.*?)\)`")


@pytest.mark.slow
@pytest.mark.parametrize("v, key", WRITER_ENTRIES, ids=WRITER_IDS)
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


# ---- the indexer's Q (templates/index_q.py.jinja) ---------------------------------------------------
def index_q_shuffles(cfg: LaunchConfig, mx: bool, hadamard: bool) -> int:
    """A row's butterfly shuffles: on L lanes (8, or q_lanes 4) a lane holds 128 / L values in 16 / L slots; the
    transform's log2(L) stages that cross lanes move each value; the amax takes 2 a slot (a 32-value block
    is a slot's vector on 4 lanes) under MXFP4, log2(L) over the row under FP8."""
    lanes = cfg.q_lanes or 8
    values, crossing = 128 // lanes, lanes.bit_length() - 1
    amax = 2 * (16 // lanes) if mx else crossing
    return amax + (crossing * values if hadamard else 0)


@pytest.mark.slow
@pytest.mark.parametrize("v, key", INDEX_Q_ENTRIES, ids=INDEX_Q_IDS)
def test_index_q_accesses(built, v, key):
    """q rows and cos/sin in 128-bit loads (rows .cs or .nc as the config says, .nc only without PDL),
    positions 64-bit, weights 16-bit; codes 64-bit (8 e4m3) or 32-bit (8 E2M1), MXFP4 scale bytes,
    weights_out 32-bit or 16-bit. The E2M1 conversion is native exactly in the native modules, no UE8M0
    instruction anywhere (the scales come from the float32 bits), e4m3 on every target."""
    meta, ptx = meta_of(built, key), ptx_of(built, key)
    cfg, mx = key.config, v.cache_format == "mxfp4"
    assert _widths(meta, "ld.cs") == ({128} if cfg.streaming else set())
    assert _widths(meta, "ld.nc") == (
        {128} if cfg.non_coherent and not cfg.streaming and not cfg.pdl else set()
    )
    assert _widths(meta, "ld") == {16, 64, 128}
    codes = _widths(meta, "st") | _widths(meta, "st.cs")
    assert codes == ({32, 8, 16} if mx else {64, 32, 16})
    bits = max(cfg.folded_numerics, 0)  # (every index_q module is built folded to one preset's bits)
    hadamard = bool(bits & IndexQFlag.HADAMARD)
    # (the Hadamard rows' ties-down codes too: nearest-even codes of the shrunk values, where rounded)
    native = v.conversions is Conversions.NATIVE and mx
    assert (meta["ptx"]["cvt_e2m1x2"] >= 8) == native and (meta["ptx"]["cvt_e2m1x2"] > 0) == native
    assert ptx.count("shfl.sync.bfly") == index_q_shuffles(cfg, mx, hadamard)
    assert ptx.count("fma.rp.f32") == 0  # (the float32 ties-down codes: UNROUNDED Hadamard MXFP4 rows only)
    assert meta["ptx"]["cvt_ue8m0x2"] == 0
    assert (meta["ptx"]["cvt_e4m3x2"] > 0) == (not mx)
    checked, problems = address_problems(ptx)
    assert checked >= 2 and not problems, "\n".join(problems[:10])
    # q_in, weights, q_out, q_scales, weights_out and positions share the token count
    spec = _SIGNATURE.search((built.cache.entry_dir(key) / "kernel.so").read_bytes())
    dims = dict(re.findall(rb"(\w+): Tensor\(\[(\w+)", spec.group(1)))
    tokens = {dims[n] for n in (b"q_in", b"weights", b"q_out", b"weights_out", b"positions")}
    assert len(tokens) == 1 and (not mx or dims[b"q_scales"] in tokens), spec.group(1)


@pytest.mark.slow
def test_index_q_takes_int32_positions_through_its_own_module(tmp_path):
    """LaunchConfig.positions32 (SGLang's int32 positions): the compiled signature takes positions as int32,
    loaded 32 bits wide, on SM90 and SM120 (every preset's folded module); the writers refuse the knob. The
    same build takes the other index_q-only knob, rows on 4 lanes (q_lanes 4): its shuffles, no local memory."""
    cfg = LaunchConfig(
        warps_per_cta=4, pdl=True, non_coherent=True, streaming=True, positions32=True, q_lanes=4
    )
    assert LaunchConfig.from_key(cfg.key) == cfg and cfg.key.endswith("_q4_p32")
    writer_cfg = LaunchConfig(warps_per_cta=4, positions32=True)
    assert "int32 positions" in parse_name("kv_d128r64_fp8_token_bf16_sm90").refusal(writer_cfg)
    assert "on 4 lanes" in parse_name("qkv_d128r64_fp8_token_bf16_sm90").refusal(LaunchConfig(q_lanes=4))
    names = ("index_q_d128r64_mxfp4_bf16_sm90", "index_q_d128r64_fp8_token_bf16_sm120")
    cmd = [sys.executable, "-m", "attn_prologue", "build", "--cache-dir", str(tmp_path), "--targets",
           "sm_90a,sm_120f", "--config", cfg.key, "--variants", *names]  # fmt: skip
    env = kernels_only_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cache = KernelCache(tmp_path)
    for name in names:
        for bits in build.folded_bits(parse_name(name), index_q.PRESETS) | {0}:
            key = KernelKey(name, cfg.folded_to(bits, 0), parse_name(name).arch.targets[0])
            meta = cache.read_meta(key)
            assert 32 in _widths(meta, "ld") and 64 not in _widths(meta, "ld"), meta["ptx"][
                "global_access_bits"
            ]
            spec = _SIGNATURE.search((cache.entry_dir(key) / "kernel.so").read_bytes())
            assert re.search(rb"positions: Tensor\(\[\w+\], int32\)", spec.group(1)), spec.group(1)
            ptx = (cache.entry_dir(key) / "kernel.ptx").read_text()
            mx, hadamard = "mxfp4" in name, bool(bits & IndexQFlag.HADAMARD)
            assert ptx.count("shfl.sync.bfly") == index_q_shuffles(key.config, mx, hadamard), (name, bits)
            assert meta["ptx"]["local_memory"] is False and meta["resources"]["frame_bytes"] == 0
