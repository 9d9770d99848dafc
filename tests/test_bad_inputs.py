"""Bad input never corrupts state: every case raises a typed error before anything is written
(CPU: the torch op's reference implementation, which validates with the same checks as CUDA)."""

import attn_prologue as ap
import attn_prologue.torch_op  # noqa: F401  (registers torch.ops.attn_prologue)
import pytest
import torch

from .support.bad_inputs import CASES, OVERLAPS, snapshot, unchanged, valid


def call(args):
    torch.ops.attn_prologue.qnorm_rope_kv_insert(
        args["q_in"],
        args["kv"],
        args["q_out"],
        args["k_cache"],
        args["slot_mapping"],
        args["positions"],
        args["cos_sin_cache"],
        args["eps"],
        args["block_size"],
        args["cache_format"],
    )


def test_matrix_has_at_least_30_cases():
    assert len(CASES) >= 30


def test_valid_call_passes_and_writes():
    args = valid("cpu")
    before = snapshot(args)
    call(args)
    assert unchanged(before, args) == ["q_out", "k_cache"] or set(unchanged(before, args)) == {
        "q_out",
        "k_cache",
    }


@pytest.mark.parametrize("name", sorted({**CASES, **OVERLAPS}))
def test_bad_input_raises_typed_error_and_writes_nothing(name):
    edit, error = {**CASES, **OVERLAPS}[name]
    args = valid("cpu")
    edit(args)
    before = snapshot(args)
    with pytest.raises(error) as info:
        call(args)
    assert isinstance(info.value, (ap.AttnPrologueError, KeyError))
    assert len(str(info.value)) > 20, "the message must say what is wrong"
    assert unchanged(before, args) == [], f"{name}: tensors changed"
