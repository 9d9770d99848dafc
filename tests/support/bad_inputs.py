"""The bad-input matrix: each case breaks one thing in an otherwise valid call. Shared by the CPU test
(torch op -> reference path) and the GPU test (kernel path)."""

from __future__ import annotations

import torch
from attn_prologue.errors import AttnPrologueError, InputError, UnsupportedError

D, R, BS, N, H, P = 512, 64, 16, 12, 4, 8


def valid(device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(3)
    theta = torch.rand(100, R // 2, generator=g, device=device) * 6.28
    return dict(
        q_in=torch.randn(N, H, D, generator=g, device=device).bfloat16(),
        kv=torch.randn(N, D, generator=g, device=device).bfloat16(),
        q_out=torch.randn(N, P, D, generator=g, device=device).bfloat16(),
        k_cache=torch.randint(0, 256, (4, BS * 584), generator=g, device=device, dtype=torch.uint8),
        slot_mapping=torch.randperm(4 * BS, generator=g, device=device)[:N].contiguous(),
        positions=torch.randint(0, 100, (N,), generator=g, device=device),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
        eps=1e-6,
        block_size=BS,
        cache_format="fp8_ds_mla",
    )


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """Same shape, data pointer 2 bytes off a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    out = flat[1 : 1 + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def _strided_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows whose stride is not a multiple of 16 bytes (a [.., D+1] buffer sliced to D)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    out = wide[..., : t.shape[-1]]
    out.copy_(t)
    return out


def _alias_q(a: dict) -> None:
    """q_in is the first H heads of q_out's storage: in place is only allowed when P == H."""
    q_out = torch.cat((a["q_in"], a["q_in"]), 1).contiguous()
    a.update(q_out=q_out, q_in=q_out[:, :H])


def _q_out_inside_k_cache(a: dict) -> None:
    """One allocation: the cache's pages, and q_out starting 1 KB into them."""
    q_bytes = N * P * D * 2
    buf = torch.randint(
        0, 256, (1024 + max(q_bytes, 4 * BS * 584),), dtype=torch.uint8, device=a["kv"].device
    )
    a.update(
        k_cache=buf[: 4 * BS * 584].view(4, BS * 584),
        q_out=buf[1024 : 1024 + q_bytes].view(torch.bfloat16).view(N, P, D),
    )


def _kv_inside_q_out(a: dict) -> None:
    a.update(kv=a["q_out"][:, P - 1])  # head P-1 of every row: a [N, D] view the op writes (zeros)


def _positions_inside_k_cache(a: dict) -> None:
    a.update(positions=a["k_cache"].view(-1)[: N * 8].view(torch.int64))  # a view of the cache's first bytes


def _in_k_cache(a: dict, name: str, dtype, shape) -> None:
    """`name` becomes a view of the cache's first bytes (its values copied there)."""
    n = a[name].numel() * a[name].element_size()
    view = a["k_cache"].view(-1)[:n].view(dtype).view(shape)
    view.copy_(a[name])
    a[name] = view


def _q_in_overlapping_k_cache(a: dict) -> None:
    """One allocation: the cache's pages, and q_in starting 1 KB before their end."""
    k_bytes, q_bytes = 4 * BS * 584, N * H * D * 2
    buf = torch.zeros(k_bytes - 1024 + q_bytes, dtype=torch.uint8, device=a["kv"].device)
    buf[:k_bytes].copy_(a["k_cache"].view(-1))
    q_in = buf[k_bytes - 1024 :].view(torch.bfloat16).view(N, H, D)
    q_in.copy_(a["q_in"])
    a.update(k_cache=buf[:k_bytes].view(4, BS * 584), q_in=q_in)


def _cos_sin_inside_q_out(a: dict) -> None:
    cs = (
        a["q_out"]
        .view(-1)[: a["cos_sin_cache"].numel() * 2]
        .view(torch.float32)
        .view(a["cos_sin_cache"].shape)
    )
    cs.copy_(a["cos_sin_cache"])
    a.update(cos_sin_cache=cs)


def _k_cache_pages_overlapping(a: dict) -> None:
    """Page stride 16 bytes short of a block's records: each page's last records are the next's first."""
    a.update(k_cache=a["k_cache"].as_strided((4, BS * 584), (BS * 584 - 16, 1)))


# name -> (function editing the valid kwargs in place, expected error type)
CASES = {
    "q_in float32": (lambda a: a.update(q_in=a["q_in"].float()), InputError),
    "q_in int8": (lambda a: a.update(q_in=a["q_in"].to(torch.int8)), InputError),
    "q_in 2-D": (lambda a: a.update(q_in=a["q_in"][:, 0]), InputError),
    "q_in head dim 256": (lambda a: a.update(q_in=a["q_in"][..., :256].contiguous()), InputError),
    "q_in head-major (transposed)": (
        lambda a: a.update(q_in=a["q_in"].transpose(0, 1).contiguous().transpose(0, 1)),
        InputError,
    ),
    "q_in misaligned": (lambda a: a.update(q_in=_misaligned(a["q_in"])), InputError),
    "kv fp16 with bf16 q": (lambda a: a.update(kv=a["kv"].half()), InputError),
    "kv fewer rows than tokens": (lambda a: a.update(kv=a["kv"][:-1]), InputError),
    "kv row stride not 16-byte multiple": (lambda a: a.update(kv=_strided_rows(a["kv"])), InputError),
    "kv 3-D": (lambda a: a.update(kv=a["kv"].unsqueeze(1)), InputError),
    "q_out wrong dtype": (lambda a: a.update(q_out=a["q_out"].half()), InputError),
    "q_out P < H": (lambda a: a.update(q_out=a["q_out"][:, :2].contiguous()), InputError),
    "q_out fewer rows than tokens": (lambda a: a.update(q_out=a["q_out"][:-2]), InputError),
    "q_out wrong head dim": (lambda a: a.update(q_out=a["q_out"][..., :128].contiguous()), InputError),
    "q_out rows not contiguous": (
        lambda a: a.update(q_out=a["q_out"].transpose(0, 1).contiguous().transpose(0, 1)),
        InputError,
    ),
    "q_out aliases q_in with P > H": (lambda a: _alias_q(a), InputError),
    "k_cache int8": (lambda a: a.update(k_cache=a["k_cache"].view(torch.int8)), InputError),
    "k_cache 1-D": (lambda a: a.update(k_cache=a["k_cache"].view(-1)), InputError),
    "k_cache too small for block_size": (lambda a: a.update(block_size=BS * 2), InputError),
    "k_cache block stride not 16-byte multiple": (
        lambda a: a.update(
            k_cache=torch.zeros(4, BS * 584 + 8, dtype=torch.uint8, device=a["k_cache"].device)[:, : BS * 584]
        ),
        InputError,
    ),
    "k_cache misaligned": (lambda a: a.update(k_cache=_misaligned(a["k_cache"])), InputError),
    "block_size zero": (lambda a: a.update(block_size=0), InputError),
    "block_size negative": (lambda a: a.update(block_size=-16), InputError),
    "slot_mapping int16": (lambda a: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)), InputError),
    "slot_mapping longer than tokens": (
        lambda a: a.update(slot_mapping=torch.cat((a["slot_mapping"], a["slot_mapping"][:1]))),
        InputError,
    ),
    "slot_mapping 2-D": (lambda a: a.update(slot_mapping=a["slot_mapping"].view(N, 1)), InputError),
    "positions int32": (lambda a: a.update(positions=a["positions"].int()), InputError),
    "positions shorter than tokens": (lambda a: a.update(positions=a["positions"][:-1]), InputError),
    "positions float": (lambda a: a.update(positions=a["positions"].float()), InputError),
    "cos_sin_cache bf16": (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].bfloat16()), InputError),
    "cos_sin_cache rope dim 32": (
        lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, :32].contiguous()),
        (InputError, UnsupportedError),
    ),
    "cos_sin_cache not contiguous": (
        lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].t().contiguous().t()),
        InputError,
    ),
    "eps negative": (lambda a: a.update(eps=-1.0), InputError),
    "unknown cache format": (lambda a: a.update(cache_format="fp9"), (AttnPrologueError, KeyError)),
    "format for another head dim": (lambda a: a.update(cache_format="mxfp4"), (InputError, UnsupportedError)),
    "k_cache without blocks": (lambda a: a.update(k_cache=a["k_cache"][:0]), InputError),
    "cos_sin_cache without rows": (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:0]), InputError),
    "eps infinite": (lambda a: a.update(eps=float("inf")), InputError),
    "positions on meta": (lambda a: a.update(positions=a["positions"].to("meta")), InputError),
    "fp8_tensor without kv_scale": (
        lambda a: a.update(
            cache_format="fp8_tensor",
            k_cache=torch.zeros(4, BS * 512, dtype=torch.uint8, device=a["k_cache"].device),
        ),
        InputError,
    ),
}

