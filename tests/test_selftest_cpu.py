"""The first-use self-test's rules on CPU: which variants are tested, what a record must say to be
trusted, and that `run` compares every output byte (a launcher whose "kernel" is the reference
passes; one that corrupts a byte fails). The GPU suite runs it on every SM90 module."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest
import torch
from attn_prologue import reference, selftest
from attn_prologue.index_q import index_q_reference
from attn_prologue.jit import compiler
from attn_prologue.jit.kernel_cache import KernelCache
from attn_prologue.launcher import Launcher
from attn_prologue.variants import ArchFamily, Conversions, QOut, generated, parse_name


def reference_kernel(v, corrupt=False):
    """A stand-in for a compiled kernel: the reference on the same buffers, in ARGUMENTS order."""

    def fn(*args):
        a = dict(zip(v.arguments, args, strict=True))
        if v.op.value == "index_q":  # (weights_scale is the scales' product, head_scale 1: the default bits)
            w_out = a["weights_out"].view(torch.float32)
            codes, scales, w, _ = index_q_reference(
                a["q_in"], a["positions"], a["cos_sin_cache"], a["weights"], a["weights_scale"], a["head_scale"],
                v.cache_format, a["numerics"], w_out.dtype,
            )  # fmt: skip
            a["q_out"].copy_(codes)
            w_out.copy_(w)
            if scales is not None:
                a["q_scales"].copy_(scales)
            if corrupt:
                a["q_out"].view(-1)[7] ^= 1
            return
        if v.op.has_q:
            q_out = a["q_out"].view(torch.float8_e4m3fn) if v.q_out is QOut.FP8 else a["q_out"]
            reference.qnorm_rope_kv_insert(
                a["q_in"], a["kv"], q_out, a["k_cache"], a["slot_mapping"], a["positions"], a["cos_sin_cache"],
                a["eps"], a["block_size"], v.cache_format, kv_scale=a.get("kv_scale"), q_scale=a.get("q_scale"),
            )  # fmt: skip
        else:
            reference.kv_rope_insert(
                a["kv"], a["k_cache"], a["slot_mapping"], a["positions"], a["cos_sin_cache"], a["block_size"],
                v.cache_format, norm_weight=a.get("norm_weight"), eps=a.get("eps", 1e-6), kv_scale=a.get("kv_scale"),
            )  # fmt: skip
        if corrupt:
            a["k_cache"].view(-1)[7] ^= 1

    return fn


SAMPLE = [
    "qkv_d512r64_fp8_ds_mla_bf16_sm120",
    "qkv_q8_d512r64_mxfp8_fp16_sm100",
    "kv_norm_d128r64_mxfp4_bf16_sm120",
    "kv_d128r64_fp8_token_fp16_sm120",
    "kv_d512r64_fp8_tensor_bf16_sm120",
    "index_q_d128r64_mxfp4_bf16_sm120",
    "index_q_d128r64_fp8_token_fp16_sm100",
]


@pytest.mark.parametrize("name", SAMPLE)
def test_run_passes_a_correct_kernel_and_catches_one_wrong_byte(name):
    v = parse_name(name)
    arena = selftest.Arena(torch.device("cpu"))
    errors = torch.zeros(2, dtype=torch.int32)
    ok, detail = selftest.run(
        Launcher(v, v.arch.default_config, "sm_120f", 0, reference_kernel(v), 1), errors, arena
    )
    assert ok, detail
    ok, detail = selftest.run(
        Launcher(v, v.arch.default_config, "sm_120f", 0, reference_kernel(v, corrupt=True), 1), errors, arena
    )
    assert not ok and ("1 output bytes" if v.op.value == "index_q" else "1 cache bytes") in detail


def test_edge_rows_cover_the_conversions_edges():
    rows = selftest.edge_rows(128)
    assert rows.shape == (8, 128) and not rows[0].any()
    assert rows.isinf().sum() == 2 and rows.isnan().sum() == 1
    ties = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}
    assert ties <= set(rows[5].abs().tolist())
    assert rows[3].abs().max() == 56.0 and rows[4].abs().max() == 56.25  # 448 * 2^-3 and just past it
    assert (rows[1, :64] < 2.0**-126).all()  # subnormal in bf16 and fp16 alike


def test_only_variants_with_a_distinct_fallback_are_tested(monkeypatch):
    monkeypatch.delenv(selftest.ENV_MODE, raising=False)
    tested = {n for n in generated() if selftest.fallback_to_test(parse_name(n)) is not None}
    assert tested and all(parse_name(n).conversions is Conversions.NATIVE for n in tested)
    assert all(parse_name(n).arch is not ArchFamily.SM90 for n in tested)
    assert (
        selftest.fallback_to_test(parse_name("kv_d512r64_bf16_bf16_sm120")) is None
    )  # no conversions: one module
    monkeypatch.setenv(selftest.ENV_MODE, "always")
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm90")
    assert selftest.fallback_to_test(v) == v  # exercised on itself (how the GPU suite runs it on SM90)
    monkeypatch.setenv(selftest.ENV_MODE, "off")
    assert selftest.fallback_to_test(parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")) is None


def test_a_record_is_trusted_only_for_the_variant_or_its_fallback_and_its_source(tmp_path):
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")
    fb = v.portable_fallback
    env = "GPU|sm120|0.1.0|dsl"
    records = selftest.Records(tmp_path)
    records.store(env, v, fb, False, "planted")
    assert selftest.Records(tmp_path).lookup(env, v, fb) == fb
    data = json.loads(records.path.read_text())
    for forged in ("qkv_d512r64_mxfp8_bf16_sm120", "rm -rf /", None):  # another module, junk, nothing
        data[env][v.name]["use"] = forged
        records.path.write_text(json.dumps(data))
        assert selftest.Records(tmp_path).lookup(env, v, fb) is None  # not trusted: test again
    data[env][v.name].update(use=fb.name, source="0" * 64)  # recorded for another module source
    records.path.write_text(json.dumps(data))
    assert selftest.Records(tmp_path).lookup(env, v, fb) is None
    records.path.write_text("[]")
    assert selftest.Records(tmp_path).lookup(env, v, fb) is None
    assert records.path.parent == tmp_path  # inside the cache directory, not beside it


def test_a_record_is_written_through_a_private_temporary_file(tmp_path):
    records = selftest.Records(tmp_path)
    trap = tmp_path / "elsewhere"
    (tmp_path / "selftest.json.tmp").symlink_to(trap)  # a predictable name is not used
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")
    records.store("env", v, v, True, "ok")
    assert not trap.exists() and records.path.is_file() and not records.path.is_symlink()
    assert (records.path.stat().st_mode & 0o077) == 0


@pytest.mark.parametrize("name,d", [("bf16", 128), ("fp8_ds_mla", 512)])
def test_only_the_payload_of_a_bf16_nan_is_forgiven(name, d):
    """Formats store bf16 NaNs with any payload (their NaN policy says so); every other byte, and a
    NaN turning into a number, still counts."""
    from attn_prologue.formats import get_format

    fmt, bs = get_format(name), 4
    page = bs * fmt.bytes_per_token(d)
    cache = torch.randint(0, 256, (2, page), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    at = fmt.data_bytes(d) - 2  # the last bf16 value of token 0's record (rope tail or full row)
    a, b = cache.clone(), cache.clone()
    a[0, at : at + 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)  # 0x7FC0: quiet NaN
    b[0, at : at + 2] = torch.tensor([0x81, 0xFF], dtype=torch.uint8)  # 0xFF81: another NaN (negative)
    canon = selftest.bf16_nans_canonical
    assert torch.equal(canon(a, fmt, d, bs), canon(b, fmt, d, bs))
    b[0, at : at + 2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # 1.0
    assert not torch.equal(canon(a, fmt, d, bs), canon(b, fmt, d, bs))
    one, two = cache.clone(), cache.clone()  # any other difference: here page 1's first two bytes
    one[1, :2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0 (or two fp8 codes)
    two[1, :2] = torch.tensor([0x00, 0x40], dtype=torch.uint8)  # bf16 2.0
    assert not torch.equal(canon(one, fmt, d, bs), canon(two, fmt, d, bs))


@pytest.mark.parametrize(
    "junk",
    [
        lambda env, name, src: {env: "x"},
        lambda env, name, src: {env: [1]},
        lambda env, name, src: {env: {name: {"use": [], "source": src}}},
        lambda env, name, src: {env: {name: {"use": {"a": 1}, "source": src}}},
        lambda env, name, src: {env: {name: "use the fallback"}},
    ],
    ids=["env-is-text", "env-is-list", "use-is-list", "use-is-object", "entry-is-text"],
)
def test_a_record_of_the_wrong_type_is_no_record_and_is_replaced(tmp_path, junk):
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")
    fb, env = v.portable_fallback, "GPU|sm120|0.1.0|dsl"
    records = selftest.Records(tmp_path)
    records.path.write_text(json.dumps(junk(env, v.name, compiler.source_hash(v.name))))
    assert selftest.Records(tmp_path).lookup(env, v, fb) is None  # a miss: the test runs again
    selftest.Records(tmp_path).store(env, v, fb, False, "after junk")
    assert selftest.Records(tmp_path).lookup(env, v, fb) == fb


def test_a_fifo_in_place_of_the_record_is_no_record_found_without_blocking(tmp_path):
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")
    fifo = tmp_path / selftest.RECORD_NAME
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(
        target=lambda: got.append(selftest.Records(tmp_path).lookup("env", v, v)), daemon=True
    )
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # blocked opening the FIFO: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the record reader blocked on a FIFO")
    assert got == [None]


@pytest.mark.parametrize("value,injects", [("0", False), ("off", False), ("1", True), ("TRUE", True)])
def test_the_fault_is_injected_only_when_asked_and_its_verdict_is_never_recorded(
    tmp_path, monkeypatch, value, injects
):
    v = parse_name("kv_d512r64_fp8_tensor_bf16_sm120")
    monkeypatch.setenv(selftest.ENV_FAULT, value)
    errors, arena = torch.zeros(2, dtype=torch.int32), selftest.Arena(torch.device("cpu"))
    ok, detail = selftest.run(
        Launcher(v, v.arch.default_config, "sm_120f", 0, reference_kernel(v), 1), errors, arena
    )
    assert ok is not injects, detail
    records = selftest.Records(tmp_path)
    records.store("env", v, v.portable_fallback or v, ok, detail)
    assert records.lookup("env", v, v.portable_fallback or v) is not None  # this process keeps it
    assert records.path.exists() is not injects  # later processes never see a verdict on a fake fault


@pytest.mark.parametrize("umask", [0o002, 0o000])
def test_the_records_missing_parents_are_made_private_whatever_the_umask(tmp_path, umask):
    """Issue 51, item 5: made with the umask's 0775 or 0777, every later load from that cache was refused."""
    root = tmp_path / "a" / "b" / "cache"
    v = parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")
    old = os.umask(umask)
    try:
        selftest.Records(root).store("env", v, v, True, "ok")
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
    assert stat.S_IMODE(os.stat(root / "selftest.json").st_mode) == 0o600
    assert KernelCache(root).read_files((), ("selftest.json",))["selftest.json"]  # trusted, not refused
