"""Random calls for the entry-point fuzz test (tests/test_fuzz_entry_points.py): a valid call of a random
shape with random valid variations, and a catalog of edits each of which makes a call invalid.

A valid call: N in 0..6 tokens, H in 1..4 heads, P >= H (or Q in place), every (D, format, dtype, Q
output) the variant space holds at R = 64, distinct int64 or int32 slot ids with negative ones (skipped)
and ones past the cache (skipped, counted), positions outside the table (counted), M < N, kv a column slice of a
wider tensor, q_out with more rows than tokens, FP8 q_out, the fp8_tensor scale; KV-only calls with a
norm weight and compress ratios. Nothing here decides validity from the code under test: the edits are
invalid by the contract (docs/op.md), and `find` (the variant space, data) only picks what exists."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from attn_prologue.errors import UnsupportedError
from attn_prologue.formats import get_format
from attn_prologue.variants import ArchFamily, IoDtype, Op, QOut, Request, find

R = 64
FORMATS = {128: ("fp8_token", "mxfp4", "bf16", "fp8_tensor"),
           512: ("fp8_ds_mla", "mxfp8", "nvfp4_dsv4", "bf16", "fp8_tensor", "nvfp4_v41")}  # fmt: skip


@dataclass
class Call:
    op: str  # "qkv" or "kv"
    args: dict  # tensors and scalars by argument name (absent optional arguments: None)
    fmt: str
    in_place: bool = False
    edits: list = field(default_factory=list)  # names of the edits applied (empty: a valid call)

    @property
    def n(self) -> int:
        return self.args["q_in"].shape[0] if self.op == "qkv" else self.args["kv"].shape[0]


def _exists(op: Op, d: int, fmt: str, io: IoDtype, q8: bool) -> bool:
    try:
        find(Request(op, d, R, fmt, io, QOut.FP8 if q8 else QOut.IO), ArchFamily.SM90)
    except UnsupportedError:
        return False
    return True


def valid_call(rng: random.Random, op: str) -> Call:
    """A random valid call (retried until its variant exists)."""
    while True:
        d = rng.choice((128, 512))
        fmt = rng.choice(FORMATS[d])
        dtype = rng.choice((torch.bfloat16, torch.float16))
        io = IoDtype.of_torch(dtype)
        q8 = op == "qkv" and rng.random() < 0.2
        norm = op == "kv" and rng.random() < 0.4
        kind = Op.QKV if op == "qkv" else Op.KV_NORM if norm else Op.KV
        if _exists(kind, d, fmt, io, q8):
            break
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    n = rng.choice((0, 1, 1, 2, 3, 5, 6))
    m = n if rng.random() < 0.7 else rng.randint(0, n)
    bs = rng.choice((1, 2, 16))
    blocks = rng.randint(1, 4)
    max_pos = rng.randint(4, 24)
    f = get_format(fmt)
    page = -(-bs * f.bytes_per_token(d) // 16) * 16 + rng.choice((0, 16, 48))  # a 16-byte page stride
    capacity = blocks * bs
    # distinct slots (two rows to one slot leave an undefined record), some -1 (skipped) and some past
    # the cache (skipped, counted)
    slots = torch.randperm(max(capacity + 2, m), generator=g)[:m] - 1
    if rng.random() < 0.3:
        slots = slots.to(torch.int32)
    positions = torch.randint(-1, max_pos + 1, (n,), generator=g)  # -1 and max_pos: counted
    theta = torch.rand(max_pos, R // 2, generator=g) * 6.28
    wide = rng.random() < 0.3  # kv as a column slice of a wider projection
    kv = torch.randn(n, 2 * d if wide else d, generator=g).to(dtype)[:, :d]
    args = dict(
        kv=kv,
        k_cache=torch.randint(0, 256, (blocks, page), generator=g, dtype=torch.uint8),
        slot_mapping=slots.contiguous(),
        positions=positions,
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
        eps=rng.choice((1e-6, 1e-5, 0.0)),
        block_size=bs,
        cache_format=fmt,
        kv_scale=torch.rand(1, generator=g) + 0.05 if f.needs_tensor_scale else None,
    )
    call = Call(op, args, fmt)
    if op == "qkv":
        h = rng.randint(1, 4)
        q_in = torch.randn(n, h, d, generator=g).to(dtype)
        call.in_place = not q8 and rng.random() < 0.25
        if call.in_place:
            q_out = q_in
        else:
            p = h + rng.choice((0, 1, 3))
            q_out = torch.empty(n + rng.choice((0, 0, 2)), p, d, dtype=torch.float8_e4m3fn if q8 else dtype)
            q_out.view(torch.uint8).copy_(torch.randint(0, 256, q_out.view(torch.uint8).shape, generator=g))
        args.update(q_in=q_in, q_out=q_out, q_scale=torch.rand(1, generator=g) + 0.05 if q8 else None)
    else:
        args["positions"] = torch.randint(-1, max_pos + 1, (max(m, n) + rng.choice((0, 2)),), generator=g)
        args["norm_weight"] = torch.randn(d, generator=g).to(dtype) if norm else None
        args["compress_ratio"] = rng.choice(f.compress_ratios) if rng.random() < 0.3 else 1
    return call


# ---- edits: each makes a call invalid ---------------------------------------------------------------
def _bytes_of(buf: torch.Tensor, t: torch.Tensor, offset: int = 0) -> torch.Tensor | None:
    """A view of (contiguous) buf's bytes from offset holding t's values, or None if it does not fit."""
    size = t.numel() * t.element_size()
    flat = buf.view(torch.uint8).view(-1)
    if t.numel() == 0 or offset + size > flat.numel():
        return None
    view = flat[offset : offset + size].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def _inside(name: str, where: str):
    """`name` becomes a view of the buffer `where`'s bytes (its values kept): an overlap."""

    def edit(c: Call, rng):
        src = c.args[name]
        if not isinstance(src, torch.Tensor) or not src.is_contiguous():
            src = src.contiguous() if isinstance(src, torch.Tensor) else None
        view = None if src is None else _bytes_of(c.args[where], src, 16 * rng.randint(0, 2))
        if view is None:
            return False
        c.args[name] = view
        return True

    return edit