# Overlap between what the op writes (q_out, k_cache) and anything else, itself included: refused on
# every path before anything is written, by the full validation and by the fast paths' per-call check
# (each edit keeps the shape, so a call after a valid one takes the fast path of that shape).
OVERLAPS = {
    "q_out inside k_cache": (_q_out_inside_k_cache, InputError),
    "kv inside q_out": (_kv_inside_q_out, InputError),
    "q_out rows overlapping": (
        lambda a: a.update(q_out=a["q_out"].as_strided((N, P, D), (D, D, 1))),
        InputError,
    ),
    "positions inside k_cache": (_positions_inside_k_cache, InputError),
    "slot_mapping inside q_out": (
        lambda a: a.update(slot_mapping=a["q_out"].view(-1)[: N * 4].view(torch.int64)),
        InputError,
    ),
    "q_in overlapping the end of k_cache": (_q_in_overlapping_k_cache, InputError),
    "cos_sin_cache inside q_out": (_cos_sin_inside_q_out, InputError),
    "k_cache pages overlapping": (_k_cache_pages_overlapping, InputError),
}


def valid_kv(device: str) -> dict:
    """A valid KV-only call (weighted RMSNorm first): kv_rope_insert's arguments by name."""
    a = valid(device)
    g = torch.Generator(device=device).manual_seed(5)
    norm_weight = torch.randn(D, generator=g, device=device).bfloat16()
    return {k: a[k] for k in KV_ARGS[:-1] if k in a} | dict(norm_weight=norm_weight, eps=1e-6)


