"""Programmatic dependent launch on the GPU: a kernel starts while the kernel before it in the stream
runs, reads its slot ids and positions, and waits for that kernel before it reads kv or q_in. Here the
kernel before it produces those rows: a bf16-cache writer whose pages, slot t at row t, are read back
as the next call's [N, D] rows. The rows are poisoned before the first kernel runs, so a row load
issued before the second kernel's wait would read the poison. Both calls replay in one CUDA graph (the
programmatic edges are kept there), compared byte for byte with the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attn_prologue import ops

from .cases import Case, compare, describe_mismatch, make_inputs, run_reference

pytestmark = pytest.mark.gpu

N, BLOCK = 4096, 64  # the first kernel: a grid of 1024 CTAs (each triggers its dependents as its last step)


def chained_rows():
    """The producer's inputs, with slot t = t, and the [N, D] bf16 rows its pages hold once it ran."""
    x = make_inputs(Case(n=N, op="kv", cache_format="bf16", block_size=BLOCK, seed=70))
    x = dataclasses.replace(x, slot_mapping=torch.arange(N, device="cuda"))
    rows = x.extra["k_storage"].view(torch.bfloat16).view(-1, 512)[:N]
    want = run_reference(x).extra["k_storage"].view(torch.bfloat16).view(-1, 512)[:N].clone()
    return x, rows, want


def produce(x):
    ops.kv_rope_insert(x.kv, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, BLOCK, "bf16")


def replay(calls):
    """Run `calls` eagerly once (kernels load), then capture them in a graph and replay it."""
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_v41"])
def test_a_kv_writer_reads_rows_its_previous_kernel_wrote(fmt):
    src, rows, produced = chained_rows()
    x = make_inputs(Case(n=N, op="kv", cache_format=fmt, block_size=64, negative_every=7, seed=71))
    want = run_reference(dataclasses.replace(x, kv=produced))
    storage = x.extra["k_storage"]
    initial = storage.clone()

    def calls():
        rows.view(torch.int16).fill_(-1)  # bf16 NaN rows until the producer writes them
        storage.copy_(initial)
        produce(src)
        ops.kv_rope_insert(rows, x.k_cache, x.slot_mapping, x.positions, x.cos_sin_cache, 64, fmt)

    replay(calls)
    assert torch.equal(rows, produced)
    diff = compare(x, want)
    assert diff == {"cache_bytes_diff": 0}, f"{diff} {describe_mismatch(x, want)}"


def test_the_qkv_op_reads_q_rows_its_previous_kernel_wrote():
    src, rows, produced = chained_rows()
    x = make_inputs(Case(n=N, h=1, p=1, cache_format="fp8_ds_mla", block_size=64, seed=72))
    q_rows = rows.view(N, 1, 512)
    want = run_reference(dataclasses.replace(x, q_in=produced.view(N, 1, 512).clone()))
    storage, q_out = x.extra["k_storage"], x.q_out
    initial = storage.clone()

    def calls():
        rows.view(torch.int16).fill_(-1)
        storage.copy_(initial)
        q_out.fill_(float("nan"))
        produce(src)
        ops.qnorm_rope_kv_insert(
            q_rows,
            x.kv,
            q_out,
            x.k_cache,
            x.slot_mapping,
            x.positions,
            x.cos_sin_cache,
            1e-6,
            64,
            "fp8_ds_mla",
        )

    replay(calls)
    assert torch.equal(rows, produced)
    diff = compare(x, want)
    assert diff == {"cache_bytes_diff": 0, "q_out_bytes_diff": 0}, f"{diff} {describe_mismatch(x, want)}"
