"""The torch op on CPU: the reference implementation behind the caller-owned schema, equal under
torch.compile(fullgraph=True), and its mutations survive functionalization without a cache copy."""

import attn_prologue as ap
import attn_prologue.torch_op  # noqa: F401
import pytest
import torch
from attn_prologue import reference
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code

N, H, P, D, BS = 6, 4, 8, 512, 16


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(100, 32, generator=g) * 6.28
    return dict(
        q_in=torch.randn(N, H, D, generator=g).bfloat16(),
        kv=torch.randn(N, D, generator=g).bfloat16(),
        q_out=torch.full((N + 2, P, D), float("nan")).bfloat16(),
        k_cache=torch.randint(0, 256, (4, BS * 584), generator=g, dtype=torch.uint8),
        slot_mapping=torch.tensor([3, -1, 17, 40, 5, 63]),
        positions=torch.randint(0, 100, (N,), generator=g),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
    )


def step(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache):
    ap.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, 1e-6, BS)


def test_schema_is_the_caller_owned_one():
    schema = str(torch.ops.attn_prologue.qnorm_rope_kv_insert.default._schema)
    assert schema.startswith(
        "attn_prologue::qnorm_rope_kv_insert(Tensor q_in, Tensor kv, Tensor(a2!) q_out, Tensor(a3!) k_cache, "
        "Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache, float eps, SymInt block_size"
    )
    assert schema.endswith("-> ()")


def test_autograd_passes_through_the_ops():
    """The ops are not differentiable (their outputs are caller-owned buffers written in place): every
    Autograd key is a fallthrough, so eager calls skip torch's boxed autograd fallback."""
    for op in ("qnorm_rope_kv_insert", "kv_rope_insert", "qnorm_rope_kv_insert_slow", "kv_rope_insert_slow"):
        table = torch._C._dispatch_dump_table(f"attn_prologue::{op}").splitlines()
        for key in ("AutogradCPU", "AutogradCUDA"):
            (row,) = [r for r in table if r.startswith(f"{key}:")]
            assert "fallthrough" in row and "torch_op.py" in row, row
    a, b = inputs(4), inputs(4)
    a["q_in"].requires_grad_()
    torch.ops.attn_prologue.qnorm_rope_kv_insert(*a.values(), 1e-6, BS)
    reference.qnorm_rope_kv_insert(*b.values(), 1e-6, BS)
    assert torch.equal(a["k_cache"], b["k_cache"])  # an input that requires grad changes nothing


def test_cpu_op_equals_reference():
    a, b = inputs(), inputs()
    torch.ops.attn_prologue.qnorm_rope_kv_insert(*a.values(), 1e-6, BS)
    reference.qnorm_rope_kv_insert(*b.values(), 1e-6, BS)
    assert torch.equal(a["k_cache"], b["k_cache"])
    assert torch.equal(a["q_out"].view(torch.int16), b["q_out"].view(torch.int16))
    assert not torch.equal(a["k_cache"], inputs()["k_cache"])  # it wrote something


def test_compiled_equals_eager():
    torch._dynamo.reset()
    a, b = inputs(1), inputs(1)
    step(**a)
    torch.compile(step, fullgraph=True)(**b)
    assert torch.equal(a["k_cache"], b["k_cache"])
    assert torch.equal(a["q_out"].view(torch.int16), b["q_out"].view(torch.int16))


def test_functionalized_graph_maps_both_mutations_back():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = inputs(2)
    torch.compile(step, backend=aot_autograd(fw_compiler=capture), fullgraph=True)(**x)
    code = graphs[0].code
    assert "auto_functionalized" in code and "attn_prologue.qnorm_rope_kv_insert" in code
    # the mutated bases are q_out (arg2) and k_cache (arg3), and the graph returns both new values
    assert "_q_out_base_index = 0, _k_cache_base_index = 1, _all_bases = [arg2_1, arg3_1]" in code
    assert code.count("getitem") >= 2 and "return (getitem_1, getitem_2)" in code


def test_inductor_reinplaces_without_copying_the_cache():
    torch._dynamo.reset()
    x = inputs(3)
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), *x.values())
    src = code[0]
    call = src[src.index("def call(self, args)") :]
    assert "torch.ops.attn_prologue.qnorm_rope_kv_insert.default(arg0_1, arg1_1, arg2_1, arg3_1" in call
    for copy in ("clone", "copy_", "empty_strided", "aten.copy"):
        assert copy not in call, f"compiled graph copies something ({copy})"


def test_kv_rope_insert_op_with_norm_weight():
    x = inputs(4)
    w = (torch.rand(D) + 0.5).bfloat16()
    kc = x["k_cache"].clone()
    torch.ops.attn_prologue.kv_rope_insert(
        x["kv"],
        x["k_cache"],
        x["slot_mapping"],
        x["positions"],
        x["cos_sin_cache"],
        BS,
        "fp8_ds_mla",
        w,
        1e-6,
        None,
    )
    reference.kv_rope_insert(
        x["kv"], kc, x["slot_mapping"], x["positions"], x["cos_sin_cache"], BS, norm_weight=w
    )
    assert torch.equal(kc, x["k_cache"])


