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
    "fp8_tensor without kv_scale": (
        lambda a: a.update(
            cache_format="fp8_tensor",
            k_cache=torch.zeros(4, BS * 512, dtype=torch.uint8, device=a["k_cache"].device),
        ),
        InputError,
    ),
}

# Overlap between what the op writes and anything else is refused where arguments are validated (the
# first call of a shape on CUDA, every call of the CPU path); the CUDA hot paths do not re-check it per
# call yet, so these run on the validating path only.
OVERLAPS = {
    "q_out inside k_cache": (_q_out_inside_k_cache, InputError),
    "kv inside q_out": (_kv_inside_q_out, InputError),
    "q_out rows overlapping": (
        lambda a: a.update(q_out=a["q_out"].as_strided((N, P, D), (D, D, 1))),
        InputError,
    ),
    "positions inside k_cache": (_positions_inside_k_cache, InputError),
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
        if not isinstance(now, torch.Tensor) or now.shape != v.shape or now.dtype != v.dtype:
            continue  # the case replaced this tensor
        if not torch.equal(now.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)):
            changed.append(k)
    return changed