def _set(name: str, value):
    def edit(c: Call, rng):
        c.args[name] = value(c) if callable(value) else value
        return True

    return edit


def _when(cond, edit):
    return lambda c, rng: cond(c) and edit(c, rng)


def _pages_overlapping(c: Call, rng) -> bool:
    kc = c.args["k_cache"]
    need = c.args["block_size"] * get_format(c.fmt).bytes_per_token(c.args["kv"].shape[1])
    if kc.shape[0] < 2 or need < 32:
        return False
    c.args["k_cache"] = kc.as_strided(kc.shape, (need - 16, 1))
    return True


def _q_in_in_q_out(c: Call, rng) -> bool:
    q_in, q_out = c.args["q_in"], c.args["q_out"]
    if c.in_place or q_out.dtype != q_in.dtype or q_out.shape[1] <= q_in.shape[1] or q_in.shape[0] == 0:
        return False
    view = q_out[: q_in.shape[0], : q_in.shape[1]]
    view.copy_(q_in)
    c.args["q_in"] = view
    return True


def _kv_in_q_out_pads(c: Call, rng) -> bool:
    q_in, q_out, kv = c.args["q_in"], c.args["q_out"], c.args["kv"]
    if q_out.dtype != kv.dtype or q_out.shape[1] <= q_in.shape[1] or kv.shape[0] == 0:
        return False
    view = q_out[: kv.shape[0], -1]  # a pad head: the op writes zeros there
    view.copy_(kv)
    c.args["kv"] = view
    return True


def _longer_slots(c: Call, rng) -> bool:
    s = c.args["slot_mapping"]
    rows = c.args["kv"].shape[0] if c.op == "kv" else c.n
    c.args["slot_mapping"] = torch.cat((s, torch.zeros(rows + 1 - s.shape[0], dtype=s.dtype)))
    return True


def _negated(name):
    """`name` becomes a lazily negated view of the same values."""

    def edit(c: Call, rng):
        t = c.args[name]
        if t is None or t.dtype == torch.float8_e4m3fn or (c.in_place and name in ("q_in", "q_out")):
            return False
        c.args[name] = torch._neg_view(-t)
        return True

    return edit


