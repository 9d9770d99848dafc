"""The first-use self-test of an index_q module (selftest.py says when one runs): random rows and the
conversions' edge rows through the kernel, every output byte compared with the reference on the CPU.
Runs in the self-test arena's buffers: nothing is allocated on the GPU."""

from __future__ import annotations

import torch

from .index_q import host_scales, index_q_reference
from .launcher import Launcher

TOKENS, HEADS, MAX_POS = 16, 4, 64  # within the arena of selftest.py (ROWS x HEADS x 512 bf16 for q)


def run(launcher: Launcher, errors: torch.Tensor, arena, edge_rows) -> tuple[bool, str]:
    v = launcher.variant
    d, r = v.head_dim, v.rope_dim
    g = torch.Generator().manual_seed(20261207)
    dt = v.io_dtype.torch_dtype
    q = torch.randn(TOKENS, HEADS, d, generator=g)
    edges = edge_rows(d)
    q[: len(edges), 0] = edges  # head 0 of the first tokens: zeros, subnormals, floors, ties, Inf, NaN
    q[1] *= 1e-3
    theta = torch.rand(MAX_POS, r // 2, generator=g) * 6.28
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pos = torch.randint(0, MAX_POS, (TOKENS,), generator=g)
    w = torch.randn(TOKENS, HEADS, generator=g).to(dt)
    mx = v.cache_format == "mxfp4"
    code_bytes = d // 2 if mx else d
    # device views of the arena: q, codes and scales in its row buffers, the rest in its float32 area
    q_dev = arena.q_in[: q.numel() * 2].view(dt).view(q.shape)
    codes = arena.q_out[: TOKENS * HEADS * code_bytes].view(TOKENS, HEADS, code_bytes)
    scales = arena.k_cache[: TOKENS * HEADS * (d // 32)].view(TOKENS, HEADS, d // 32)
    small = arena.small
    cs_dev = small[: cs.numel()].view(cs.shape)
    w_out = small[cs.numel() : cs.numel() + TOKENS * HEADS].view(TOKENS, HEADS)
    w_dev = small[cs.numel() + TOKENS * HEADS :][: TOKENS * HEADS // 2].view(dt).view(TOKENS, HEADS)
    pos_dev = arena.ids[:TOKENS]
    for dst, src in ((q_dev, q.to(dt)), (cs_dev, cs), (w_dev, w), (pos_dev, pos)):
        dst.copy_(src)
    codes.fill_(0x55)
    scales.fill_(0x55)
    w_out.fill_(7.0)
    bits = max(launcher.config.folded_numerics, v.default_numerics)  # (the bits the module was compiled for)
    ws, hs = host_scales(0.125, 0.5, bits)
    values = dict(q_in=q_dev, weights=w_dev, q_out=codes, q_scales=scales, weights_out=w_out.view(torch.uint8),
                  positions=pos_dev, cos_sin_cache=cs_dev, errors=errors, weights_scale=ws, head_scale=hs,
                  weights_bf16=0, numerics=bits, checked=1)  # fmt: skip
    launcher(**{k: values[k] for k in launcher.arguments if k in values})
    want_codes, want_scales, want_w, _ = index_q_reference(
        q.to(dt), pos, cs, w, 0.125, 0.5, v.cache_format, bits
    )
    bad = int((codes.cpu() != want_codes).sum()) + int(
        (w_out.cpu().view(torch.int32) != want_w.view(torch.int32)).sum()
    )
    if mx:
        bad += int((scales.cpu() != want_scales).sum())
    if bad:
        return (
            False,
            f"{bad} output bytes or weights differ from the reference (q codes, scales, weights_out)",
        )
    return True, f"bit-exact against the reference ({TOKENS * HEADS} rows, {len(edges)} of them edge cases)"
