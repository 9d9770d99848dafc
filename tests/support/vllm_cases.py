"""vLLM-shaped cases for attn_prologue.compat.vllm, shared by the CPU and GPU tests.

DeepSeek-V4 shapes: 64 query heads padded to 128, D = 512, rope 64. Each case has fresh random
inputs, a cache of random bytes (every byte the call must not write keeps its poison) and the
expected bytes from `attn_prologue.reference` run on clones with the same arguments, spelled out
here in our own argument order (so a mapping mistake in the adapter shows up as a mismatch)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from attn_prologue import reference
from attn_prologue.formats import get_format

H, P, D, R = 64, 128, 512, 64
EPS = 1e-6
MAX_POS = 4096


@dataclass(frozen=True)
class Case:
    n: int  # tokens (rows of q, kv, positions)
    m: int | None = None  # len(slot_mapping): None = n; fewer is DP padding
    block_size: int = 64
    mxfp8: bool = False  # the cache format: mxfp8 (528 B) or fp8_ds_mla (584 B)
    q_norm: bool = True
    q_rope: bool = True
    interleaved: bool = False
    slots32: bool = False  # int32 slot ids (else int64)
    negative_every: int = 0  # every k-th slot is -1 (skipped)
    page_pad: int = 48  # bytes past each page's records (never written)
    seed: int = 0

    @property
    def fmt(self) -> str:
        return "mxfp8" if self.mxfp8 else "fp8_ds_mla"

    @property
    def rows(self) -> int:
        return self.n if self.m is None else self.m

    def __str__(self) -> str:
        flags = [
            f"n{self.n}",
            f"m{self.rows}",
            f"bs{self.block_size}",
            self.fmt,
            "norm" if self.q_norm else "nonorm",
            "rope" if self.q_rope else "norope",
            "qi" if self.interleaved else "hm",
            "i32" if self.slots32 else "i64",
        ]
        return "-".join(flags + ([f"neg{self.negative_every}"] if self.negative_every else []))


# Each axis value appears with several others; the CPU reference is slow at H = 64, so this is a
# covering set rather than the full product.
ALLOCATING = [
    Case(1),
    Case(7, mxfp8=True, interleaved=True, slots32=True, negative_every=3, seed=1),
    Case(64, m=60, q_norm=False, interleaved=True, negative_every=5, seed=2),
    Case(64, block_size=16, mxfp8=True, q_rope=False, slots32=True, seed=3),
    Case(300, m=290, block_size=256, slots32=True, negative_every=7, seed=4),
    Case(300, mxfp8=True, q_norm=False, q_rope=False, interleaved=True, negative_every=4, seed=5),
    Case(7, m=5, block_size=16, q_rope=False, interleaved=True, slots32=True, negative_every=2, seed=6),
    Case(1, m=0, block_size=256, mxfp8=True, q_norm=False, seed=7),
    Case(64, mxfp8=True, seed=8),
    Case(7, block_size=256, q_norm=False, q_rope=False, slots32=True, seed=9),
]
CALLER_OWNED = [
    Case(1),
    Case(7, m=5, block_size=16, slots32=True, negative_every=2, seed=11),
    Case(64, mxfp8=True, negative_every=5, seed=12),
    Case(300, m=297, block_size=256, mxfp8=True, slots32=True, seed=13),
]
KV_ONLY = [
    Case(1),
    Case(7, m=5, block_size=16, mxfp8=True, slots32=True, negative_every=2, seed=21),
    Case(64, block_size=256, negative_every=3, seed=22),
    Case(300, m=280, mxfp8=True, slots32=True, negative_every=9, seed=23),
]


def make(case: Case, device="cpu", *, cache_format: str | None = None) -> dict:
    """The call's tensors (built on the CPU from the case's seed, then moved)."""
    g = torch.Generator().manual_seed(case.seed)
    fmt = get_format(cache_format or case.fmt)
    bs, m = case.block_size, case.rows
    num_blocks = max(2, -(-case.n // bs) + 2)
    slots = torch.randperm(num_blocks * bs, generator=g)[:m]
    if case.negative_every:
        slots[:: case.negative_every] = -1
    theta = torch.rand(MAX_POS, R // 2, generator=g) * 6.28
    x = dict(
        q=torch.randn(case.n, H, D, generator=g).bfloat16(),
        kv=torch.randn(case.n, D, generator=g).bfloat16(),
        k_cache=torch.randint(
            0, 256, (num_blocks, bs * fmt.bytes_per_token(D) + case.page_pad), generator=g, dtype=torch.uint8
        ),
        slot_mapping=slots.to(torch.int32 if case.slots32 else torch.int64).contiguous(),
        positions=torch.randint(0, MAX_POS, (case.n,), generator=g),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
    )
    return {k: v.to(device) for k, v in x.items()}


def poison_q_out(n: int, device="cpu", rows_past: int = 2) -> torch.Tensor:
    """A caller-owned q_out [n + rows_past, P, D] full of NaN: every byte the call must write changes."""
    return torch.full((n + rows_past, P, D), float("nan"), dtype=torch.bfloat16, device=device)


def expected_qkv(case: Case, x: dict, q_out: torch.Tensor, *, cache_format: str | None = None):
    """(q_out, k_cache) after the fused call, from the reference on clones."""
    q_out, k_cache = q_out.clone(), x["k_cache"].clone()
    reference.qnorm_rope_kv_insert(
        x["q"],
        x["kv"],
        q_out,
        k_cache,
        x["slot_mapping"],
        x["positions"],
        x["cos_sin_cache"],
        EPS,
        case.block_size,
        cache_format or case.fmt,
        apply_q_norm=case.q_norm,
        apply_q_rope=case.q_rope,
        q_layout="interleaved" if case.interleaved else "head_major",
    )
    return q_out, k_cache


def expected_kv(case: Case, x: dict, cache: torch.Tensor, cache_format: str, kv_scale=None) -> torch.Tensor:
    out = cache.clone()
    reference.kv_rope_insert(
        x["kv"],
        out,
        x["slot_mapping"],
        x["positions"],
        x["cos_sin_cache"],
        case.block_size,
        cache_format,
        kv_scale=kv_scale,
    )
    return out


def allocating_args(case: Case, x: dict, q_head_padded: int = P) -> tuple:
    """vLLM upstream's 13 arguments, in its order."""
    return (
        x["q"], x["kv"], x["k_cache"], x["slot_mapping"], x["positions"], x["cos_sin_cache"], q_head_padded,
        EPS, case.block_size, case.q_norm, case.mxfp8, case.q_rope, case.interleaved,
    )  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes to compare exactly (NaN-safe)."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


