"""`bench`: the shapes, their input sets and the calls timed (the op, torch eager and torch.compile
of the reference), one shape's measurement against the copy of its minimum bytes (timing.py: CUDA-
graph replay with input sets rotated so the working set is several times the L2), the host overhead
of a T=1 call, the checked-mode cost, and the result document `bench --json` writes.

Bytes the op must move per token: H*D*2 (q in) + P_written*D*2 (q out) + D*2 (kv in)
+ cache bytes per token + R*4 (cos/sin row) + 16 (position and slot ids).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from .. import (
    api,
    dispatch,
    ops,
    reference,
    scratch,
    torch_op,  # noqa: F401  (registers torch.ops.attn_prologue, timed by host_overhead_us)
)
from ..formats import get_format
from ..variants import IoDtype, Op, QLayout, QOut, Request
from . import sass
from .timing import copy_time_us, graph_time_us, host_time_us, l2_bytes

FULL_Q = (True, True, "head_major")  # (apply_q_norm, apply_q_rope, q_layout) of the full op


@dataclass(frozen=True)
class Shape:
    n: int
    h: int = 64
    p: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    cache_format: str = "fp8_ds_mla"
    block_size: int = 64
    zero_once: bool = False  # pad heads are not written (pool views)
    op: str = "qkv"  # qkv, kv or kv_norm
    dtype: str = "bf16"
    q_fp8: bool = False
    apply_q_norm: bool = True
    apply_q_rope: bool = True
    q_layout: str = "head_major"
    compress_ratio: int = 1  # kv ops: group-boundary rows only (positions are uniform: 1 in r rows)
    numerics: str = ""  # the KV path's parity choices (`numerics=`); "": the format's defaults
    lean_quant: bool = False  # the dispatched config with LaunchConfig.lean_quant set
    defaults_only: bool = (
        False  # ... with LaunchConfig.defaults_only set (a call with `numerics`: Runtime.serving_config)
    )
    row_split: int = 0  # k > 0: ... with LaunchConfig.row_split = k (0: the dispatched config's)

    @property
    def label(self) -> str:
        pads = "" if self.p == self.h else (" zero-once" if self.zero_once else " write-pads")
        modes = "".join(
            part
            for part, on in (
                (" no-q-norm", not self.apply_q_norm),
                (" no-q-rope", not self.apply_q_rope),
                (" interleaved", self.q_layout == "interleaved"),
                (f" r={self.compress_ratio}", self.compress_ratio != 1),
                (f" numerics={self.numerics}", self.numerics),
                (" lean_quant", self.lean_quant),
                (" defaults_only", self.defaults_only),
                (f" row_split={self.row_split}", self.row_split),
            )
            if on
        )
        heads = f" H={self.h} P={self.p}{pads}" if self.op == "qkv" else ""
        return f"{self.op} {self.cache_format} D={self.head_dim} T={self.n}{heads}{modes}"

    @property
    def request(self) -> Request:
        q_out = QOut.FP8 if self.q_fp8 else QOut.IO
        return Request(
            Op(self.op), self.head_dim, self.rope_dim, self.cache_format, IoDtype(self.dtype), q_out,
            q_layout=QLayout(self.q_layout),
        )  # fmt: skip

    def launch_config(self):
        """The config the dispatcher runs for this shape's token count and numerics (lean_quant,
        defaults_only, row_split set if asked)."""
        rt = dispatch.default_runtime()
        qkv = self.op == "qkv"
        written = (self.h if self.zero_once else self.p) if qkv else None
        v = rt.variant(self.request)
        cfg = rt.config(v, None, self.n, self.h if qkv else None, written, self.compress_ratio)
        cfg = replace(
            cfg,
            lean_quant=cfg.lean_quant or self.lean_quant,
            defaults_only=cfg.defaults_only or self.defaults_only,
            row_split=self.row_split or cfg.row_split,
        )
        if self.numerics:  # the module a call with these choices runs (folded to them, or reading them)
            cfg = rt.serving_config(v, cfg, v.format.numerics_flags(self.numerics), rt.device(None).target)
        return cfg

    def min_bytes(self) -> int:
        """The bytes the call must move: slot and position of every row; KV row, cos/sin and record
        of the rows it inserts (1 in compress_ratio); Q rows in and out."""
        fmt = get_format(self.cache_format)
        d = self.head_dim
        inserted = (d * 2 + fmt.bytes_per_token(d) + self.rope_dim * 4) * self.n // self.compress_ratio
        per_token = 16
        if self.op == "qkv":
            written = self.h if self.zero_once else self.p
            per_token += self.h * d * 2 + written * d * (1 if self.q_fp8 else 2)
        return self.n * per_token + inserted


@dataclass
class Result:
    shape: dict
    bytes: int
    op: dict
    copy: dict
    eager: dict | None = None
    compiled: dict | None = None
    extra: dict = field(default_factory=dict)
    sass: dict | None = None  # instructions per value of the module (lab/sass.py of_shape)

    @property
    def gbs(self) -> float:
        return self.bytes / self.op["median_us"] / 1e3

    @property
    def copy_gbs(self) -> float:
        return self.bytes / self.copy["median_us"] / 1e3

    def row(self) -> dict:
        r = {
            "shape": Shape(**self.shape).label,
            "us": round(self.op["median_us"], 2),
            "GB/s": round(self.gbs, 1),
            "copy us": round(self.copy["median_us"], 2),
            "copy": self.copy.get("kind", ""),
            "of copy": f"{self.copy['median_us'] / self.op['median_us']:.1%}",
        }
        if self.sass:
            r["instr/value"] = sass.summary(self.sass)
        if self.eager:
            r["vs eager"] = f"{self.eager['median_us'] / self.op['median_us']:.1f}x"
        if self.compiled:
            r["vs compile"] = f"{self.compiled['median_us'] / self.op['median_us']:.1f}x"
        return r

    def as_json(self) -> dict:
        d = asdict(self)
        d["gbs"] = self.gbs
        d["copy_gbs"] = self.copy_gbs
        return d


def input_sets(shape: Shape, sets: int) -> list[dict]:
    fmt = get_format(shape.cache_format)
    dt = IoDtype(shape.dtype).torch_dtype
    d, n = shape.head_dim, shape.n
    out = []
    g = torch.Generator(device="cuda").manual_seed(1234)
    num_blocks = max(1, (n + shape.block_size - 1) // shape.block_size)
    max_pos = 8192
    theta = torch.rand(max_pos, shape.rope_dim // 2, device="cuda", generator=g) * 6.28
    cos_sin = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    for _ in range(sets):
        s = {
            "kv": torch.randn(n, d, device="cuda", generator=g).to(dt),
            "k_cache": torch.zeros(
                num_blocks, shape.block_size * fmt.bytes_per_token(d), dtype=torch.uint8, device="cuda"
            ),
            # a paged allocator's mapping: blocks in random order, tokens consecutive inside a block
            "slot_mapping": (
                torch.randperm(num_blocks, device="cuda", generator=g).repeat_interleave(shape.block_size)
                * shape.block_size
                + torch.arange(num_blocks * shape.block_size, device="cuda") % shape.block_size
            )[:n].contiguous(),
            "positions": _positions(shape, max_pos, g),
            "cos_sin_cache": cos_sin,
        }
        if fmt.needs_tensor_scale:
            s["kv_scale"] = torch.tensor([0.02], device="cuda")
        if shape.op == "qkv":
            s["q_in"] = torch.randn(n, shape.h, d, device="cuda", generator=g).to(dt)
            if shape.q_fp8:
                s["q_out"] = torch.zeros(n, shape.p, d, device="cuda", dtype=torch.uint8).view(
                    torch.float8_e4m3fn
                )
                s["q_scale"] = torch.tensor([0.05], device="cuda")
            else:
                s["q_out"] = torch.zeros(n, shape.p, d, device="cuda", dtype=dt)
        if shape.op == "kv_norm":
            s["norm_weight"] = (torch.rand(d, device="cuda", generator=g) + 0.5).to(dt)
        out.append(s)
    return out


def _positions(shape: Shape, max_pos: int, g) -> torch.Tensor:
    """Random positions; for a compressed writer exactly one row in compress_ratio is a group boundary
    ((p + 1) % r == 0), row 0 among them, so T=1 times a row that is inserted."""
    pos = torch.randint(0, max_pos, (shape.n,), device="cuda", generator=g)
    r = shape.compress_ratio
    if r == 1:
        return pos
    offset = (torch.arange(shape.n, device="cuda") + r - 1) % r  # r - 1 (a boundary) for rows 0, r, 2r, ...
    return (pos // r * r + offset).clamp_max(max_pos // r * r - 1)


def sets_for_cold_l2(shape: Shape) -> int:
    return sets_for_bytes(shape.min_bytes())


def sets_for_bytes(nbytes: int) -> int:
    """Input sets of nbytes each that together overflow the L2 (three times over): every call reads cold."""
    return max(2, min(64, (3 * l2_bytes()) // max(1, nbytes) + 1))


def call_args(shape: Shape, s: dict) -> tuple[tuple, dict]:
    """The positional and keyword arguments of the shape's op on input set s, for the kernels and
    the reference alike."""
    if shape.op == "qkv":
        tensors = ("q_in", "kv", "q_out", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
        args = (*(s[k] for k in tensors), 1e-6, shape.block_size, shape.cache_format)
        modes = {
            "apply_q_norm": shape.apply_q_norm,
            "apply_q_rope": shape.apply_q_rope,
            "q_layout": shape.q_layout,
        }
        return args, {"kv_scale": s.get("kv_scale"), "q_scale": s.get("q_scale"), **modes}
    tensors = ("kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")
    args = (*(s[k] for k in tensors), shape.block_size, shape.cache_format)
    return args, {
        "norm_weight": s.get("norm_weight"),
        "kv_scale": s.get("kv_scale"),
        "compress_ratio": shape.compress_ratio,
    }


def op_fns(
    shape: Shape, sets: list[dict], impl: str = "kernel", config=None, checked: bool = True
) -> list[Callable[[], None]]:
    """One call per input set: the kernels (`impl="kernel"`), or the reference eager or compiled."""
    qkv = shape.op == "qkv"
    if impl == "kernel":
        fn = ops.qnorm_rope_kv_insert if qkv else ops.kv_rope_insert
        extra = {
            "config": config,
            "checked": checked,
            "numerics": shape.numerics or None,
            **({"write_pad_heads": not shape.zero_once} if qkv else {}),
        }
    else:
        fn = reference.qnorm_rope_kv_insert if qkv else reference.kv_rope_insert
        fn = _compiled(fn) if impl == "compiled" else fn
        extra = {"order": "eager", "numerics": shape.numerics or None}
    fns = []
    for s in sets:
        args, kw = call_args(shape, s)
        fns.append(functools.partial(fn, *args, **kw, **extra))
    return fns


_COMPILED: dict = {}


def _compiled(fn):
    """torch.compile of the reference, specialized per shape (dynamic=True hit an inductor tiling
    assertion with torch 2.11 on the H200)."""
    if fn not in _COMPILED:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _COMPILED[fn]


def full_op(shape: Shape) -> Shape | None:
    """For a qkv shape with a Q step skipped or the interleaved layout, the full op (both Q steps,
    head-major) of its format and size, which run_shape times just before and just after it on the same
    input sets: the targets compare the two (targets.NO_SLOWER, INTERLEAVED_COST). Against the full op's
    own row, timed shapes earlier on other buffers, a ratio would carry whatever drifted in between.
    None for the full op itself and for the KV-only ops."""
    if shape.op != "qkv" or (shape.apply_q_norm, shape.apply_q_rope, shape.q_layout) == FULL_Q:
        return None
    return replace(shape, apply_q_norm=True, apply_q_rope=True, q_layout="head_major")


def _forced_config(shape: Shape):
    """The config a shape asks for (lean_quant, defaults_only, row_split), or None: the dispatcher's."""
    return shape.launch_config() if shape.lean_quant or shape.defaults_only or shape.row_split else None