def test_fake_impl_traces_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = {k: torch.empty_like(v) for k, v in inputs().items()}
        torch.ops.attn_prologue.qnorm_rope_kv_insert(*x.values(), 1e-6, BS)


@pytest.mark.parametrize("bad", ["positions", "q_out"])
def test_op_validates_before_writing(bad):
    x = inputs(5)
    if bad == "positions":
        x["positions"] = x["positions"].int()
    else:
        x["q_out"] = x["q_out"][:, :2]
    before = x["k_cache"].clone()
    with pytest.raises(ap.InputError):
        torch.ops.attn_prologue.qnorm_rope_kv_insert(*x.values(), 1e-6, BS)
    assert torch.equal(before, x["k_cache"])


@pytest.mark.parametrize("form", ["torch op", "package function"])
def test_out_of_range_ids_are_skipped_on_cpu_and_nothing_else_changes(form):
    """The CPU implementation skips what the kernels skip: a KV row whose slot is past the cache or
    whose position is outside the table, and zeroes the Q token of an out-of-range position; it
    never raises part-way (the old reference raised IndexError after writing q_out)."""
    a = inputs(3)
    capacity = a["k_cache"].shape[0] * BS
    a["slot_mapping"] = torch.tensor([3, capacity, 17, 2**36, 5, 63])
    a["positions"][4] = a["cos_sin_cache"].shape[0]  # one past the table (row 4's slot is in range)
    a["positions"][2] = -1
    before = {k: v.clone() for k, v in a.items()}
    call = torch.ops.attn_prologue.qnorm_rope_kv_insert if form == "torch op" else ap.qnorm_rope_kv_insert
    call(*a.values(), 1e-6, BS)
    # expected: the same call with those rows' slots set to "skip" and their positions in range
    b = {k: v.clone() for k, v in before.items()}
    b["slot_mapping"] = torch.tensor([3, -1, -1, -1, -1, 63])
    b["positions"][[2, 4]] = 0
    reference.qnorm_rope_kv_insert(*b.values(), 1e-6, BS)
    b["q_out"][[2, 4], :H] = 0
    assert torch.equal(a["k_cache"], b["k_cache"])
    assert torch.equal(a["q_out"].view(torch.int16), b["q_out"].view(torch.int16))
    assert not torch.equal(a["k_cache"], before["k_cache"])  # the in-range rows were written


# ---- overlap under torch.compile (issue 28, item 8) ----------------------------------------------------
# Compiled, the op may run on copies of the written buffers (aot_eager: functionalized, not re-inplaced)
# or not at all (inductor: AOT refuses inputs aliased across dtypes with an AssertionError): the fake
# implementation refuses overlap while dynamo traces, on the fake tensors' storages.
QKV_ORDER = (
    "q_in",
    "kv",
    "q_out",
    "k_cache",
    "slot_mapping",
    "positions",
    "cos_sin_cache",
    "eps",
    "block_size",
)
COMPILE_OVERLAPS = ["q_out aliases q_in with P > H", "kv inside q_out", "positions inside k_cache",
                    "cos_sin_cache inside q_out", "q_in overlapping the end of k_cache"]  # fmt: skip


def _step(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size):
    ap.qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size)


def _kv_step(kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, norm_weight):
    ap.kv_rope_insert(
        kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, norm_weight=norm_weight
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", COMPILE_OVERLAPS)
def test_overlap_is_refused_typed_under_torch_compile_writing_nothing(backend, case):
    from .support.bad_inputs import CASES, OVERLAPS, snapshot, unchanged, valid

    torch._dynamo.reset()
    a = valid("cpu")
    {**CASES, **OVERLAPS}[case][0](a)
    before = snapshot(a)
    with pytest.raises(ap.InputError, match="overlaps|alias"):
        torch.compile(_step, backend=backend, fullgraph=True)(*(a[k] for k in QKV_ORDER))
    assert unchanged(before, a) == []


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "case", ["kv inside k_cache", "positions inside k_cache", "norm_weight inside k_cache"]
)
def test_kv_overlap_is_refused_typed_under_torch_compile_writing_nothing(backend, case):
    from .support.bad_inputs import KV_OVERLAPS, snapshot, unchanged, valid_kv

    torch._dynamo.reset()
    a = valid_kv("cpu")
    KV_OVERLAPS[case][0](a)
    before = snapshot(a)
    names = ("kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache", "block_size", "norm_weight")
    with pytest.raises(ap.InputError, match="overlaps"):
        torch.compile(_kv_step, backend=backend, fullgraph=True)(*(a[k] for k in names))
    assert unchanged(before, a) == []


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_in_place_q_compiles_and_equals_eager(backend):
    """q_out may be q_in itself: the traced check accepts it, and the bytes are eager's."""
    torch._dynamo.reset()
    a, b = inputs(6), inputs(6)
    for x in (a, b):
        x["q_out"] = x["q_in"]  # P == H, the same tensor
    step(**a)
    torch.compile(step, backend=backend, fullgraph=True)(**b)
    assert torch.equal(a["k_cache"], b["k_cache"])
    assert torch.equal(a["q_in"].view(torch.int16), b["q_in"].view(torch.int16))
