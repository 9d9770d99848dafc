"""The native fast path on CPU: the C module builds and loads here, its cache entry is keyed and
trusted like a kernel's, a plan passes the kernel exactly what the Python path passes (tensors in
order, the bucket's tail, the bucket by token count, an FP8 q_out as uint8), and the C++ torch-op
kernels build against this torch and take over the ops' CUDA key. The refusals of the C checks are
tested beside the Python ones in test_overlap_fast_path.py (its `native` cases)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attn_prologue import native, ops
from attn_prologue.jit.kernel_cache import UntrustedCacheError

from .support.bad_inputs import BS, valid
from .support.stub_kernels import StubRuntime, require_python_stand_in

pytestmark = pytest.mark.tvm_ffi  # CI runs this file under every pinned TVM-FFI (.ci/run)

QKV = (
    "q_in",
    "kv",
    "q_out",
    "k_cache",
    "slot_mapping",
    "positions",
    "cos_sin_cache",
    "eps",
    "block_size",
    "cache_format",
)


@pytest.fixture
def own_native_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels" / "native"  # inside the cache root it names, never beside it


@pytest.fixture(scope="module")
def torch_ops_cache(tmp_path_factory):
    """A kernel cache holding the C++ torch-op library, built once for this module's tests that load it
    (each build compiles torch's headers: 20-30 s on a 2-core machine)."""
    root = tmp_path_factory.mktemp("torch-ops") / "kernels"
    native.build("torch_ops", root)
    return root


def test_the_fast_path_module_builds_and_loads_here():
    fp = native.fastpath()
    assert fp is not None, "no C compiler or no DLPack exchange API: CI must have both"
    assert fp.buckets() == ops.MAX_BUCKET_LOG2 + 1


def test_entries_are_keyed_by_sources_and_host_and_checked_before_use(own_native_root):
    key, facts = native.entry_key("fastpath")
    assert facts["host"] and facts["python"] and facts["tvm_ffi"]
    path = native.build("fastpath")
    assert path.parent == own_native_root / "fastpath" / key
    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta["file"] == path.name and len(meta["sha256"]) == 64
    assert native.built_path("fastpath") == path
    path.write_bytes(path.read_bytes() + b"\0")  # changed bytes: not the entry meta.json describes
    assert native.built_path("fastpath") is None
    assert native.build("fastpath") == path and native.built_path("fastpath") == path  # rebuilt once
    os.chmod(path.parent, 0o777)
    with pytest.raises(UntrustedCacheError, match="writable by other users"):
        native.built_path("fastpath")


def test_every_source_a_part_includes_is_in_its_key():
    """A part's cache key hashes the sources PARTS names: a local header its files include but PARTS
    leaves out would let an edit reuse a stale build. And every C/C++ file here belongs to a part."""
    named = set()
    for part, (_, sources, _, _) in native.PARTS.items():
        included = {
            line.split('"')[1]
            for s in sources
            for line in (native.SOURCES / s).read_text().splitlines()
            if line.startswith('#include "')
        }
        assert included <= set(sources), (part, sorted(included - set(sources)))
        named |= set(sources)
    on_disk = {p.name for p in native.SOURCES.iterdir() if p.suffix in (".c", ".h", ".cpp")}
    assert on_disk == named and len(named) >= 5


class TailLauncher:
    """A launcher whose tail is what a real one passes after the tensors (a tensor, a float, ints)."""

    def __init__(self, kernel, bucket: int, errors: torch.Tensor):
        self.fn, self.bucket, self.errors = kernel.fn, bucket, errors

    def tail(self, leading, **values):
        return (self.errors, 1e-6, values["block_size"], self.bucket, 1)


class TailRuntime(StubRuntime):
    def __init__(self):
        super().__init__(native=True)
        self.errors = torch.zeros(2, dtype=torch.int32)

    def launchers(self, request, device=None, **_):
        return tuple(TailLauncher(self.kernel, b, self.errors) for b in range(ops.MAX_BUCKET_LOG2 + 1))


def _tensors(call):
    return [a for a in call if isinstance(a, tuple)]


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_a_plan_passes_the_tensors_tail_and_bucket_the_python_path_passes(n):
    rt = TailRuntime()
    a = valid("cpu")
    ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)  # Python path: validates, makes the plan
    shape = next(iter(rt.calls.values()))
    assert shape.native is not None
    a = valid("cpu")
    rows = {k: (t[:n] if k in ("q_in", "kv", "positions", "slot_mapping") else t) for k, t in a.items()}
    rows["q_out"] = a["q_out"]  # N' >= N
    assert shape.native.qkv(*(rows[k] for k in QKV[:7]), None, None)
    got = rt.kernel.args[-1]
    want_tensors = [rows[k] for k in QKV[:7]] + [rt.errors]
    assert [(p, s, st) for p, s, st, _ in _tensors(got)] == [
        (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in want_tensors
    ]
    assert got[8:] == [1e-6, BS, (n - 1).bit_length(), 1]  # the tail of bucket bit_length(n - 1)


def test_an_fp8_q_out_reaches_the_kernel_as_uint8():
    rt = StubRuntime(native=True)
    a = valid("cpu")
    a["q_out"] = torch.zeros(a["q_out"].shape, dtype=torch.float8_e4m3fn)
    q_scale = torch.tensor([0.5])
    args = [a[k] for k in QKV]
    ops.qnorm_rope_kv_insert(*args, q_scale=q_scale, runtime=rt)
    ops.qnorm_rope_kv_insert(*args, q_scale=q_scale, runtime=rt)  # the plan's call
    assert next(iter(rt.calls.values())).native is not None and rt.kernel.calls == 2
    assert [t[3] for t in _tensors(rt.kernel.args[-1])][2:4] == ["uint8", "uint8"]  # q_out, k_cache


def test_keys_tell_slot_widths_and_devices_apart():
    fp = native.fastpath()
    a = valid("cpu")
    tail = ("fp8_ds_mla", None, None, True, True, None, True, True, "head_major", None, None)
    key = fp.qkv_key(*(a[k] for k in QKV[:9]), *tail)
    slots32 = a["slot_mapping"].to(torch.int32)
    args32 = [slots32 if k == "slot_mapping" else a[k] for k in QKV[:9]]
    assert key != fp.qkv_key(*args32, *tail)
    assert key == fp.qkv_key(*(a[k] for k in QKV[:9]), *tail)
    assert fp.qkv_key(None, *(a[k] for k in QKV[1:9]), *tail) is None  # not a tensor: no key


def test_turned_off_the_python_path_serves():
    code = (
        "import attn_prologue as ap; from attn_prologue import native, torch_op; "
        "print(native.fastpath() is None, torch_op.cuda_kernels())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, native.ENV_NATIVE: "0"}, check=True)  # fmt: skip
    assert out.stdout.split() == ["True", "Python"]


READER_CHECK = """
import json, torch, attn_prologue as ap
from attn_prologue import native, torch_op
torch_op.load_native_kernels(build=True)  # (None when the import already loaded a built library)
has = torch._C._dispatch_has_kernel_for_dispatch_key
fp = native.fastpath()
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 8, 16, generator=g).bfloat16()
plain = [x, x[1:, 2:], x.transpose(0, 1), x[..., :8], torch.zeros(4, 100, dtype=torch.uint8)[1:],
         torch.tensor([3, 5]), torch.tensor([3, 5], dtype=torch.int32), torch.rand(7, 64, generator=g),
         torch.zeros(0, 4).half(), torch.zeros(3, 8).to(torch.float8_e4m3fn), torch.nn.Parameter(torch.rand(8))]
odd = [torch._neg_view(torch.rand(8)), torch.rand(8).as_subclass(type("Sub", (torch.Tensor,), {}))]
from attn_prologue import ops
from attn_prologue.errors import InputError
from tests.support.bad_inputs import valid
from tests.support.stub_kernels import StubRuntime
rt, a = StubRuntime(native=True), valid("cpu")
names = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size")
ops.qnorm_rope_kv_insert(*(a[k] for k in names), runtime=rt)  # the shape's plan, made
a["kv"] = torch._neg_view(-a["kv"])
try:
    ops.qnorm_rope_kv_insert(*(a[k] for k in names), runtime=rt)
    neg_after_plan = "nothing raised"
except InputError as exc:
    neg_after_plan = "resolve_neg" in str(exc)
print(json.dumps({
    "neg_after_plan": [neg_after_plan, rt.kernel.calls],
    "built": native.built_path("torch_ops") is not None, "kernels": torch_op.cuda_kernels(),
    "cuda_key": [has(f"attn_prologue::{op}", "CUDA") for op in ("qnorm_rope_kv_insert", "kv_rope_insert")],
    "same": [fp.dltensor(t, "unpacker") == fp.dltensor(t, "exchange") for t in plain],
    "read_by_reader": [fp.dltensor(t, "unpacker") is not None for t in plain + odd],
    "read_by_exchange": [fp.dltensor(t, "exchange") is not None for t in odd],
    "read_by_plans": [fp.dltensor(t, "plan") is not None for t in odd],
    "data_is_the_tensors": all(fp.dltensor(t, "unpacker")[0] == t.data_ptr() for t in plain if t.numel()),
}))
"""


def test_the_torch_op_kernels_build_against_this_torch_take_the_cuda_key_and_read_tensors_in_place(
    torch_ops_cache,
):
    """Built and loaded in a child process (loading takes over the ops' CUDA key for the process).
    The library's tensor reader, handed to the fast-path module, sees every plain tensor as torch's
    DLPack exchange API does (data, device, dtype, shape, strides, offset). A subclass is left to the
    exchange API (as without the library); a lazily negated view, which the exchange API alone reads as
    its stored bits (the module then asks torch.Tensor.is_neg), is refused outright: a plan's call never
    reads it, so the call takes the Python path, whose validation names it."""
    require_python_stand_in()  # the child process calls a Python stand-in kernel
    env = {**os.environ, "ATTN_PROLOGUE_CACHE": str(torch_ops_cache)}
    out = subprocess.run([sys.executable, "-c", READER_CHECK], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parent.parent, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    n = len(got["same"])
    assert got["built"] and got["kernels"] == "C++" and got["cuda_key"] == [True, True]
    assert got["same"] == [True] * n and got["data_is_the_tensors"]
    assert got["read_by_reader"] == [True] * n + [False, False]
    assert got["read_by_exchange"] == [False, True]  # the module asks torch of the negation bit (issue 51)
    assert got["read_by_plans"] == [False, True]
    assert got["neg_after_plan"] == [True, 1]  # a shape's later call with a neg view: refused, not launched


BOXED_CHECK = """
import json, torch
from attn_prologue import ops, torch_op
from attn_prologue.errors import InputError
from tests.support.bad_inputs import valid, valid_kv
from tests.support.stub_kernels import StubRuntime
torch_op.load_native_kernels(build=True)
assert torch_op.cuda_kernels() == "C++"
rt = StubRuntime(native=True)
slow = []
# the dispatcher hands a Python kernel the arguments up to the last one that is not its default
def qkv_slow(q_in, kv, q_out, k_cache, slots, pos, cs, eps, bs, fmt="fp8_ds_mla", kv_scale=None, q_scale=None,
             num="", norm=True, rope=True, layout="head_major"):
    slow.append("qkv")
    return torch_op._plan_address(ops.qnorm_rope_kv_insert(
        q_in, kv, q_out, k_cache, slots, pos, cs, eps, bs, fmt, kv_scale=kv_scale, q_scale=q_scale,
        numerics=num or None, apply_q_norm=norm, apply_q_rope=rope, q_layout=layout, runtime=rt))
def kv_slow(kv, k_cache, slots, pos, cs, bs, fmt="fp8_ds_mla", norm_weight=None, eps=1e-6, kv_scale=None, num="",
            ratio=1):
    slow.append("kv")
    return torch_op._plan_address(ops.kv_rope_insert(
        kv, k_cache, slots, pos, cs, bs, fmt, norm_weight=norm_weight, eps=eps, kv_scale=kv_scale,
        numerics=num or None, compress_ratio=ratio, runtime=rt))
lib = torch.library.Library("attn_prologue", "IMPL")
lib.impl("qnorm_rope_kv_insert_slow", qkv_slow, "CPU")
lib.impl("kv_rope_insert_slow", kv_slow, "CPU")
cuda = torch._C.DispatchKeySet("CUDA")  # the C++ kernel itself, on CPU tensors
def tensors(call):
    return [x for x in call if isinstance(x, tuple)]
def run(op, args, bad):
    first = len(rt.kernel.args)
    rets = [op.redispatch(cuda, *args) for _ in range(3)]
    calls = rt.kernel.calls
    try:
        op.redispatch(cuda, *bad)
        refused = "nothing raised"
    except InputError as exc:
        refused = type(exc).__name__
    got = rt.kernel.args[first:]
    return dict(slow=list(slow), returns=[r is None for r in rets], kernel_calls=calls - first,
                same_args=[tensors(c) == tensors(got[0]) for c in got], refused=refused,
                launched_after_refusal=rt.kernel.calls - calls)
a = valid("cpu")
names = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "eps", "block_size",
         "cache_format")
qkv = [a[k] for k in names]
bad = list(qkv)
bad[3] = a["q_out"].view(torch.uint8).view(-1)[: a["k_cache"].numel()].view(a["k_cache"].shape)  # k_cache in q_out
out = {"qkv": run(torch.ops.attn_prologue.qnorm_rope_kv_insert.default, qkv, bad)}
slow.clear()
k = valid_kv("cpu")
kv = [k[n] for n in ("kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "block_size", "cache_format",
                     "norm_weight", "eps")]
bad = list(kv)
bad[0] = k["k_cache"].view(-1)[: k["kv"].numel() * 2].view(torch.bfloat16).view(k["kv"].shape)  # kv in k_cache
out["kv"] = run(torch.ops.attn_prologue.kv_rope_insert.default, kv, bad)
print(json.dumps(out))
"""


def test_the_torch_op_kernels_take_their_arguments_off_the_dispatchers_stack(torch_ops_cache):
    """The C++ kernels are boxed: they read the 16 (12) arguments off the stack torch.ops built. Called
    directly at the CUDA key on CPU tensors (a stub TVM-FFI kernel behind the plans): the first call
    takes the slow path on the same stack and returns None, later calls run the plan it handed back,
    passing the kernel exactly the tensors the Python path passed, and a call the plan refuses (k_cache
    inside q_out, kv inside k_cache) goes to the slow path, whose validation raises, launching nothing."""
    require_python_stand_in()  # the child process calls a Python stand-in kernel
    env = {**os.environ, "ATTN_PROLOGUE_CACHE": str(torch_ops_cache)}
    out = subprocess.run([sys.executable, "-c", BOXED_CHECK], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parent.parent, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    for op in ("qkv", "kv"):
        r = got[op]
        assert r["returns"] == [True] * 3 and r["kernel_calls"] == 3, r
        assert r["slow"] == [op, op], r  # the first call, then the refused one
        assert r["same_args"] == [True] * 3, r
        assert r["refused"] == "InputError" and r["launched_after_refusal"] == 0, r


def test_remembered_keys_never_cross_runtimes_or_shapes():
    """The C lookup remembers recent keys by identity: each runtime still reaches its own kernel,
    and a call whose key differs (int32 ids, or an equal eps given as another float object) finds
    its own shape or, by value, the same one."""
    rts = [StubRuntime(native=True), StubRuntime(native=True)]
    a = valid("cpu")
    a32 = dict(a, slot_mapping=a["slot_mapping"].to(torch.int32))
    for rt in rts:
        ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    for _ in range(3):
        for i, rt in enumerate(rts):
            counts = [r.kernel.calls for r in rts]
            ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
            assert [r.kernel.calls for r in rts] == [c + (j == i) for j, c in enumerate(counts)]
    rt = rts[0]
    ops.qnorm_rope_kv_insert(*(a32[k] for k in QKV), runtime=rt)
    assert len(rt.calls) == 2 and _tensors(rt.kernel.args[-1])[4][3] == "int32"
    ops.qnorm_rope_kv_insert(*(a[k] for k in QKV), runtime=rt)
    assert _tensors(rt.kernel.args[-1])[4][3] == "int64"
    eps = float(str(a["eps"]))  # equal value, another object
    assert eps == a["eps"] and eps is not a["eps"]
    ops.qnorm_rope_kv_insert(*(dict(a, eps=eps)[k] for k in QKV), runtime=rt)
    assert len(rt.calls) == 2 and _tensors(rt.kernel.args[-1])[4][3] == "int64"


def test_a_shared_cache_is_never_written(own_native_root, monkeypatch):
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE_TRUST", "shared")
    with pytest.raises(native.NativeBuildError, match="read-only"):
        native.build("fastpath")
    assert not own_native_root.exists()


def test_an_untrusted_native_entry_is_refused_with_a_warning_and_the_package_still_imports(
    own_native_root, torch_ops_cache
):
    shutil.copytree(torch_ops_cache / "native", own_native_root)  # (an intact entry, modes kept)
    assert native.built_path("torch_ops") is not None
    os.chmod(own_native_root / "torch_ops", 0o777)
    code = "import attn_prologue as ap; from attn_prologue import torch_op; print(torch_op.cuda_kernels())"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Python"]
    assert "were not loaded" in out.stderr and "writable by other users" in out.stderr


def test_a_native_library_that_does_not_load_leaves_the_python_kernels_serving(own_native_root):
    """An intact entry (its hash matches) whose library does not load here: importing the package
    warns, and the torch ops keep their Python CUDA kernels (unregistered only once a library loads)."""
    key, facts = native.entry_key("torch_ops")
    name = native.PARTS["torch_ops"][0]
    entry = own_native_root / "torch_ops" / key
    entry.mkdir(parents=True, mode=0o700)
    junk = b"\x7fELF but not a library of this machine"
    (entry / name).write_bytes(junk)
    meta = {**facts, "file": name, "sha256": hashlib.sha256(junk).hexdigest()}
    (entry / "meta.json").write_text(json.dumps(meta))
    assert native.built_path("torch_ops") == entry / name
    code = (
        "import torch, attn_prologue as ap; from attn_prologue import torch_op; "
        "has = torch._C._dispatch_has_kernel_for_dispatch_key; "
        "print(torch_op.cuda_kernels(), has('attn_prologue::qnorm_rope_kv_insert', 'CUDA'), "
        "has('attn_prologue::kv_rope_insert', 'CUDA'))"
    )
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Python", "True", "True"]
    assert "were not loaded" in out.stderr
