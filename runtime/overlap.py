"""Overlap between what an op writes and anything else it is given, on byte ranges.

The kernels read their inputs while writing their outputs, so a written buffer that overlaps
another written buffer, itself (rows of q_out, pages of k_cache: validate.py checks those strides)
or any input gives bytes that depend on the schedule: every entry point refuses such a call before
anything is written (docs/op.md, "Overlap"). The full validation (validate.py) and the fake
implementations torch.compile traces with call check_qkv / check_kv; the fast paths (ops.py,
api.py, native/fastpath.h) run `disjoint` on ranges they compute from data pointers.

A tensor's range is the span from its first to its last byte. Real tensors are compared by
address; fake tensors (torch.compile's tracing, where there are no addresses) by their storage,
which views of one real storage share, and their byte offset in it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .errors import InputError


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes a real tensor's elements can touch (from its shape and strides)."""
    _, start, end = _extent(t)
    return start, end


def _extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(memory, first, last): which memory the tensor's bytes are in (0: the address space; for a
    fake tensor the identity of its storage) and its [first, last) bytes there."""
    if is_fake(t):
        memory, start = t.untyped_storage()._cdata, t.storage_offset() * t.element_size()
    else:
        memory, start = 0, t.data_ptr()
    if t.numel() == 0:
        return memory, start, start
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return memory, start, start + span * t.element_size()


def check_disjoint(written: dict, inputs: dict) -> None:
    """InputError if a buffer the op writes overlaps another written buffer or any input (None
    entries are absent arguments)."""
    extents = {n: _extent(t) for n, t in {**written, **inputs}.items() if isinstance(t, torch.Tensor)}
    names = [n for n in written if n in extents]
    for i, a in enumerate(names):
        for b in names[i + 1 :] + [n for n in inputs if n in extents]:
            (ma, a0, a1), (mb, b0, b1) = extents[a], extents[b]
            if ma == mb and a0 < b1 and b0 < a1:
                raise InputError(
                    f"{a} overlaps {b} in memory: the buffers the op writes must not overlap each other or its inputs"
                )


def disjoint(w0: int, w1: int, v0: int, v1: int, inputs: tuple[tuple[int, int], ...]) -> bool:
    """Whether the written byte ranges [w0, w1) and [v0, v1) intersect neither each other nor any
    (start, end) range of `inputs` (which may overlap each other: they are only read); (0, 0) stands
    for no second written buffer. The fast paths' per-call form of check_disjoint, on ints: they pass
    the ranges byte_range gives (ops.py says how), so the verdict is check_disjoint's; a call it
    refuses goes to the full validation, which names the arguments."""
    if w0 < v1 and v0 < w1:
        return False
    for a0, a1 in inputs:
        if a0 < w1 and w0 < a1 or a0 < v1 and v0 < a1:
            return False
    return True


def in_place(q_in: torch.Tensor, q_out: torch.Tensor) -> bool:
    """Whether q_out is q_in itself (the same first byte and strides, P == H): Q written in place."""
    return (
        _extent(q_in)[:2] == _extent(q_out)[:2]
        and q_in.stride() == q_out.stride()
        and q_in.shape[1:2] == q_out.shape[1:2]
    )


def check_qkv(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale) -> None:
    """qnorm_rope_kv_insert's overlap rules: q_out may share memory with q_in only by being it (in
    place); q_out and k_cache overlap nothing else."""
    same = in_place(q_in, q_out)
    if not same and q_in.numel() and q_out.numel() and _storage(q_in) == _storage(q_out):
        raise InputError("q_out may alias q_in only when it is the same tensor (in place, P == H)")
    inputs = {"kv": kv, "slot_mapping": slot_mapping, "positions": positions, "cos_sin_cache": cos_sin_cache,
              "kv_scale": kv_scale, "q_scale": q_scale}  # fmt: skip
    check_disjoint({"q_out": q_out, "k_cache": k_cache}, inputs if same else {"q_in": q_in, **inputs})


def check_kv(kv, norm_weight, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale) -> None:
    """kv_rope_insert's overlap rule: k_cache overlaps no input."""
    inputs = {"kv": kv, "slot_mapping": slot_mapping, "positions": positions, "cos_sin_cache": cos_sin_cache,
              "kv_scale": kv_scale, "norm_weight": norm_weight}  # fmt: skip
    check_disjoint({"k_cache": k_cache}, inputs)


def _storage(t: torch.Tensor):
    return t.untyped_storage()._cdata if is_fake(t) else t.untyped_storage().data_ptr()
