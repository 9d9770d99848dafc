"""Launch configurations: the compile-time knobs of a kernel module, and per-arch defaults.

A config is not part of a variant's identity; it is part of the kernel-cache key. Knobs that cost
nothing at run time are run-time arguments instead (pad-head handling: `n_write_heads`; index
checking: `checked`), so one compiled object serves every such choice.
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True, order=True)
class LaunchConfig:
    warps_per_cta: int = 4
    passes_per_warp: int = 1  # passes (32 / lanes-per-row rows each) a warp loads before it computes
    pdl: bool = True  # programmatic dependent launch: griddepcontrol.wait / launch_dependents
    non_coherent: bool = True  # row loads through ld.global.nc (when not streaming; the inputs read before the PDL wait stay coherent)
    ctas_per_sm: int = 0  # 0: one warp per pass group (grid covers all); k: grid <= k x SMs, warps stride
    spread_kv: bool = False  # KV CTAs spaced evenly among the Q CTAs instead of all before them
    streaming: bool = False  # q/kv rows loaded and q_out stored with the streaming cache hint (.cs)
    min_ctas_per_sm: int = 0  # k > 0: launch bound .minnctapersm k (registers capped so k CTAs fit on an SM)
    # int32 slot ids: the compiled signature takes slot_mapping as int32 (the module is the same; the
    # runtime sets this for callers with int32 ids, so tuned configs serve both widths)
    slots32: bool = False
    # the leaner exact quantization arithmetic (device/kernel_lib.py, the lean section): E2M1 rounding by
    # a magic add, NVFP4 x / s and 1 / s and the scale quotient amax / fp_max by a reciprocal and one
    # exact correction. The same bytes (proven on the CPU: tests/test_lean_quant_cpu.py; on the H200 by
    # tests/gpu: test_launch_configs_match_reference). Off by default: the tuner picks it per bucket (on
    # the H200 it won the FP4 writers by 1.1-1.3x, docs/launch-knobs.md)
    lean_quant: bool = False
    # compiled for the format's default parity choices only: the kernel reads its `numerics` argument as
    # the defaults' constant, so the choices' branches fold away. The dispatcher binds such a module
    # only to calls whose `numerics` are the defaults (Runtime.launchers), and another module otherwise
    defaults_only: bool = False
    # k >= 0: compiled for the parity choices whose `numerics` bits are k (e.g. an engine preset's), folded
    # like defaults_only's. The dispatcher binds it, where it is built (`build --numerics SPEC`), to the
    # calls with exactly those bits on a tuned defaults_only config; -1: the bits are read at run time
    folded_numerics: int = -1
    # k > 1: each KV row is split over k warps (each holds 1/k of the row's vectors), so a row's
    # instruction chain is k times shorter: the decode sizes, where few rows leave SMs idle, finish
    # sooner. Only for modules whose rows need no whole-row reduction (row_split_applies)
    row_split: int = 1
    # the cos/sin rows loaded after the PDL wait, beside the row loads (the scan kernel always does).
    # Early (the default) they overlap the kernel before; late, a pass's row loads need not wait for
    # its positions first. On the H200 late never helped qkv and moved the KV writers by -7..+4% at
    # T >= 2048 (docs/launch-knobs.md): the tuner picks it per bucket
    cos_sin_late: bool = False
    # k > 0: a Q row over k lanes (8, 16 or 32, index_q's 4 or 8; 0: the module's own), so a warp's
    # store instruction writes 32 / k rows. In the chunk-interleaved layout those are adjacent heads of
    # one token, and each chunk's pieces of them land as one run (k = 16: 64 bytes) with no
    # shared-memory stage; a lane's chain is 32 / k times a 32-lane row's. Q modules only (Variant.q_lanes)
    q_lanes: int = 0
    # int32 positions: the compiled signature takes positions as int32 (index_q only: SGLang's indexer passes
    # int32 or int64; the runtime sets this for such callers, so one tuned config serves both widths)
    positions32: bool = False

    def __post_init__(self):
        if self.warps_per_cta not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"warps_per_cta must be a power of two in 1..32, got {self.warps_per_cta}")
        if self.passes_per_warp not in (1, 2, 4):
            raise ValueError(f"passes_per_warp must be 1, 2 or 4, got {self.passes_per_warp}")
        if not 0 <= self.ctas_per_sm <= 64:
            raise ValueError(f"ctas_per_sm must be in 0..64, got {self.ctas_per_sm}")
        if not 0 <= self.min_ctas_per_sm <= 32:
            raise ValueError(f"min_ctas_per_sm must be in 0..32, got {self.min_ctas_per_sm}")
        if not -1 <= self.folded_numerics < 1 << 16:
            raise ValueError(
                f"folded_numerics must be -1 or numerics bits in 0..65535, got {self.folded_numerics}"
            )
        if self.defaults_only and self.folded_numerics >= 0:
            raise ValueError("defaults_only and folded_numerics each fix the numerics: give one")
        if self.row_split not in (1, 2, 4):
            raise ValueError(f"row_split must be 1, 2 or 4, got {self.row_split}")
        if self.q_lanes not in (0, 4, 8, 16, 32):
            raise ValueError(
                f"q_lanes must be 0 (the module's), 4 (index_q), 8, 16 or 32, got {self.q_lanes}"
            )

    @property
    def persistent(self) -> bool:
        """Compile the grid-stride loop (the grid is capped at run time by max_ctas)."""
        return self.ctas_per_sm > 0

    def folded_to(self, bits: int, default_bits: int) -> LaunchConfig:
        """This config compiled for exactly these `numerics` bits (defaults_only for the defaults'), unless it
        fixes its own already."""
        if self.defaults_only or self.folded_numerics >= 0:
            return self
        if bits == default_bits:
            return replace(self, defaults_only=True)
        return replace(self, folded_numerics=bits)

    @property
    def key(self) -> str:
        """Stable string form, used in kernel-cache keys and tuning databases."""
        k = f"w{self.warps_per_cta}_u{self.passes_per_warp}_pdl{int(self.pdl)}_nc{int(self.non_coherent)}"
        if self.ctas_per_sm:
            k += f"_c{self.ctas_per_sm}"
        if self.spread_kv:
            k += "_spread"
        if self.streaming:
            k += "_cs"
        if self.min_ctas_per_sm:
            k += f"_m{self.min_ctas_per_sm}"
        if self.slots32:
            k += "_s32"
        if self.lean_quant:
            k += "_lq"
        if self.defaults_only:
            k += "_d"
        if self.folded_numerics >= 0:
            k += f"_n{self.folded_numerics}"
        if self.row_split > 1:
            k += f"_r{self.row_split}"
        if self.cos_sin_late:
            k += "_late"
        if self.q_lanes:
            k += f"_q{self.q_lanes}"
        if self.positions32:
            k += "_p32"
        return k

    @classmethod
    def from_key(cls, key: str) -> LaunchConfig:
        m = re.fullmatch(
            r"w(\d+)_u(\d+)_pdl([01])_nc([01])(?:_c(\d+))?(_spread)?(_cs)?(?:_m(\d+))?(_s32)?(_lq)?(_d)?(?:_n(\d+))?(?:_r(\d+))?(_late)?(?:_q(\d+))?(_p32)?",
            key,
        )
        if not m:
            close = difflib.get_close_matches(key, _keys_like(key), n=1)
            raise ValueError(
                f"not a launch-config key: {key!r}"
                + (f" (did you mean {close[0]}?)" if close else "")
                + "; keys read w<warps per CTA>_u<passes per warp>_pdl<0|1>_nc<0|1>[_c<CTAs per SM>]"
                "[_spread][_cs][_m<min CTAs per SM>][_s32][_lq][_d][_n<folded numerics bits>][_r<warps per KV row>][_late][_q<lanes per Q row>][_p32], e.g. w4_u1_pdl1_nc1_cs"
            )
        return cls(
            int(m.group(1)),
            int(m.group(2)),
            bool(int(m.group(3))),
            bool(int(m.group(4))),
            int(m.group(5) or 0),
            bool(m.group(6)),
            bool(m.group(7)),
            int(m.group(8) or 0),
            bool(m.group(9)),
            bool(m.group(10)),
            bool(m.group(11)),
            folded_numerics=int(m.group(12) if m.group(12) is not None else -1),
            row_split=int(m.group(13) or 1),
            cos_sin_late=bool(m.group(14)),
            q_lanes=int(m.group(15) or 0),
            positions32=bool(m.group(16)),
        )

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@functools.cache
def _all_keys() -> tuple[str, ...]:
    return tuple(c.key for c in all_configs())


def _keys_like(key: str) -> list[str]:
    """The keys to suggest from: those of the same warps and passes when there are any (difflib over
    all 55k keys takes seconds)."""
    head = "_".join(key.split("_")[:2]) + "_"
    return [k for k in _all_keys() if k.startswith(head)] or list(_all_keys())


def all_configs() -> list[LaunchConfig]:
    """Every config the template supports (the tuner prunes from these; slot width is the caller's), with
    Q rows on the module's lanes or on 16 (q_lanes 8 and 32 are taken too but not swept: 32 is the
    D = 512 default, and 8, as the interleaved layout's default once, was 8% slower at T = 1: codegen/plan.py)."""
    return [
        LaunchConfig(
            w,
            u,
            pdl,
            nc,
            c,
            spread,
            cs,
            m,
            lean_quant=lean,
            defaults_only=dflt,
            row_split=k,
            cos_sin_late=late,
            q_lanes=q,
        )
        for w in (1, 2, 4, 8, 16, 32)
        for u in (1, 2, 4)
        for pdl in (True, False)
        for nc in (True, False)
        for c in (0, 4, 8, 16)
        for spread in (False, True)
        for cs in (False, True)
        for m in (0, min(32, 48 // w))  # a register cap for 48 resident warps
        for lean in (False, True)
        for dflt in (False, True)
        for k in (1, 2, 4)
        for late in (False, True)
        for q in (0, 16)
    ]