def run_shape(
    shape: Shape, *, baselines: bool = True, replays: int = 30, config=None, count_sass: bool = False
) -> Result:
    """One shape's timings against the copy; count_sass: also the instructions per value of its module."""
    nsets = sets_for_cold_l2(shape)
    sets = input_sets(shape, nsets)
    config = config or _forced_config(shape)
    calls = max(nsets, 20)
    full = full_op(shape)
    if full is not None:  # the full op just before and after the mode, on the same inputs (see full_op)
        full_fns = op_fns(full, sets, config=_forced_config(full))
        before = graph_time_us(full_fns, replays=replays, calls_per_graph=calls)["median_us"]
    op = graph_time_us(op_fns(shape, sets, config=config), replays=replays, calls_per_graph=calls)
    if full is not None:
        after = graph_time_us(full_fns, replays=replays, calls_per_graph=calls)["median_us"]
    copy = copy_time_us(shape.min_bytes(), nsets, replays, calls)
    res = Result(asdict(shape), shape.min_bytes(), op, copy)
    if full is not None:
        res.extra["full_op_us"] = [before, after]
    if count_sass:
        res.sass = sass.of_shape(shape, config)
    if baselines:
        few = sets[: min(2, len(sets))]
        for impl in ("eager", "compiled"):
            try:
                setattr(res, impl, graph_time_us(op_fns(shape, few, impl), replays=5, calls_per_graph=2))
            except Exception as exc:  # a baseline that cannot run is reported, not fatal
                res.extra[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return res


@dataclass
class HostCalls:
    """What host_overhead_us times, on one input set (each call already made once)."""

    args: tuple  # the one-call function's arguments
    fn: Callable  # the compiled function of the shape's token-count bucket ...
    raw: tuple  # ... and its prebuilt arguments
    bound: object  # a bound op (zero-once scratch from a locked pool) ...
    bound_args: tuple  # ... and its per-call arguments


def host_calls(shape: Shape) -> HostCalls:
    s = input_sets(shape, 1)[0]
    args = (
        s["q_in"],
        s["kv"],
        s["q_out"],
        s["k_cache"],
        s["slot_mapping"],
        s["positions"],
        s["cos_sin_cache"],
        1e-6,
        shape.block_size,
        shape.cache_format,
    )
    ops.qnorm_rope_kv_insert(*args)
    rt = dispatch.default_runtime()
    launcher = rt.launchers(shape.request, heads=shape.h, written=shape.p)[dispatch.bucket_index(shape.n)]
    fn = launcher.fn
    raw = tuple(s[name] for name in ops.QKV_TENSORS) + launcher.tail(
        ops.QKV_TENSORS, errors=rt.errors_buffer(), eps=1e-6, block_size=shape.block_size, n_write_heads=shape.p,
        checked=1,
    )  # fmt: skip
    fn(*raw)
    pool = scratch.ScratchPool()
    pool.reserve(max_tokens=shape.n, padded_heads=shape.p, head_dim=shape.head_dim, micro_batches=1)
    pool.lock()
    bound = api.bind(
        num_heads=shape.h,
        padded_heads=shape.p,
        head_dim=shape.head_dim,
        rope_dim=shape.rope_dim,
        cache_format=shape.cache_format,
        block_size=shape.block_size,
        pool=pool,
    )
    bound_args = (s["q_in"], s["kv"], s["k_cache"], s["slot_mapping"], s["positions"], s["cos_sin_cache"])
    bound(*bound_args)
    return HostCalls(args, fn, raw, bound, bound_args)


def host_overhead_us(shape: Shape, calls: int = 2000) -> dict:
    """Host wall time per eager call, T=1, calls issued back to back (the device work of a T=1
    call is ~2 us, so the host is the bottleneck and the loop measures it). Also measured: the
    bare TVM-FFI call with prebuilt arguments, and the call through torch.ops (custom-op boundary)."""
    c = host_calls(shape)
    out = {
        "median_us": host_time_us(lambda: ops.qnorm_rope_kv_insert(*c.args), calls),
        "bound_op_us": host_time_us(lambda: c.bound(*c.bound_args), calls),
        "bare_tvm_ffi_call_us": host_time_us(lambda: c.fn(*c.raw), calls),
    }
    try:
        op = torch.ops.attn_prologue.qnorm_rope_kv_insert
        out["torch_ops_call_us"] = host_time_us(lambda: op(*c.args[:9]), calls)
    except Exception as exc:  # the torch op is optional here
        out["torch_ops_call_us"] = None
        out["torch_ops_error"] = str(exc)
    return out


def checked_cost(shape: Shape, replays: int = 30) -> dict:
    """Time of the op with its always-on bounds checks vs with them off (same inputs, same run; off
    twice around on, for the spread)."""
    nsets = sets_for_cold_l2(shape)
    sets = input_sets(shape, nsets)
    calls = max(nsets, 20)
    off = graph_time_us(op_fns(shape, sets, checked=False), replays=replays, calls_per_graph=calls)[
        "median_us"
    ]
    on = graph_time_us(op_fns(shape, sets, checked=True), replays=replays, calls_per_graph=calls)["median_us"]
    off2 = graph_time_us(op_fns(shape, sets, checked=False), replays=replays, calls_per_graph=calls)[
        "median_us"
    ]
    return {
        "shape": shape.label,
        "unchecked_us": min(off, off2),
        "checked_us": on,
        "cost": on / min(off, off2) - 1,
        "unchecked_spread": abs(off - off2) / min(off, off2),
    }


def print_table(results: list[Result]) -> str:
    rows = [r.row() for r in results]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    w = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(w[c]) for c in cols), "  ".join("-" * w[c] for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def document(results: list[Result], meta: dict, provenance: dict) -> dict:
    """What `bench --json` writes and `targets` reads."""
    return {"provenance": provenance, "meta": meta, "results": [r.as_json() for r in results]}


def save(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
