"""The reference's paging against a slow per-row Python loop: skipped rows, record placement, any
block size and page strides larger than the records."""

from __future__ import annotations

import math

import pytest
import torch
from attn_prologue import codecs
from attn_prologue import reference as ref
from attn_prologue.formats import get_format
from hypothesis import given, settings
from hypothesis import strategies as st

from .support.reference_oracles import (
    ALL_FORMATS,
    FMT_DR,
    SETTINGS,
    make_cache,
    make_cos_sin,
    oracle_cache,
)

# =============================================================================================
# paging: skipped rows and record placement, against a per-row Python loop
# =============================================================================================


@st.composite
def paging_case(draw):
    name = draw(st.sampled_from(ALL_FORMATS))
    bs = draw(st.integers(1, 16))
    nblocks = draw(st.integers(1, 5))
    pad = draw(st.integers(0, 48))
    strided = draw(st.booleans())
    n = draw(st.integers(0, 10))
    m = draw(st.integers(0, n))
    nslots = nblocks * bs
    pool = draw(st.permutations(list(range(nslots))))
    slots = []
    for t in range(m):
        if t < len(pool) and draw(st.booleans()):
            slots.append(pool[t])
        else:
            slots.append(-draw(st.integers(1, 2**40)))  # any negative slot means skip
    seed = draw(st.integers(0, 2**31 - 1))
    return name, bs, nblocks, pad, strided, n, slots, seed


@settings(max_examples=400, **SETTINGS)
@given(paging_case(), st.sampled_from(["kv_rope_insert", "qnorm_rope_kv_insert"]))
def test_paging_and_skipped_rows(case, op):
    name, bs, nblocks, pad, strided, n, slots, seed = case
    d, r = FMT_DR[name]
    g = torch.Generator().manual_seed(seed)
    base, cache = make_cache(name, d, bs, nblocks, pad, strided, g)
    before = base.clone()
    # kv as a slice of a wider projection: row stride > D
    kv = (torch.randn(n, d + 24, generator=g) * 3).to(torch.bfloat16)[:, :d]
    positions = torch.randint(0, 64, (n,), generator=g)
    cs = make_cos_sin(64, r)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    kv_scale = torch.tensor(0.125) if name == "fp8_tensor" else None
    if op == "kv_rope_insert":
        ref.kv_rope_insert(kv, cache, slot_t, positions, cs, bs, name, kv_scale=kv_scale)
    else:
        h = 2
        q_in = torch.randn(n, h, d, generator=g).to(torch.bfloat16)
        q_out = torch.full((n, h, d), math.nan, dtype=torch.bfloat16)
        ref.qnorm_rope_kv_insert(
            q_in, kv, q_out, cache, slot_t, positions, cs, 1e-6, bs, name, kv_scale=kv_scale
        )
    m = len(slots)
    vals = ref.kv_values(kv[:m], positions[:m], cs)
    data, scale = codecs.encode_tokens(get_format(name), vals, kv_scale)
    want = oracle_cache(before, name, d, bs, slots, data, scale)
    assert torch.equal(base, want)
    if any(s >= 0 for s in slots):
        assert not torch.equal(base, before)  # random records over random poison


# =============================================================================================
# any block size, page strides larger than the records: every format
# =============================================================================================
@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("bs", [32, 48, 64, 128, 256])
def test_block_sizes_and_padded_pages(name, bs):
    """Records of tokens at the first, last and a middle offset of blocks land where the per-row
    oracle puts them with a page stride rounded past the records (vLLM-style: the next multiple of
    576), and decode_cache gives back what encode_tokens encoded."""
    d, r = FMT_DR[name]
    fmt = get_format(name)
    used = bs * fmt.bytes_per_token(d)
    stride = (used // 576 + 1) * 576  # > used, a multiple of 16
    g = torch.Generator().manual_seed(bs)
    base = torch.randint(0, 256, (3, stride), generator=g, dtype=torch.uint8)
    cache = base[:, :used]
    assert cache.stride(0) == stride > used
    before = base.clone()
    slots = [0, 2 * bs - 1, 2 * bs + bs // 2 + 1, -1]
    kv = (torch.randn(len(slots), d, generator=g) * 3).to(torch.bfloat16)
    positions = torch.arange(len(slots))
    cs = make_cos_sin(8, r)
    kv_scale = torch.tensor(0.125) if name == "fp8_tensor" else None
    slot_t = torch.tensor(slots)
    ref.kv_rope_insert(kv, cache, slot_t, positions, cs, bs, name, kv_scale=kv_scale)
    vals = ref.kv_values(kv, positions, cs)
    data, scale = codecs.encode_tokens(fmt, vals, kv_scale)
    assert torch.equal(base, oracle_cache(before, name, d, bs, slots, data, scale))
    live = torch.tensor(slots[:3])
    got, _ = codecs.decode_cache(cache, fmt, d, bs, live, kv_scale)
    want, _ = codecs.decode_tokens(fmt, data[:3], scale[:3], d, kv_scale)
    assert torch.equal(got, want)