_names = itertools.count()


def namespace() -> str:
    """A fresh namespace per registration: torch.ops caches what it has looked up."""
    return f"compat_test_{next(_names)}"


@contextmanager
def registrations():
    """A factory of register(...) calls under fresh namespaces of our own (a locked CPU pool for the
    allocating form unless one is given); closes them all afterwards."""
    from attn_prologue.compat import vllm
    from attn_prologue.scratch import ScratchPool

    made = []

    def make_registration(form="allocating", *, max_tokens=300, micro_batches=1, lock=True, **kw):
        pool = kw.pop("pool", None)
        if pool is None and form == "allocating":
            pool = ScratchPool()
            pool.reserve(
                max_tokens=max_tokens, padded_heads=P, head_dim=D, micro_batches=micro_batches, device="cpu"
            )
            if lock:
                pool.lock()
        r = vllm.register(namespace(), form=form, pool=pool, new_namespace=True, **kw)
        made.append(r)
        return r

    try:
        yield make_registration
    finally:
        for r in made:
            r.close()


def pool_buffer(r, micro_batch=0) -> torch.Tensor:
    return r.pool.buffer(padded_heads=P, head_dim=D, micro_batch=micro_batch, device="cpu")


def poison_pool(r, micro_batch=0) -> torch.Tensor:
    """NaN over the whole buffer (pads included: "written" mode must zero them); returns it."""
    buf = pool_buffer(r, micro_batch)
    buf.fill_(float("nan"))
    return buf


def caller_owned_args(form: str, case: Case, x: dict, q_out: torch.Tensor) -> tuple:
    common = (x["slot_mapping"], x["positions"], x["cos_sin_cache"], EPS, case.block_size)
    if form == "q_out_second":
        return (x["q"], q_out, x["kv"], x["k_cache"], *common)
    return (x["q"], x["kv"], q_out, x["k_cache"], *common)
