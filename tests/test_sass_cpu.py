"""The SASS counter (attn_prologue.lab.sass) on modules compiled here for sm_90a and sm_120f into a
temporary cache, and the copy yardsticks compiled for every family. No GPU is needed; nvdisasm comes
with the test extra (the nvidia-cuda-nvdisasm wheel)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

import pytest
import torch
from attn_prologue.codegen.plan import make_plan
from attn_prologue.jit import artifacts
from attn_prologue.jit.kernel_cache import KernelCache, KernelKey
from attn_prologue.lab import copy_kernel, sass, sass_reader, timing
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import Op, parse_name

from .support.interleaved import interleaved_copy

NVFP4 = "kv_d512r64_nvfp4_v41_bf16"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return KernelCache(tmp_path_factory.mktemp("sass-cache"))


def counted(cache, variant, **kw):
    v = parse_name(variant)
    key = KernelKey(variant, v.arch.default_config, v.arch.targets[0])
    cache.ensure_built(key)
    return sass.count(variant, key.config, key.target, cache=cache, **kw)


def expected_memory_instructions(variant: str) -> int:
    """Global accesses of one KV row pass, from the template: the slot and position, the row's vectors
    (and the norm weights' for kv_norm), cos and sin for the vectors in the rope tail; a data store per
    vector and a scale store per slot (the lanes that own a group store it)."""
    v = parse_name(variant)
    plan = make_plan(v)
    tail_slots = sum((s + 1) * plan["lanes_per_row"] > plan["tail_vector"] for s in range(plan["slots"]))
    weights = plan["slots"] if v.op is Op.KV_NORM else 0
    return 2 + plan["slots"] + weights + 2 * tail_slots + 2 * plan["slots"]


@pytest.mark.parametrize("variant", [f"{NVFP4}_sm90", f"{NVFP4}_sm120", "kv_norm_d128r64_mxfp4_bf16_sm90"])
def test_counts_the_built_module_row_by_row(cache, variant):
    """The twin with line info has the built module's code; every counted instruction has a class; the
    memory instructions are exactly the row's accesses; a lane's values are D / LANES_PER_ROW."""
    c = counted(cache, variant)
    assert c["matches_cache"] is True
    assert sum(c["classes"].values()) == c["instructions"] > 0
    assert c["classes"]["memory"] == expected_memory_instructions(variant)
    plan = make_plan(parse_name(variant))
    assert c["values_per_lane"] == parse_name(variant).head_dim // plan["lanes_per_row"]
    assert c["per_value"] == round(c["instructions"] / c["values_per_lane"], 2)
    # rare-input code is left out: the slow-path subroutines exist and are called, but not counted
    assert c["subroutine_call_sites"] and c["instructions"] < c["static_main"]


def test_native_conversions_count_fewer_instructions_than_portable(cache):
    """The same module with hardware E2M1 conversions (sm_120f) against its portable build: the software
    rounding costs instructions, and only the portable module converts with integer/float arithmetic."""
    native, portable = counted(cache, f"{NVFP4}_sm120"), counted(cache, f"{NVFP4}_sm120_portable")
    assert portable["instructions"] > native["instructions"] + 100
    assert portable["classes"]["memory"] == native["classes"]["memory"]
    assert portable["ieee_divisions"] == native["ieee_divisions"] == 16  # x / s: one per value of a lane


def test_compressed_writers_count_the_group_boundary_code(cache):
    """A compress ratio adds the boundary test and the group start (integer division and modulo)."""
    plain = counted(cache, f"{NVFP4}_sm90")
    ratio = counted(cache, f"{NVFP4}_sm90", compress=True)
    assert ratio["instructions"] > plain["instructions"]
    assert ratio["classes"]["conversion"] > plain["classes"]["conversion"]  # I2F.RP of each integer division


def test_parity_choice_code_is_counted_apart_from_the_defaults_path(cache):
    """Blocks wholly inside an `if` on a set `numerics` bit (the NoPE identity rotation, the exact FP4
    zero, ...) run only when a caller asks for that choice: the defaults' count leaves them out, the
    union counts them. The lines that mark them are read from the module's syntax tree."""
    c = counted(cache, "kv_d512r64_fp8_ds_mla_bf16_sm90")  # (ptxas predicates the NVFP4 ones instead)
    assert c["instructions_every_choice"] > c["instructions"]
    path = sass.compiler.load_module("kv_d512r64_fp8_ds_mla_bf16_sm90").__file__
    text = open(path).read().splitlines()
    base = sass.compiler.kernel_base_path()
    lines = sass._choice_lines(path)
    name = Path(path).name
    guarded = [(name, n) for n, t in enumerate(text, 1) if "self.rotate_nope(ys, sub)" in t]
    defaults = [n for n, t in enumerate(text, 1) if "if (args.numerics & FP32_ROTATED_ROW) == 0" in t]
    # a method only called from such a body, in the methods the module's Kernel inherits
    rotate_nope = [
        (base.name, n) for n, t in enumerate(base.read_text().splitlines(), 1) if "def rotate_nope(" in t
    ]
    assert guarded and set(guarded) <= lines  # the body of `if (args.numerics & NOPE_ROTATION) != 0`
    assert rotate_nope and set(rotate_nope) <= lines
    assert defaults and (name, defaults[0] + 1) not in lines  # the body of a `== 0` test runs by default
    # the base's methods called on the defaults' path are not choice code
    waits = [
        (base.name, n)
        for n, t in enumerate(base.read_text().splitlines(), 1)
        if "def wait_for_producer(" in t
    ]
    assert waits and not set(waits) & lines


def test_qkv_counts_q_rows_and_kv_rows_apart(cache):
    q = counted(cache, "qkv_d512r64_fp8_ds_mla_bf16_sm90", row="q")
    kv = counted(cache, "qkv_d512r64_fp8_ds_mla_bf16_sm90", row="kv")
    assert q["instructions"] != kv["instructions"]
    # a Q row loads its row and cos/sin and stores its row; it stores no scale
    assert q["classes"]["memory"] < kv["classes"]["memory"]
    with pytest.raises(ValueError):
        counted(cache, f"{NVFP4}_sm90", row="q")


def test_a_staged_interleaved_q_unit_counts_the_stage_not_the_straight_stores():
    """An interleaved module with two Q rows a warp stages them (4 vectors a lane to shared memory and
    back) and keeps straight stores for odd head counts behind a warp-uniform branch: its Q count holds
    head-major's global accesses plus those 8, not the straight path's 4 extra global stores. With one
    row a warp the straight stores are the only ones and count, as head-major's do."""
    memory = {}
    for variant in ("qkv_d512r64_fp8_ds_mla_bf16_sm90", "qkv_qi_d512r64_fp8_ds_mla_bf16_sm90"):
        for key in ("w2_u2_pdl1_nc1_lq_d", "w4_u1_pdl1_nc1_cs"):
            c = sass.count(variant, LaunchConfig.from_key(key), "sm_90a", row="q")
            memory[variant.split("_")[1], key] = c["classes"]["memory"]
    assert memory["qi", "w2_u2_pdl1_nc1_lq_d"] == memory["d512r64", "w2_u2_pdl1_nc1_lq_d"] + 8, memory
    assert memory["qi", "w4_u1_pdl1_nc1_cs"] == memory["d512r64", "w4_u1_pdl1_nc1_cs"], memory


def test_per_value_counts_every_pass_of_a_unit(cache):
    """With passes_per_warp = 2 a warp's unit is two rows, unrolled: the count holds both rows' accesses
    (twice the memory instructions of one) and per value divides by both rows' values, so it stays
    near the one-row figure instead of doubling (a bench row once reported 30.6 for 15.3)."""
    variant = "qkv_d512r64_fp8_ds_mla_bf16_sm90"
    one = dataclasses.replace(parse_name(variant).arch.default_config, passes_per_warp=1)
    two = dataclasses.replace(one, passes_per_warp=2)
    for row in ("q", "kv"):
        a, b = (sass.count(variant, c, "sm_90a", row=row) for c in (one, two))
        assert b["values_per_lane"] == 2 * a["values_per_lane"]
        assert b["classes"]["memory"] == 2 * a["classes"]["memory"], row
        assert 0.8 * a["per_value"] < b["per_value"] < 1.1 * a["per_value"], (
            row,
            a["per_value"],
            b["per_value"],
        )


def test_without_nvdisasm_the_reason_is_given(monkeypatch, tmp_path):
    monkeypatch.setattr(sass_reader, "nvdisasm_candidates", lambda: [tmp_path / "nvdisasm"])
    sass.nvdisasm.cache_clear()
    try:
        assert "pip install nvidia-cuda-nvdisasm" in sass.tool_versions()["missing"]
        with pytest.raises(sass.SassToolMissing, match="no nvdisasm found"):
            sass.disassemble(b"\x7fELF")
        assert sass.summary({"error": "no nvdisasm found"}) == "n/a"
    finally:
        sass.nvdisasm.cache_clear()


def test_the_cubin_is_found_inside_a_shared_object():
    with pytest.raises(sass.SassError):
        sass.embedded_cubin(b"\x7fELF\x02" + bytes(64))


# ---- the copy yardsticks ------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["sm_90a", "sm_100a", "sm_120f"])
def test_copy_kernels_compile_to_their_vectors_per_thread(target):
    """Each SM copy kind moves its vectors with one 128-bit read-only load and one 128-bit store each,
    in CTAs of its threads; a persistent kind loops over chunks (a backward branch), the others do not."""
    assert set(timing.COPY_KINDS) == set(copy_kernel.COPY_KINDS) | {"memcpy"}
    extra = [
        copy_kernel.CopyKind.from_key(k) for k in ("t64_v4_row_c8", "t64_v4_row_qi", "t128_v8_row_qi_c4")
    ]
    for kind in [*copy_kernel.COPY_KINDS.values(), *extra]:
        with tempfile.TemporaryDirectory() as dump:
            ptx = copy_kernel.compile_copy(target, kind, f"--keep-ptx --dump-dir {dump}").artifacts.PTX
        assert re.search(rf"^\.target {target}$", ptx, re.M)
        assert re.search(rf"^\.reqntid {kind.threads}, 1, 1$", ptx, re.M)
        assert len(re.findall(r"ld\.global\.nc\.v4", ptx)) == kind.vectors
        assert len(re.findall(r"st\.global\.v4", ptx)) == kind.vectors
        assert not re.search(r"\b(ld|st)\.local\b", ptx)
        seen, backward = set(), False
        for label, jump in re.findall(r"^(\$L__BB\w+):|\bbra(?:\.uni)?\s+(\$L__BB\w+);", ptx, re.M):
            seen |= {label} - {""}
            backward |= jump in seen
        assert backward == bool(kind.ctas_per_sm), kind.key


def test_copy_kind_keys_round_trip_and_refuse_typos():
    for key in (
        "t256_v1",
        "t64_v4_row",
        "t32_v2_row_c16",
        "t1024_v8_c1",
        "t64_v4_row_qi",
        "t32_v2_row_qi_c8",
    ):
        assert copy_kernel.CopyKind.from_key(key).key == key
    assert copy_kernel.CopyKind.from_key("sm1") == copy_kernel.CopyKind(256, 1)
    assert copy_kernel.CopyKind.from_key("t64_v4_row_qi").qi
    for bad in ("t64_v3", "t48_v1", "t64_v4_rows", "sm2", "t64_v4_qi", "t64_v1_row_qi", "t64_v4_qi_row"):
        with pytest.raises(ValueError, match="copy kind|must be|needs whole rows"):
            copy_kernel.CopyKind.from_key(bad)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_interleaved_copy_moves_every_vector_once_in_runs_of_its_rows(rows):
    """qi_indices over two tokens' warps, stores and lanes: every src vector read once, every dst
    vector written once, dst = the layout of src, and each store instruction writes runs of rows x 32
    bytes (16 / rows of them), as KernelBase.store_rows_interleaved does."""
    n = 2 * copy_kernel.QI_TOKEN_VECTORS
    warps = n // (rows * copy_kernel.QI_ROW_VECTORS)
    warp, store, lane = torch.meshgrid(
        torch.arange(warps), torch.arange(2 * rows), torch.arange(32), indexing="ij"
    )
    src, dst = copy_kernel.qi_indices(warp, store, lane, rows)
    assert torch.equal(src.flatten().sort().values, torch.arange(n))
    assert torch.equal(dst.flatten().sort().values, torch.arange(n))
    moved = torch.empty(n, dtype=torch.long)
    moved[dst.flatten()] = src.flatten()  # dst[j] = src[moved[j]]
    assert torch.equal(moved, interleaved_copy(torch.arange(n), chunk=2))
    runs = dst.sort(dim=-1).values.view(warps, 2 * rows, 32 // (2 * rows), 2 * rows)
    assert bool((runs.diff(dim=-1) == 1).all()) and bool((runs[..., 0] % (2 * rows) == 0).all())


@pytest.mark.parametrize("variant", [f"{NVFP4}_sm90", f"{NVFP4}_sm120", "kv_d128r64_mxfp4_bf16_sm90"])
def test_lean_quant_counts_fewer_instructions(cache, variant):
    """The lean_quant knob (the same bytes: tests/test_lean_quant_cpu.py) drops every IEEE division of a
    row (x / s per value, 1 / s and amax / fp_max per group) and, in the portable module, the E2M1
    rounding's selects: at least 3.5 instructions per value fewer for NVFP4 (sm_90a 46.9 -> 36.1, sm_120f
    33.5 -> 29.7 once the cos/sin loads moved before the PDL wait; 4.75 before), 10% for MXFP4."""
    v = parse_name(variant)
    default, lean = v.arch.default_config, dataclasses.replace(v.arch.default_config, lean_quant=True)
    off = sass.count(variant, default, v.arch.targets[0])
    on = sass.count(variant, lean, v.arch.targets[0])
    assert off["ieee_divisions"] > 0 and on["ieee_divisions"] == 0
    assert on["classes"]["memory"] == off["classes"]["memory"]
    if v.cache_format.startswith("nvfp4"):
        assert on["per_value"] <= off["per_value"] - 3.5
    else:
        assert on["instructions"] <= 0.9 * off["instructions"]


@pytest.mark.parametrize("variant", ["kv_d512r64_fp8_ds_mla_bf16_sm90", f"{NVFP4}_sm90", f"{NVFP4}_sm120"])
def test_a_defaults_only_module_carries_no_parity_choice_code(variant):
    """LaunchConfig.defaults_only reads `numerics` as the format defaults' constant: the choices' code
    folds away (nothing is left to count apart), the defaults' path gets shorter, and the memory
    accesses of a row stay the same."""
    v = parse_name(variant)
    default = v.arch.default_config
    every = sass.count(variant, default, v.arch.targets[0])
    only = sass.count(variant, dataclasses.replace(default, defaults_only=True), v.arch.targets[0])
    assert only["instructions_every_choice"] == only["instructions"] < every["instructions"]
    assert only["classes"]["memory"] == every["classes"]["memory"]


@pytest.mark.parametrize(
    "variant, spec",
    [("kv_d512r64_fp8_ds_mla_bf16_sm90", "preset=vllm"), (f"{NVFP4}_sm90", "preset=vllm-triton")],
)
def test_a_module_folded_to_a_preset_carries_no_run_time_choice_code(variant, spec):
    """LaunchConfig.folded_numerics: the preset's bits as a constant. Its module, like a defaults_only
    one, has no choice left to branch on, and runs fewer instructions than the module reading the same
    bits at run time (the twin a call with the preset gets otherwise)."""
    v = parse_name(variant)
    default = v.arch.default_config
    bits = v.format.numerics_flags(spec)
    assert bits != v.format.numerics_flags()
    twin = sass.count(variant, default, v.arch.targets[0])
    folded = sass.count(variant, dataclasses.replace(default, folded_numerics=bits), v.arch.targets[0])
    assert folded["instructions_every_choice"] == folded["instructions"] < twin["instructions_every_choice"]
    assert folded["classes"]["memory"] == twin["classes"]["memory"]


def test_a_lane_s_values_follow_the_row_s_lanes():
    """Instructions per value divide by the values a lane holds: D / 64 with a KV row over two warps
    (row_split), D / Q_LANES_PER_ROW on a Q row."""
    split = dataclasses.replace(parse_name(f"{NVFP4}_sm90").arch.default_config, row_split=2)
    assert sass.count(f"{NVFP4}_sm90", split, "sm_90a")["values_per_lane"] == 512 // 64
    qi = parse_name("qkv_qi_d512r64_fp8_ds_mla_bf16_sm90")
    q = sass.count(qi.name, qi.arch.default_config, "sm_90a", row="q")
    assert q["values_per_lane"] == 512 // make_plan(qi)["q_lanes_per_row"]


PDL_CASES = [  # (streaming configs: their row loads are LDG.EF, told apart from the inputs read early)
    ("kv_d512r64_fp8_ds_mla_bf16_sm90", "w4_u1_pdl1_nc1_cs"),
    ("kv_d512r64_nvfp4_v41_bf16_sm120", "w4_u2_pdl1_nc1_cs_lq_r2"),
    ("kv_norm_d128r64_mxfp4_bf16_sm90", "w8_u1_pdl1_nc0_c4_cs"),
    ("qkv_d512r64_fp8_ds_mla_bf16_sm90", "w4_u2_pdl1_nc1_cs"),
    ("qkv_qi_d512r64_mxfp8_bf16_sm100", "w2_u4_pdl1_nc1_spread_cs"),
    ("qkv_d512r64_nvfp4_dsv4_bf16_sm90", "w4_u1_pdl1_nc1_cs_m12_late"),  # cos/sin after the wait
    ("kv_d128r64_fp8_token_bf16_sm120", "w4_u2_pdl1_nc1_cs_lq_late"),
]


def early_cos_sin_loads(variant: str, config: LaunchConfig, kernel: str) -> int:
    """128-bit cos/sin loads per lane that a kernel of the module issues before the PDL wait, from the
    template: for each of a warp's passes_per_warp rows (KV, and Q in a module with Q), a cos and a
    sin vector for each of the lane's slots that reaches the rope tail (KernelBase.load_tail_cos_sin);
    none in a compressed writer's scan kernel, which loads them after its rows, nor with cos_sin_late."""
    if kernel == "scan_kernel" or config.cos_sin_late:
        return 0
    v = parse_name(variant)
    plan = make_plan(v)
    kinds = [(plan["slots"] // config.row_split, plan["lanes_per_row"] * config.row_split)]
    if v.op.has_q:
        q_lanes = config.q_lanes or plan["q_lanes_per_row"]
        kinds.append((v.head_dim // (8 * q_lanes), q_lanes))
    tail = plan["tail_vector"]
    per_row = sum(sum(1 for s in range(slots) if (s + 1) * lanes > tail) for slots, lanes in kinds)
    return 2 * config.passes_per_warp * per_row


@pytest.mark.parametrize(
    "variant, key",
    [
        ("qkv_d512r64_fp8_ds_mla_bf16_sm90", "w4_u1_pdl1_nc1"),  # the H100's tuned qkv config
        ("kv_d128r64_mxfp4_bf16_sm120", "w4_u2_pdl1_nc1_lq"),
        ("index_q_d128r64_mxfp4_bf16_sm90", "w4_u1_pdl1_nc1"),
    ],
)
def test_no_non_coherent_row_load_is_issued_before_the_pdl_wait(cache, variant, key):
    """A non-coherent load (LDG.CONSTANT) may be moved by ptxas above griddepcontrol.wait (ACQBULK), where
    it reads the previous kernel's rows before that kernel wrote them: with PDL the rows load coherently
    whatever `non_coherent` says (KernelBase.rows_non_coherent). It was not so: these configs' kernels
    loaded q / kv rows before the wait, and tests/gpu/test_pdl_gpu.py failed 2 runs in 3 on an H100."""
    v = parse_name(variant)
    built = KernelKey(variant, LaunchConfig.from_key(key), v.arch.targets[0])
    cache.ensure_built(built)
    cubin = sass_reader.cached_cubin(cache, built)
    for kernel in artifacts.kernel_symbols(cubin):
        instrs, labels = sass_reader.disassemble(cubin, kernel)
        assert any(i.base == "ACQBULK" for i in instrs), kernel
        early = [i.text for i in sass.before_wait(instrs, labels) if "CONSTANT" in i.opcode]
        assert not early, (kernel, early)


@pytest.mark.parametrize("variant, key", PDL_CASES)
def test_only_early_inputs_are_read_before_the_pdl_wait(cache, variant, key):
    """What a kernel does before griddepcontrol.wait overlaps the previous kernel, so on every path it
    may only read what the caller prepared earlier (docs/op.md, "Inputs read early"): slot ids and
    positions (at most 64-bit loads), the cos/sin rows at those positions and, for kv_norm, the norm
    weights (128-bit). Every write (stores, the error counter's atomics) and every load of a row (kv,
    q_in: LDG.EF in these streaming configs) comes after the wait, and every cos/sin load but the scan
    kernel's comes before it (else it costs a dependent round trip after the wait). Read from the SASS
    of every kernel of the module."""
    v = parse_name(variant)
    config = LaunchConfig.from_key(key)
    built = KernelKey(variant, config, v.arch.targets[0])
    cache.ensure_built(built)
    cubin = sass_reader.cached_cubin(cache, built)
    weights = make_plan(v)["slots"] if v.op is Op.KV_NORM else 0
    for kernel in artifacts.kernel_symbols(cubin):
        instrs, labels = sass_reader.disassemble(cubin, kernel)
        early = sass.before_wait(instrs, labels)
        assert any(i.base == "ACQBULK" for i in instrs), kernel
        writes = [i.text for i in early if not i.base.startswith("LD")]
        rows = [i.text for i in early if ".EF" in i.opcode]
        wide = [i.text for i in early if i.base.startswith("LD") and ".128" in i.opcode]
        assert not writes, (kernel, writes)
        assert not rows, (kernel, rows)
        assert any(".EF" in i.opcode and i.base == "LDG" for i in instrs), (kernel, "no row load found")
        assert len(wide) == weights + early_cos_sin_loads(variant, config, kernel), (kernel, wide)
        assert any(i.base == "LDG" and ".128" not in i.opcode for i in early), (kernel, "no id is read early")
    # without PDL there is no wait, and the same accesses
    plain = KernelKey(variant, dataclasses.replace(config, pdl=False), v.arch.targets[0])
    cache.ensure_built(plain)
    assert not any(
        i.base == "ACQBULK" for i in sass_reader.disassemble(sass_reader.cached_cubin(cache, plain))[0]
    )