QKV_ONLY = lambda c: c.op == "qkv"  # noqa: E731
OWN_Q_OUT = lambda c: c.op == "qkv" and not c.in_place  # noqa: E731
HAS_ROWS = lambda c: c.n > 0  # noqa: E731


@dataclass(frozen=True)
class Edit:
    apply: object  # (call, rng) -> whether it applied
    kind: object  # True: a rule the host code checks on every call (the fast paths too); False: one the
    # compiled kernel's own argument check enforces on CUDA (dtypes, ranks, strides, devices), which a
    # CPU stand-in kernel does not; "scalar": a Python scalar type the torch ops' schema would convert
    # (True -> 1) or refuse untyped, refused by the ops' own check first (torch_op.py)
    touches: tuple  # the arguments it changes or relies on


EDITS = {
    "kv inside k_cache": Edit(_inside("kv", "k_cache"), True, ("kv", "k_cache")),
    "positions inside k_cache": Edit(_inside("positions", "k_cache"), True, ("positions", "k_cache")),
    "slot_mapping inside k_cache": Edit(_inside("slot_mapping", "k_cache"), True, ("slot_mapping", "k_cache")),
    "cos_sin_cache inside k_cache": Edit(_inside("cos_sin_cache", "k_cache"), True, ("cos_sin_cache", "k_cache")),
    "norm_weight inside k_cache": Edit(_when(lambda c: c.args.get("norm_weight") is not None,
                                             _inside("norm_weight", "k_cache")), True, ("norm_weight", "k_cache")),
    "k_cache pages overlapping": Edit(_pages_overlapping, True, ("k_cache",)),
    "q_in inside q_out": Edit(_when(QKV_ONLY, _q_in_in_q_out), True, ("q_in", "q_out")),
    "kv inside q_out's pad heads": Edit(_when(QKV_ONLY, _kv_in_q_out_pads), True, ("kv", "q_out")),
    "positions inside q_out": Edit(_when(OWN_Q_OUT, _inside("positions", "q_out")), True, ("positions", "q_out")),
    "M > rows": Edit(_longer_slots, True, ("slot_mapping",)),
    "q_out fewer rows than tokens": Edit(_when(lambda c: OWN_Q_OUT(c) and HAS_ROWS(c),
                                               _set("q_out", lambda c: c.args["q_out"][: c.n - 1])), True, ("q_out",)),
    "q_out P < H": Edit(_when(lambda c: OWN_Q_OUT(c) and c.args["q_in"].shape[1] > 1,
                              _set("q_out", lambda c: c.args["q_out"][:, :1].contiguous())), True, ("q_out",)),
    "block_size too large for the pages": Edit(_set("block_size", lambda c: c.args["block_size"] * 64), True,
                                               ("block_size",)),
    "block_size 0": Edit(_set("block_size", 0), True, ("block_size",)),
    "block_size negative": Edit(_set("block_size", -16), True, ("block_size",)),
    "k_cache int8": Edit(_set("k_cache", lambda c: c.args["k_cache"].view(torch.int8)), True, ("k_cache",)),
    "k_cache without blocks": Edit(_set("k_cache", lambda c: c.args["k_cache"][:0]), True, ("k_cache",)),
    "cos_sin_cache without rows": Edit(_set("cos_sin_cache", lambda c: c.args["cos_sin_cache"][:0]), True,
                                       ("cos_sin_cache",)),
    "eps negative": Edit(_set("eps", -1e-3), True, ("eps",)),
    "eps inf": Edit(_set("eps", math.inf), True, ("eps",)),
    "kv_scale where the format takes none": Edit(_when(lambda c: c.args["kv_scale"] is None,
                                                       _set("kv_scale", torch.tensor([0.5]))), True, ("kv_scale",)),
    "kv_scale missing": Edit(_when(lambda c: c.args["kv_scale"] is not None, _set("kv_scale", None)), True,
                             ("kv_scale",)),
    "block_size True": Edit(_set("block_size", True), "scalar", ("block_size",)),
    "block_size float": Edit(_set("block_size", lambda c: float(c.args["block_size"])), "scalar", ("block_size",)),
    "eps True": Edit(_set("eps", True), "scalar", ("eps",)),
    "eps text": Edit(_set("eps", "1e-6"), "scalar", ("eps",)),
    "block_size text": Edit(_set("block_size", "16"), "scalar", ("block_size",)),
    "eps nan": Edit(_set("eps", math.nan), True, ("eps",)),
    "block_size 2**40": Edit(_set("block_size", 2**40), True, ("block_size",)),
    "kv in another dtype": Edit(_set("kv", lambda c: c.args["kv"].float()), False, ("kv",)),
    "positions int32": Edit(_set("positions", lambda c: c.args["positions"].int()), False, ("positions",)),
    "cos_sin_cache bfloat16": Edit(_set("cos_sin_cache", lambda c: c.args["cos_sin_cache"].bfloat16()), False,
                                   ("cos_sin_cache",)),
    "cos_sin_cache rope dim 32": Edit(_set("cos_sin_cache", lambda c: c.args["cos_sin_cache"][:, :32].contiguous()),
                                      False, ("cos_sin_cache",)),
    "kv rows not 16-byte apart": Edit(_when(lambda c: c.args["kv"].shape[0] > 1, _set("kv", lambda c: torch.empty(
        c.args["kv"].shape[0], c.args["kv"].shape[1] + 1, dtype=c.args["kv"].dtype)[:, :-1])), False, ("kv",)),
    "kv 3-D": Edit(_set("kv", lambda c: c.args["kv"].unsqueeze(1)), False, ("kv",)),
    "slot_mapping 2-D": Edit(_set("slot_mapping", lambda c: c.args["slot_mapping"].view(-1, 1)), False,
                             ("slot_mapping",)),
    "positions meta": Edit(_set("positions", lambda c: c.args["positions"].to("meta")), False, ("positions",)),
    "k_cache meta": Edit(_set("k_cache", lambda c: c.args["k_cache"].to("meta")), False, ("k_cache",)),
    **{f"{name} negated view": Edit(_when(lambda c, n=name: n in c.args, _negated(name)), True, (name,))
       for name in ("q_in", "kv", "q_out", "k_cache", "positions", "cos_sin_cache", "norm_weight")},
}  # fmt: skip


