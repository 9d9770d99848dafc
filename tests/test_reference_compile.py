"""The reference under torch.compile(fullgraph=True) equals eager bit for bit (q_out bytes and
cache bytes). Every run starts from poisoned outputs (NaN q_out, random cache bytes) and each
compiled function is called on two independent sets of random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from attn_prologue import reference as ref
from attn_prologue.formats import get_format


def make_cos_sin(max_pos: int, r: int, base: float = 10000.0) -> torch.Tensor:
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=1).float()


def make_inputs(
    seed: int, fmt_name: str, d: int, r: int, n: int, m: int, h: int, p: int, bs: int, nblocks: int, pad: int
):
    g = torch.Generator().manual_seed(seed)
    q_in = (torch.randn(n, h, d, generator=g) * 3).to(torch.bfloat16)
    kv = (torch.randn(n, d + 32, generator=g) * 2).to(torch.bfloat16)[:, :d]  # row stride > D
    # non-finite kv values in quantized no-rope dims: NaN -> 0x7F, Inf saturates (explicit paths)
    kv[0, 3] = math.inf
    kv[1, 70 % (d - r)] = math.nan
    positions = torch.randint(0, 4096, (n,), generator=g)
    slots = torch.randperm(nblocks * bs, generator=g)[:m].clone()
    slots[1] = -1  # a skipped row
    fmt = get_format(fmt_name)
    used = bs * fmt.bytes_per_token(d)
    cache_base = torch.randint(0, 256, (nblocks, used + pad), generator=g, dtype=torch.uint8)
    # q_out poison: NaN where the op writes (rows < N), random FINITE bf16 in rows >= N. Under
    # torch.compile the functionalized graph copies the whole q_out back through float32, which
    # preserves every finite value but not NaN payloads (CPU: 0x7FC0 comes back as 0xFFFF), so
    # NaN poison in rows the op never writes cannot be compared bit for bit.
    q_out = torch.full((n + 2, p, d), math.nan, dtype=torch.bfloat16)
    tail = (torch.randn(2, p, d, generator=g) * 100).to(torch.bfloat16)
    q_out[n:] = tail
    return dict(
        q_in=q_in, kv=kv, positions=positions, slots=slots, cache_base=cache_base, q_out=q_out, used=used
    )


def _run_pair(fn, compiled, inp):
    """Run eager and compiled on separate copies of the same poisoned outputs."""
    outs = []
    for f in (fn, compiled):
        q_out = inp["q_out"].clone()
        base = inp["cache_base"].clone()
        cache = base[:, : inp["used"]]  # page padding: stride(0) > block bytes
        f(inp["q_in"], inp["kv"], q_out, cache, inp["slots"], inp["positions"])
        outs.append((q_out, base))
    (qe, ce), (qc, cc) = outs
    return qe, ce, qc, cc


CASES = [
    # (format, D, R, order)
    ("fp8_ds_mla", 512, 64, "eager"),
    ("fp8_token", 128, 64, "kernel"),
    ("mxfp4", 128, 64, "kernel"),
    # the bench's torch.compile baseline compiles order="eager" for every reported format
    ("fp8_token", 128, 64, "eager"),
    ("mxfp4", 128, 64, "eager"),
    ("mxfp8", 512, 64, "eager"),
]


@pytest.mark.slow  # inductor compiles C++ per case: 5-45 s each on 2 cores
@pytest.mark.parametrize("fmt_name,d,r,order", CASES)
def test_qnorm_rope_kv_insert_compiled_equals_eager(fmt_name, d, r, order):
    torch._dynamo.reset()
    cs = make_cos_sin(4096, r)
    bs, eps = 4, 1e-6

    def op(q_in, kv, q_out, k_cache, slots, positions):
        ref.qnorm_rope_kv_insert(
            q_in, kv, q_out, k_cache, slots, positions, cs, eps, bs, fmt_name, order=order
        )

    compiled = torch.compile(op, fullgraph=True)
    n, m, h, p = 6, 5, 3, 4  # DP padding (M < N), one pad head
    for seed in (1, 2):
        inp = make_inputs(seed, fmt_name, d, r, n, m, h, p, bs, nblocks=3, pad=24)
        qe, ce, qc, cc = _run_pair(op, compiled, inp)
        assert torch.equal(qe.view(torch.int16), qc.view(torch.int16))
        assert torch.equal(ce, cc)
        # the run did something: live heads finite, pad heads zero, rows >= N untouched,
        # the cache changed
        assert torch.isfinite(qe[:n, :h]).all() and (qe[:n, h:].view(torch.int16) == 0).all()
        assert torch.equal(qc[n:].view(torch.int16), inp["q_out"][n:].view(torch.int16))
        assert not torch.equal(ce, inp["cache_base"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_kv_rope_insert_with_norm_compiled_equals_eager():
    torch._dynamo.reset()
    d, r, bs = 128, 64, 4
    cs = make_cos_sin(4096, r)
    g = torch.Generator().manual_seed(9)
    weight = (1 + 0.25 * torch.randn(d, generator=g)).to(torch.bfloat16)

    def op(q_in, kv, q_out, k_cache, slots, positions):  # q_in / q_out unused (KV-only op)
        ref.kv_rope_insert(kv, k_cache, slots, positions, cs, bs, "fp8_token", norm_weight=weight, eps=1e-6)

    compiled = torch.compile(op, fullgraph=True)
    for seed in (3, 4):
        inp = make_inputs(seed, "fp8_token", d, r, 6, 6, 1, 1, bs, nblocks=3, pad=16)
        _, ce, _, cc = _run_pair(op, compiled, inp)
        assert torch.equal(ce, cc)
        assert not torch.equal(ce, inp["cache_base"])
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_through_survives_compile(dtype):
    """numerics.round_through must round under torch.compile too. Inductor fuses a plain
    x.to(dtype).to(float32) pair into a no-op (it skips intermediate downcasts), which made the
    compiled reference store unrounded KV values; the bit-level implementation keeps the rounding."""
    from attn_prologue import numerics as nx

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=g) * 2.0 ** torch.randint(-30, 20, (4096,), generator=g)
    x[:6] = torch.tensor([65519.0, 65520.0, 1e5, 3.0 * 2.0**-26, -(2.0**-25), 3.4e38])

    def f(t):
        return nx.round_through(t * 1.0009765625, dtype) * 3.0  # fused with neighbours

    want = (x * 1.0009765625).to(dtype).to(torch.float32) * 3.0  # eager cast pair
    got = torch.compile(f, fullgraph=True)(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    torch._dynamo.reset()