KV_ARGS = (
    "kv",
    "k_cache",
    "slot_mapping",
    "positions",
    "cos_sin_cache",
    "block_size",
    "cache_format",
    "norm_weight",
)

# The KV-only ops write k_cache alone.
KV_OVERLAPS = {
    "kv inside k_cache": (lambda a: _in_k_cache(a, "kv", torch.bfloat16, (N, D)), InputError),
    "positions inside k_cache": (_positions_inside_k_cache, InputError),
    "slot_mapping inside k_cache": (lambda a: _in_k_cache(a, "slot_mapping", torch.int64, (N,)), InputError),
    "norm_weight inside k_cache": (lambda a: _in_k_cache(a, "norm_weight", torch.bfloat16, (D,)), InputError),
    "k_cache pages overlapping": (_k_cache_pages_overlapping, InputError),
}

CUDA_ONLY = {
    "tensors on two devices": (lambda a: a.update(positions=a["positions"].cpu()), InputError),
}


def snapshot(args: dict) -> dict:
    return {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def unchanged(before: dict, args: dict) -> list[str]:
    changed = []
    for k, v in before.items():
        now = args.get(k)
        if not isinstance(now, torch.Tensor) or now.shape != v.shape or now.dtype != v.dtype or now.is_meta:
            continue  # the case replaced this tensor (or it holds no data)
        if not torch.equal(now.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)):
            changed.append(k)
    return changed


def _in_scratch(a: dict, name: str, scratch: torch.Tensor) -> None:
    """`name` becomes a view of the bound op's scratch buffer (its values copied there)."""
    view = scratch[:N, :H] if name == "q_in" else scratch[:N, P - 1]
    view.copy_(a[name])
    a[name] = view


# A bound op (H live heads of P) writes its scratch buffer and k_cache: edit(args, scratch buffer).
BOUND_OVERLAPS = {
    "q_in inside the scratch": (lambda a, s: _in_scratch(a, "q_in", s), InputError),
    "kv inside the scratch": (lambda a, s: _in_scratch(a, "kv", s), InputError),
    "kv inside k_cache": (lambda a, s: _in_k_cache(a, "kv", torch.bfloat16, (N, D)), InputError),
    "positions inside k_cache": (lambda a, s: _positions_inside_k_cache(a), InputError),
    "slot_mapping inside k_cache": (
        lambda a, s: _in_k_cache(a, "slot_mapping", torch.int64, (N,)),
        InputError,
    ),
    "cos_sin_cache inside k_cache": (
        lambda a, s: _in_k_cache(a, "cos_sin_cache", torch.float32, a["cos_sin_cache"].shape),
        InputError,
    ),
    "q_in overlapping the end of k_cache": (lambda a, s: _q_in_overlapping_k_cache(a), InputError),
    "k_cache pages overlapping": (lambda a, s: _k_cache_pages_overlapping(a), InputError),
}

# A bound op without a pool (P == H) writes q_in in place, and k_cache.
IN_PLACE_OVERLAPS = {
    "kv inside q_in": (lambda a: a.update(kv=a["q_in"][:, 0]), InputError),
    "positions inside q_in": (
        lambda a: a.update(positions=a["q_in"].view(-1)[: N * 4].view(torch.int64)),
        InputError,
    ),
    "cos_sin_cache inside q_in": (
        lambda a: a.update(
            cos_sin_cache=a["q_in"].view(-1)[: a["cos_sin_cache"].numel() * 2].view(torch.float32).view(-1, R)
        ),
        InputError,
    ),
    "kv inside k_cache": (lambda a: _in_k_cache(a, "kv", torch.bfloat16, (N, D)), InputError),
}
