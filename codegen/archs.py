"""Per-arch facts behind each family's launch defaults (ArchFamily.default_config), with where each
number comes from. Nothing renders them: the defaults are run-time choices, not generated code.

Bytes per clock per SM = DRAM bandwidth / (SM clock x SM count): how much of the memory system
one SM's share is. Little's law gives the bytes each SM must keep in flight to saturate DRAM:
bandwidth x latency / SMs (DRAM latency taken as ~700 SM clocks on all three).
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import ArchFamily


@dataclass(frozen=True)
class Part:
    name: str
    sms: int
    dram_gbs: float  # vendor datasheet DRAM bandwidth, GB/s
    clock_ghz: float  # boost SM clock

    @property
    def bytes_per_clock_per_sm(self) -> float:
        return self.dram_gbs / (self.clock_ghz * self.sms)

    @property
    def inflight_bytes_per_sm(self) -> float:
        return self.bytes_per_clock_per_sm * 700


@dataclass(frozen=True)
class ArchSpec:
    family: str
    parts: tuple[Part, ...]
    max_warps_per_sm: int
    max_ctas_per_sm: int
    smem_per_block_kb: int
    reasoning: str

    @property
    def default_config(self) -> LaunchConfig:
        """The family's default (attn_prologue.variants.ArchFamily holds it; this says why)."""
        return ArchFamily(self.family).default_config


ARCH_SPECS = {
    "sm90": ArchSpec(
        family="sm90",
        parts=(Part("H100 SXM", 132, 3350, 1.98), Part("H200", 132, 4800, 1.98)),
        max_warps_per_sm=64,
        max_ctas_per_sm=32,
        smem_per_block_kb=227,
        reasoning=(
            "H200: 4.8 TB/s over 132 SMs at 1.98 GHz is ~18 B/clock/SM, so ~13 KB must be in flight per "
            "SM. A D=512 row is 1 KB of loads per warp, so >= 13 resident warps per SM; at the ~44 "
            "registers/thread these kernels use, 64K registers hold ~46 warps (11 CTAs of 4 warps) per "
            "SM, ~3x what is needed. Measured on the H200: 4-warp CTAs are the best or within 1% of it "
            "from T=256 up (tune results in results/). Streaming hints (.cs) on the q/kv rows and q_out "
            "measured 0.3-4% faster at T >= 512 (results/experiments/ab2_*.json)."
        ),
    ),
    "sm100": ArchSpec(
        family="sm100",
        parts=(Part("B200", 148, 8000, 1.965),),
        max_warps_per_sm=64,
        max_ctas_per_sm=32,
        smem_per_block_kb=227,
        reasoning=(
            "B200: 8 TB/s over 148 SMs is ~28 B/clock/SM (~19 KB in flight per SM, >= 19 warps of 1 KB); "
            "register-limited occupancy (~46 warps at ~44 registers) covers it with 4-warp CTAs; streaming "
            "hints as on SM90. "
            "Untuned: no SM100 GPU was available."
        ),
    ),
    "sm120": ArchSpec(
        family="sm120",
        parts=(
            Part("GB10 (DGX Spark)", 48, 273, 2.5),
            Part("RTX 5090", 170, 1792, 2.41),
            Part("RTX PRO 6000 Blackwell", 188, 1792, 2.6),
        ),
        max_warps_per_sm=48,
        max_ctas_per_sm=24,
        smem_per_block_kb=99,
        reasoning=(
            "SM120 has little DRAM bandwidth per SM (2.3-4.4 B/clock/SM: ~1.6-3 KB in flight per SM "
            "suffices), 48 warps and 24 CTAs per SM, and 99 KB shared memory per block (unused: this "
            "kernel keeps rows in registers, so shared memory never bounds occupancy). The scarce "
            "resource at decode sizes is SMs busy, not bytes in flight: 2-warp CTAs spread a small "
            "batch over twice as many of the 48-188 SMs; 24 CTAs x 2 warps fill the 48-warp limit "
            "where registers allow (<= 42/thread; ~44 registers give ~46 warps). Streaming hints as on SM90. "
            "Untuned: no SM120 GPU was available."
        ),
    ),
}
