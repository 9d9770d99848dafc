"""Why each arch family's default launch config (attn_prologue.variants.ArchFamily.default_config) is
what it is: the arithmetic, computed here from the parts' datasheet numbers, and what was measured.
`python -m attn_prologue list --archs` prints it.

Bytes in flight. Little's law: to keep DRAM busy an SM must have bandwidth x latency / SMs bytes of
loads outstanding. Per SM clock that is (DRAM bytes per clock per SM) x (latency in clocks); the
latency is taken as ~700 SM clocks on every part (a lead: not measured on SM100/SM120). One warp pass
of a D=512 row has 1 KB of loads in flight (32 lanes x 2 x 16 bytes), of a D=128 row 256 bytes x 4
rows = 1 KB as well.

Resident warps. Registers are allocated per warp in units of 256 (a thread's count rounded up to a
multiple of 8), from a 64K-register file per SM, and whole CTAs at a time; so with r registers per
thread and w warps per CTA, min(max CTAs, max warps // w, 65536 // (w * 32 * ceil8(r))) CTAs fit.
These kernels use 38-54 registers per thread (the build's summary table); at 41-48 registers a
4-warp CTA takes 6,144 registers, so 10 CTAs = 40 warps fit (not ~46: the rounding to 8 and to whole
CTAs both cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import ArchFamily

DRAM_LATENCY_CLOCKS = 700
BYTES_PER_WARP_PASS = 1024  # loads in flight per warp pass (D=512: one row; D=128: four rows)
REGISTERS_PER_SM = 65536


def resident_warps(registers: int, warps_per_cta: int, max_warps: int, max_ctas: int) -> int:
    """Warps resident on one SM (register-, warp- and CTA-limited)."""
    per_cta = warps_per_cta * 32 * (-(-registers // 8) * 8)
    ctas = min(max_ctas, max_warps // warps_per_cta, REGISTERS_PER_SM // per_cta)
    return ctas * warps_per_cta


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
        return self.bytes_per_clock_per_sm * DRAM_LATENCY_CLOCKS

    @property
    def warps_needed(self) -> float:
        """Resident warps per SM whose loads cover the bytes in flight DRAM needs."""
        return self.inflight_bytes_per_sm / BYTES_PER_WARP_PASS


@dataclass(frozen=True)
class ArchSpec:
    family: str
    parts: tuple[Part, ...]
    max_warps_per_sm: int
    max_ctas_per_sm: int
    measured: str  # what was measured (on the H200) that bears on the choice, with the file

    @property
    def default_config(self) -> LaunchConfig:
        """The family's default (attn_prologue.variants.ArchFamily holds it; this says why)."""
        return ArchFamily(self.family).default_config

    def reasoning(self, registers: tuple[int, int] = (41, 48)) -> str:
        """The arithmetic for this family's default, from the numbers above."""
        w = self.default_config.warps_per_cta
        lo, hi = (resident_warps(r, w, self.max_warps_per_sm, self.max_ctas_per_sm) for r in registers)
        parts = "; ".join(
            f"{p.name}: {p.dram_gbs / 1000:.2f} TB/s over {p.sms} SMs at {p.clock_ghz} GHz = "
            f"{p.bytes_per_clock_per_sm:.1f} B/clock/SM, {p.inflight_bytes_per_sm / 1024:.1f} KB in flight per "
            f"SM = {p.warps_needed:.1f} warps"
            for p in self.parts
        )
        return (
            f"{self.family}, default {self.default_config.key}. Needed: {parts}. Resident with {w}-warp CTAs "
            f"at {registers[0]}-{registers[1]} registers: {min(lo, hi)}-{max(lo, hi)} warps per SM (limits "
            f"{self.max_warps_per_sm} warps, {self.max_ctas_per_sm} CTAs). {self.measured}"
        )


SM90_MEASURED = (
    "Measured on the H200: 4-warp CTAs are the best or within 1% of it from T=256 up, 2-warp CTAs "
    "1.2x (D=512) and 2.2x (D=128) slower at T=2048-8192 (the tune sweeps in results/); streaming hints "
    "(.cs) on the q/kv rows and q_out 0.3-4% faster at T >= 512 (results/experiments/ab2_*.json); the "
    "cos/sin rows read before the PDL wait (cos_sin_late off) 0.19-0.34 us faster at T <= 64 and within "
    "1% of late for qkv at T >= 2048 (results/experiments/tune-qkv-*-h200-dae04a2.json.gz): a load "
    "order, so it carries to every family."
)

ARCH_SPECS = {
    "sm90": ArchSpec(
        family="sm90",
        parts=(Part("H100 SXM", 132, 3350, 1.98), Part("H200", 132, 4800, 1.98)),
        max_warps_per_sm=64,
        max_ctas_per_sm=32,
        measured=SM90_MEASURED,
    ),
    "sm100": ArchSpec(
        family="sm100",
        parts=(Part("B200", 148, 8000, 1.965),),
        max_warps_per_sm=64,
        max_ctas_per_sm=32,
        measured=(
            "About 1.5x the H200's bytes in flight per SM; the 40 resident warps are ~2x the 19 needed, "
            "and passes_per_warp=2 (a tuned knob) doubles each warp's loads in flight if the latency turns "
            "out longer. Untuned: no SM100 GPU was available; the SM90 measurements carry over."
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
        measured=(
            "So bytes in flight never bound these parts: 2-3 resident warps per SM saturate DRAM. What "
            "differs between CTA sizes is the CTA count: at decode sizes every pass is resident at once "
            "either way (T=1, H=64: 65 warp passes, 17 4-warp CTAs; T=8: 130 CTAs, under 3 per SM even on "
            "GB10's 48 SMs), so a call is one pass's latency with 2- or 4-warp CTAs; at prefill sizes "
            "twice the CTAs cost 1.2x (D=512) to 2.2x (D=128) on the H200, whose CTA scheduling SM120 "
            "shares. Hence 4-warp CTAs, as on SM90 (an earlier 2-warp default had no measurement behind "
            "it). Untuned: no SM120 GPU was available."
        ),
    ),
}
