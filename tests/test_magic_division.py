"""A Q row's token, row // H, by a magic number (kernel_lib.division_magic, computed once a launch by
the host code; kernel_lib.magic_quotient in the kernel: mul.hi, add, shift), proven on the CPU.

The claim: for 1 <= d < 2^31 and 0 <= n < 2^31, with l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d)
+ 1, floor(n / d) = (floor(m n / 2^32) + n) >> l. It is Granlund and Montgomery's round-up method
(1994, Theorem 4.2; Hacker's Delight, section 10-9) with the multiplier's 2^32 split off: 2^(32 + l)
<= (m + 2^32) d <= 2^(32 + l) + 2^l, which makes the quotient exact for every n < 2^32; and n < 2^31
keeps floor(m n / 2^32) + n below 2^32. The tests run the same function the launch runs, on Python
ints: every divisor up to 2^16 and a spread of larger ones, at the dividends where a quotient
changes (k d - 1, k d) up to 2^31, the first and last 4096 dividends, and random ones; and, marked
`exhaustive` (minutes, not in the default run), every dividend below 2^31 for head counts serving
engines use that are not powers of two (for d = 2^l, m = 1 and the quotient is n >> l)."""

from __future__ import annotations

import random

import pytest
import torch
from attn_prologue.device import kernel_lib as kl

LIMIT = 1 << 31  # rows r < T x H < 2^31
EDGES = torch.cat((torch.arange(4096), torch.arange(LIMIT - 4096, LIMIT)))  # the first and last dividends


def magic(d: int) -> tuple[int, int]:
    return kl.division_magic(d, u32=int, u64=int, select=lambda c, a, b: a if c else b)


def quotients(n: torch.Tensor, m, shift) -> torch.Tensor:
    """magic_quotient's mul.hi.u32, add and shift, in int64 (m n < 2^63); m and shift ints, or
    tensors broadcasting against n."""
    return (((n * m) >> 32) + n) >> shift


def dividends(d: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per divisor of the column d: the dividends k d - 1, k d, k d + 1 for k = 1, 2, 3, the last two
    quotients below 2^31 and 32 random k; 32 random dividends; EDGES. Those outside [0, 2^31) are 0."""
    top = (LIMIT - 1) // d
    randoms = (torch.rand(len(d), 32, generator=g, dtype=torch.float64) * (LIMIT // d)).long() + 1
    ks = torch.cat((torch.tensor([1, 2, 3]).expand(len(d), 3), top, top - 1, randoms), 1)
    near = (ks[:, :, None] * d[:, :, None] + torch.tensor([-1, 0, 1])).flatten(1)
    n = torch.cat((near, torch.randint(0, LIMIT, (len(d), 32), generator=g), EDGES.expand(len(d), -1)), 1)
    return torch.where((n >= 0) & (n < LIMIT), n, 0)


def test_the_magic_numbers_fit_and_the_shift_is_the_ceiling_log():
    for d in [*range(1, 1 << 12), LIMIT - 1, (1 << 30) + 1, 1 << 30]:
        m, shift = magic(d)
        assert 0 < m < 1 << 32 and (1 << shift) >= d and (shift == 0 or (1 << (shift - 1)) < d), d
        bound = 1 << (32 + shift)
        assert bound <= (m + (1 << 32)) * d <= bound + (1 << shift), d  # the theorem's condition


def test_every_small_divisor_and_larger_ones_where_quotients_change():
    rng, g = random.Random(26), torch.Generator().manual_seed(26)
    divisors = [*range(1, 1 << 16), *(rng.randrange(1 << 16, LIMIT) for _ in range(2000))]
    divisors += [(1 << k) + e for k in range(16, 31) for e in (-1, 0, 1)] + [LIMIT - 1]
    for batch in torch.tensor(divisors).split(128):  # 128 divisors a time: about 1M dividends
        d = batch[:, None]
        n = dividends(d, g)
        m, shift = torch.tensor([magic(int(x)) for x in batch]).T[:, :, None]
        bad = (quotients(n, m, shift) != n // d).nonzero()
        assert bad.numel() == 0, f"d={batch[bad[0, 0]].item()}: n={n[bad[0, 0], bad[0, 1]].item()}"


@pytest.mark.exhaustive
@pytest.mark.parametrize("d", [1, 3, 5, 6, 7, 12, 24, 48, 96, 100])  # (a power of two: m = 1, n >> l)
def test_every_row_for_the_head_counts_engines_use(d):
    m, shift = magic(d)
    chunk = 1 << 25
    for start in range(0, LIMIT, chunk):
        n = torch.arange(start, start + chunk, dtype=torch.int64)
        assert torch.equal(quotients(n, m, shift), n // d), (d, start)
