"""Edges that were untyped or crashing (issue 51, item 6), each now the package's typed error before
anything is written: a blank or unparsable $CC / $CXX, a trusted library without its symbol, cache
files larger than the cache writes, ScratchPool arguments, a q_out that requires grad, a bool
block_size or eps given to the torch ops, a miss the cache cannot build (shared, read-only, full) and
a kernel that is not built."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch
from attn_prologue import native, ops
from attn_prologue.errors import AttnPrologueError, InputError, ScratchError
from attn_prologue.jit import kernel_cache
from attn_prologue.jit.kernel_cache import CacheWriteError, KernelCache, KernelLoadError, KernelNotBuiltError
from attn_prologue.scratch import ScratchPool

from .support.bad_inputs import KV_ARGS, snapshot, unchanged, valid, valid_kv
from .support.cache_entry import KEY
from .support.stub_kernels import StubRuntime

QKV = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
       "cache_format")  # fmt: skip


# ---- the compiler command -----------------------------------------------------------------------
@pytest.mark.parametrize("value", [" ", '"'])
def test_a_blank_or_unparsable_compiler_is_a_typed_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("CXX", value)
    with pytest.raises(native.NativeBuildError, match=r"CXX=.* (names no compiler|is not a command)"):
        native.entry_key("torch_ops")


def test_import_survives_an_unparsable_compiler():
    env = {**os.environ, "CC": '"', "CXX": " "}
    run = subprocess.run([sys.executable, "-c", "import attn_prologue; print('imported')"], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]


# ---- a trusted library without its symbol ---------------------------------------------------------
@pytest.fixture(scope="module")
def plain_library(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("plain")
    (d / "plain.c").write_text("int unrelated(void) { return 7; }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "plain.so"), str(d / "plain.c")], check=True)
    return (d / "plain.so").read_bytes()


def test_a_kernel_library_without_its_symbol_is_a_kernel_load_error(plain_library, tmp_path):
    with pytest.raises(KernelLoadError, match="attn_prologue_kernel"):
        KernelCache(tmp_path / "cache")._load_verified(KEY, plain_library)


def test_a_torch_ops_library_without_its_reader_is_a_native_build_error(plain_library, tmp_path):
    (tmp_path / "plain.so").write_bytes(plain_library)
    with pytest.raises(native.NativeBuildError, match="ap_dltensor_from_pyobject"):
        native.reader_of(ctypes.CDLL(str(tmp_path / "plain.so")))


# ---- size caps on what the cache reads --------------------------------------------------------------
def test_a_json_file_larger_than_the_cache_writes_is_not_read(tmp_path):
    """A 3 GiB sparse meta.json was read whole (6.3 GiB of memory): now it is a miss, unread."""
    cache = KernelCache(tmp_path / "cache")
    cache.make_private_dirs("x")
    with open(tmp_path / "cache" / "x" / "meta.json", "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk used
    (tmp_path / "cache" / "x" / "kernel.so").write_bytes(b"\0" * (5 << 20))  # a library may be this large
    for p in (tmp_path / "cache" / "x").iterdir():
        os.chmod(p, 0o600)
    files = cache.read_files(("x",), ("meta.json", "kernel.so"))
    assert files["meta.json"] is None and len(files["kernel.so"]) == 5 << 20


# ---- ScratchPool -------------------------------------------------------------------------------------
POOL_CALLS = {
    "reserve: an unknown device": lambda p: p.reserve(max_tokens=4, padded_heads=8, head_dim=512, device="bogus"),
    "reserve: a CUDA index without CUDA": lambda p: p.reserve(max_tokens=4, padded_heads=8, head_dim=512, device=3),
    "reserve: a meta device": lambda p: p.reserve(max_tokens=4, padded_heads=8, head_dim=512, device="meta"),
    "reserve: a dtype spelled as text": lambda p: p.reserve(max_tokens=4, padded_heads=8, head_dim=512, device="cpu",
                                                           dtype="bf16"),
    "reserve: more than memory": lambda p: p.reserve(max_tokens=2**40, padded_heads=8, head_dim=512, device="cpu"),
    "capacity: a float head count": lambda p: p.capacity(padded_heads=8.5, head_dim=512, device="cpu"),
    "view: a text micro-batch": lambda p: p.view(1, padded_heads=8, head_dim=512, device="cpu", micro_batch="0"),
    "claim_micro_batches: a text count": lambda p: p.claim_micro_batches(4, "2", padded_heads=8, head_dim=512,
                                                                         device="cpu"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(POOL_CALLS))
def test_scratch_pool_arguments_are_typed_errors_and_change_nothing(case):
    pool = ScratchPool()
    pool.reserve(max_tokens=2, padded_heads=8, head_dim=512, device="cpu", micro_batches=1)
    before = dict(pool._buffers)
    with pytest.raises(ScratchError):
        POOL_CALLS[case](pool)
    assert pool._buffers == before


def test_default_device_without_cuda_is_a_scratch_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    for call in (
        lambda p: p.view(1, padded_heads=8, head_dim=512),
        lambda p: p.capacity(padded_heads=8, head_dim=512),
    ):
        with pytest.raises(ScratchError, match='device="cpu"'):
            call(ScratchPool())


# ---- q_out requiring grad ------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["torch op", "function", "stub python", "stub native"])
def test_a_q_out_that_requires_grad_is_refused_before_anything_is_written(entry):
    a = valid("cpu")
    if entry.startswith("stub"):
        rt = StubRuntime(native=entry.endswith("native"))
        call = lambda x: ops.qnorm_rope_kv_insert(*(x[k] for k in QKV), runtime=rt)  # noqa: E731
        call(valid("cpu"))  # the shape is cached: the hot path meets it
    elif entry == "torch op":
        call = lambda x: torch.ops.attn_prologue.qnorm_rope_kv_insert(*(x[k] for k in QKV))  # noqa: E731
    else:
        call = lambda x: ops.qnorm_rope_kv_insert(*(x[k] for k in QKV))  # noqa: E731
    a["q_out"] = a["q_out"].float().requires_grad_().bfloat16()  # (not a leaf: what a model's output is)
    before = snapshot(a)
    with pytest.raises(InputError, match="q_out requires grad"):
        call(a)
    assert unchanged(before, a) == []


# ---- the torch ops' scalar types -----------------------------------------------------------------------
@pytest.mark.parametrize("op", ["qkv", "kv"])
@pytest.mark.parametrize("what", ["block_size=True", "eps=True", "block_size=16.0"])
def test_the_torch_ops_refuse_a_bool_or_float_where_the_schema_would_convert_it(op, what):
    name, value = what.split("=")
    value = {"True": True, "16.0": 16.0}[value]
    a = valid("cpu") if op == "qkv" else valid_kv("cpu")
    before = snapshot(a)
    if op == "qkv":
        args = [a[k] for k in QKV]
        args[QKV.index(name)] = value
        call = lambda: torch.ops.attn_prologue.qnorm_rope_kv_insert(*args)  # noqa: E731
    else:
        kwargs = {k: a[k] for k in KV_ARGS}
        kwargs[name] = value
        call = lambda: torch.ops.attn_prologue.kv_rope_insert(**kwargs)  # noqa: E731
    with pytest.raises(InputError, match=name):
        call()
    assert unchanged(before, a) == []


# ---- misses the cache cannot build ------------------------------------------------------------------------
def test_a_shared_miss_and_a_kernel_not_built_are_typed(tmp_path):
    KernelCache(tmp_path / "team").make_private_dirs()
    with pytest.raises(KernelNotBuiltError, match="read-only"):
        KernelCache(tmp_path / "team", trust="shared", prebuilt=[]).ensure_built(KEY)
    with pytest.raises(KernelNotBuiltError, match="is not built"):
        KernelCache(tmp_path / "mine", prebuilt=[]).load(KEY, compile_if_missing=False)
    assert issubclass(KernelNotBuiltError, AttnPrologueError) and issubclass(
        KernelNotBuiltError, FileNotFoundError
    )


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_a_miss_on_a_read_only_or_full_cache_is_a_cache_write_error(tmp_path, monkeypatch, code):
    def refuse(*_, **__):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(kernel_cache.os, "mkdir", refuse)
    monkeypatch.setattr(kernel_cache.KernelCache, "make_private_dirs", refuse)
    with pytest.raises(CacheWriteError, match=f"{os.strerror(code)}.*name a writable cache"):
        KernelCache(tmp_path / "cache", prebuilt=[]).ensure_built(KEY)