def edit(call: Call, rng: random.Random, allowed, *, passed=None) -> bool:
    """Apply one random edit whose kind is in `allowed` and whose arguments are all in `passed` (None:
    any); whether one applied (a few tries)."""
    names = [
        n for n, e in EDITS.items() if e.kind in allowed and (passed is None or set(e.touches) <= passed)
    ]
    for _ in range(8):
        name = rng.choice(names)
        if EDITS[name].apply(call, rng):
            call.edits.append(name)
            return True
    return False


def make_call(
    seed: int,
    op: str,
    edit_seed: int | None = None,
    allowed=(True, False, "scalar"),
    *,
    passed=None,
    share=None,
) -> Call:
    """The call of `seed` (rebuilt identically, fresh tensors, for each entry point), with the tensors
    named in `share` taken from another call first (a bound op's k_cache and table), then edited by
    `edit_seed` (None: valid). A call no edit applies to stays valid."""
    call = valid_call(random.Random(seed), op)
    for name, t in (share or {}).items():
        call.args[name] = t
    if edit_seed is not None:
        edit(call, random.Random(edit_seed), set(allowed), passed=passed)
    return call


def counts(call: Call) -> list[int]:
    """What the kernels count for a valid call (docs/op.md): [KV rows with slot >= 0 not written because
    the slot is past the cache or the position outside the table, Q tokens written as zeros]."""
    a = call.args
    cap = a["k_cache"].shape[0] * a["block_size"]
    max_pos = a["cos_sin_cache"].shape[0]
    bad_pos = [not 0 <= int(p) < max_pos for p in a["positions"].tolist()]
    slots = a["slot_mapping"].tolist()
    kv_rows = sum(1 for t, s in enumerate(slots) if s >= 0 and (s >= cap or bad_pos[t]))
    return [kv_rows, sum(bad_pos[: call.n]) if call.op == "qkv" else 0]
