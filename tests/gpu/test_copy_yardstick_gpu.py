"""The copy yardsticks copy: every byte of src lands in dst (for an interleaved kind, where the layout
puts it) and nothing past dst's end is written, for the bench's kinds and structured ones (row layout,
persistent grids, interleaved stores), at sizes that end mid-chunk and mid-token. A
copy that moved fewer bytes would look faster and flatter every ratio the bench reports."""

from __future__ import annotations

import pytest
import torch
from attn_prologue.lab import copy_kernel
from attn_prologue.variants import arch_for_capability

from ..support.interleaved import interleaved_copy

pytestmark = pytest.mark.gpu

KINDS = ["sm", "sm1", "t64_v4_row", "t64_v2_row_c8", "t32_v4_row_c32", "t256_v1_c8"]
KINDS += ["t64_v2_row_qi", "t64_v4_row_qi", "t64_v8_row_qi", "t128_v4_row_qi_c8"]  # interleaved stores
GUARD = 4096  # int32 words after dst, poisoned: a write past its end shows there


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vectors", [1, 37, 4096 * 3 + 29, 1 << 20])
def test_copy_kind_copies_every_byte_and_no_more(kind, vectors):
    target = arch_for_capability(*torch.cuda.get_device_capability())[1]
    fn = copy_kernel.compiled(target, kind)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(vectors)
    src = torch.randint(-(2**31), 2**31 - 1, (vectors * 4,), dtype=torch.int32, device="cuda", generator=g)
    buf = torch.full((vectors * 4 + GUARD,), -0x5A5A5A5B, dtype=torch.int32, device="cuda")  # 0xA5A5A5A5
    dst = buf[: vectors * 4]
    fn(src, dst, copy_kernel.CopyKind.from_key(kind).ctas_per_sm * sms)
    torch.cuda.synchronize()
    want = interleaved_copy(src, chunk=8) if copy_kernel.CopyKind.from_key(kind).qi else src
    assert torch.equal(dst, want)
    assert bool((buf[vectors * 4 :] == -0x5A5A5A5B).all())
