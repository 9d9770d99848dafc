"""First-use self-test of native-conversion modules on a machine where they have not run before.

The native-conversion modules (SM100/SM120: cvt ue8m0x2 / e2m1x2) are verified here only by
compiling them and reading their PTX/SASS; the first time one is bound on a real GPU, the
dispatcher hands its launcher to `run`, which runs it on a few random tokens against the reference.
On a mismatch the dispatcher warns loudly and binds the portable-conversion module of the same
variant instead. Only variants with a distinct portable module are tested. Outcomes are remembered
per device, package and DSL version and module source (`Records`, a JSON file inside the kernel
cache directory), so the test runs once per machine, not once per process.

ATTN_PROLOGUE_SELFTEST=always also tests variants without a distinct fallback (their fallback is
themselves: this is how the machinery is exercised on SM90); =off disables it.
ATTN_PROLOGUE_SELFTEST_FAULT=1 corrupts one output byte before the comparison (to show that the
fallback works on hardware where the native path is fine); an outcome reached under it holds for
this process only and is never recorded.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import threading
import uuid
import warnings
from pathlib import Path

import torch

from . import env, reference, selftest_index_q
from .errors import AttnPrologueError
from .formats import FORMATS, ElementCode
from .jit import compiler
from .jit.trusted_fs import OWN, Tree, read_regular, write_at
from .launcher import Launcher
from .variants import Op, QOut, Variant

ENV_MODE = "ATTN_PROLOGUE_SELFTEST"
ENV_FAULT = "ATTN_PROLOGUE_SELFTEST_FAULT"
RECORD_NAME = "selftest.json"


class SelfTestWarning(RuntimeWarning):
    pass


def fallback_to_test(v: Variant) -> Variant | None:
    """The module to bind if v fails its self-test, or None when v is not tested: by default only
    variants with a distinct portable module are."""
    mode = env.get(ENV_MODE)
    if mode == "off":
        return None
    fallback = v.portable_fallback
    return v if fallback is None and mode == "always" else fallback


def environment_key(device_name: str, capability: tuple[int, int]) -> str:
    """What a recorded outcome is valid for: the GPU, this package's and the DSL's versions."""
    version = importlib.metadata.version("attn-prologue")
    return f"{device_name}|sm{capability[0]}{capability[1]}|{version}|{compiler.dsl_fingerprint()}"


class Records:
    """Outcomes on disk: {environment key: {variant: {"source": hash, "use": name, "ok", "detail"}}}.
    A record is trusted only if its `use` is the variant or its fallback and its source hash is the
    module's current one; anything else, a value of the wrong type included, is a miss (the test runs
    again), and storing replaces it."""

    MAX_BYTES = 4 << 20  # one small record per (device, variant): a larger file is not a record

    def __init__(self, cache_root: Path):
        self.path = Path(cache_root) / RECORD_NAME
        self._memo: dict[tuple[str, str], Variant] = {}
        self._lock = threading.Lock()

    def lookup(self, env_key: str, v: Variant, fallback: Variant) -> Variant | None:
        memo = self._memo.get((env_key, v.name))
        if memo is not None:
            return memo
        entry = _object(_object(self._read().get(env_key)).get(v.name))
        if entry.get("source") != compiler.source_hash(v.name) or not isinstance(entry.get("use"), str):
            return None
        use = {v.name: v, fallback.name: fallback}.get(entry["use"])
        if use is not None:
            self._memo[(env_key, v.name)] = use
        return use

    def store(self, env_key: str, v: Variant, use: Variant, ok: bool, detail: str) -> None:
        self._memo[(env_key, v.name)] = use
        if env.get(ENV_FAULT):  # a verdict on an injected fault says nothing about this machine
            return
        entry = {"source": compiler.source_hash(v.name), "use": use.name, "ok": ok, "detail": detail}
        with self._lock:
            record = self._read()
            record[env_key] = {**_object(record.get(env_key)), v.name: entry}
            try:
                self._write(record)
            except OSError as exc:  # a read-only cache: the outcome still holds for this process
                warnings.warn(f"self-test outcome not saved to {self.path}: {exc}", SelfTestWarning)

    def _read(self) -> dict:
        try:
            return _object(json.loads(read_regular(self.path, self.MAX_BYTES)))
        except (OSError, ValueError, RecursionError):
            return {}

    def _write(self, record: dict) -> None:
        """Through the cache root's checked descriptor; the root and its missing parents are made 0700
        whatever the umask (a parent made with the umask's 0775 would then be refused on every load)."""
        data = json.dumps(record, indent=1, sort_keys=True).encode()
        with Tree(self.path.parent, OWN).opened(create=True) as root:
            tmp = f".selftest-{uuid.uuid4().hex}.tmp"
            write_at(root, tmp, data)  # O_EXCL, 0600
            try:
                os.replace(tmp, self.path.name, src_dir_fd=root, dst_dir_fd=root)
            except BaseException:
                os.unlink(tmp, dir_fd=root)
                raise


def _object(value) -> dict:
    """value if it is a JSON object, else an empty one (a record of the wrong type is no record)."""
    return value if isinstance(value, dict) else {}


def warn_failed(v: Variant, fallback: Variant, env: str, detail: str) -> None:
    bar = "!" * 78
    warnings.warn(
        f"\n{bar}\nattn_prologue self-test FAILED for {v.name} on {env}: {detail}.\n"
        f"Falling back to {fallback.name} (portable conversions). Please report this.\n{bar}",
        SelfTestWarning,
        stacklevel=4,
    )


class SelfTestError(AttnPrologueError, RuntimeError):
    """A self-test could not run where it has to (e.g. the first use is inside a CUDA graph capture)."""


# The inputs' sizes: a few tokens, heads and pads, 4 pages of 16 tokens, a 64-position table.
ROWS, HEADS, PADDED, BLOCK, BLOCKS, MAX_POS = 32, 4, 8, 16, 4, 64


class Arena:
    """The device buffers a self-test runs on, allocated once per device (ScratchPool.reserve makes
    them before the pool is locked): running a self-test then allocates nothing on the GPU (inputs
    are made on the CPU and copied in, outputs copied out, the reference runs on the CPU)."""

    def __init__(self, device: torch.device):
        max_bytes = max(
            f.bytes_per_token(512 if f.head_dim is None else f.head_dim) for f in FORMATS.values()
        )
        self.q_in = torch.empty(ROWS * HEADS * 512 * 2, dtype=torch.uint8, device=device)
        self.kv = torch.empty(ROWS * 512 * 2, dtype=torch.uint8, device=device)
        self.q_out = torch.empty(ROWS * PADDED * 512 * 2, dtype=torch.uint8, device=device)
        self.k_cache = torch.empty(BLOCKS * BLOCK * max_bytes, dtype=torch.uint8, device=device)
        self.small = torch.empty(ROWS * 2 + MAX_POS * 64 + 512 + 2, dtype=torch.float32, device=device)
        self.ids = torch.empty(2 * ROWS, dtype=torch.int64, device=device)


def edge_rows(d: int) -> torch.Tensor:
    """Deterministic rows that sit on the conversions' edges, in the first 64 dims (NoPE dims in
    every format): zeros, denormals, values below the amax floor, an exact UE8M0 power-of-two
    boundary and just past it, every E2M1 tie (block amax 6, so the block scale is 1), +-Inf, NaN."""
    rows = torch.zeros(8, d)
    rows[1, :64] = torch.arange(1, 65) * 2.0**-133  # bf16/fp16 subnormals (flushed or kept: both pinned)
    rows[2, :64] = torch.linspace(-3e-5, 3e-5, 64)  # amax below the 1e-4 floor
    rows[3, :64] = 56.0 * torch.tensor([1.0, -0.5, 0.25, -0.125] * 16)  # amax / 448 = 2^-3 exactly
    rows[4, :64] = rows[3, :64]
    rows[4, 0] = 56.25  # the smallest bf16 past the boundary: the next exponent
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[5, :64] = torch.cat((ties, -ties)).repeat(4)
    rows[6, :64] = torch.linspace(-2, 2, 64)
    rows[6, 3], rows[6, 40] = float("inf"), float("-inf")
    rows[7, :64] = torch.linspace(-2, 2, 64)
    rows[7, 5] = float("nan")
    return rows


def run(launcher: Launcher, errors: torch.Tensor, arena: Arena) -> tuple[bool, str]:
    """Run the launcher's kernel on random rows and the edge rows, compare every output byte with
    the reference on the CPU. Allocates nothing on the GPU beyond `arena`."""
    v = launcher.variant
    if v.op is Op.INDEX_Q:
        return selftest_index_q.run(launcher, errors, arena, edge_rows)
    fmt = v.format
    g = torch.Generator().manual_seed(20261129)
    dt = v.io_dtype.torch_dtype
    n, h, p, d, r, bs = ROWS, HEADS, PADDED, v.head_dim, v.rope_dim, BLOCK
    edges = edge_rows(d)
    kv = torch.randn(n, d, generator=g)
    kv[1] *= 1e-3  # a small-amax block and a large one
    kv[2] *= 50
    kv[-len(edges) :] = edges
    q_in = torch.randn(n, h, d, generator=g)
    q_in[-len(edges) :, 0] = torch.nan_to_num(edges, nan=0.0, posinf=7.0, neginf=-7.0)  # Q rows stay finite
    theta = torch.rand(MAX_POS, r // 2, generator=g) * 6.28
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pos = torch.randint(0, MAX_POS, (n,), generator=g)
    slots = torch.randperm(BLOCKS * bs, generator=g)[:n].contiguous()
    slots[3] = -1
    page = bs * fmt.bytes_per_token(d)
    cache = torch.randint(0, 256, (BLOCKS, page), generator=g, dtype=torch.uint8)
    weight = (torch.rand(d, generator=g) + 0.5).to(dt) if v.op is Op.KV_NORM else None
    kv_scale = torch.tensor([0.02]) if fmt.needs_tensor_scale else None
    q_scale = torch.tensor([0.05]) if v.q_out is QOut.FP8 else None
    q8 = q_scale is not None
    q_out = (
        torch.full((n, p, d), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn)
        if q8
        else torch.full((n, p, d), 7.0).to(dt)
    )
    host = dict(q_in=q_in.to(dt), kv=kv.to(dt), cos_sin_cache=cs, positions=pos, slot_mapping=slots, k_cache=cache,
                q_out=q_out, norm_weight=weight, kv_scale=kv_scale, q_scale=q_scale)  # fmt: skip
    dev = _place(arena, host, v)
    values = dict(dev, errors=errors, eps=1e-6, block_size=bs, n_write_heads=p, checked=1)
    if q8:
        values["q_out"] = dev["q_out"].view(torch.uint8)
    launcher(**{k: values[k] for k in launcher.arguments if k in values})  # (max_ctas: the launcher's)
    got_cache, got_q = dev["k_cache"].cpu(), dev["q_out"].cpu()
    want = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in host.items()}
    if v.op is Op.QKV:
        reference.qnorm_rope_kv_insert(
            want["q_in"], want["kv"], want["q_out"], want["k_cache"], slots, pos, cs, 1e-6, bs, v.cache_format,
            kv_scale=kv_scale, q_scale=q_scale, q_layout=v.q_layout,
        )  # fmt: skip
    else:
        reference.kv_rope_insert(
            want["kv"], want["k_cache"], slots, pos, cs, bs, v.cache_format, norm_weight=weight, eps=1e-6,
            kv_scale=kv_scale,
        )  # fmt: skip
    if env.get(ENV_FAULT):
        got_cache.view(-1)[got_cache.numel() // 2] ^= 0x10  # injected fault
    got_cache = bf16_nans_canonical(got_cache, fmt, d, bs)
    bad_cache = int((got_cache != bf16_nans_canonical(want["k_cache"], fmt, d, bs)).sum())
    bad_q = int((got_q.view(torch.uint8) != want["q_out"].view(torch.uint8)).sum()) if v.op is Op.QKV else 0
    if bad_cache or bad_q:
        return False, f"{bad_cache} cache bytes and {bad_q} q_out bytes differ from the reference"
    return True, f"bit-exact against the reference ({n} rows, {len(edges)} of them edge cases)"


def bf16_nans_canonical(cache: torch.Tensor, fmt, head_dim: int, block_size: int) -> torch.Tensor:
    """A copy of the cache whose bf16-stored values (the bf16 format's records, a bf16 rope tail) hold
    one NaN pattern: the formats do not pin a NaN's payload, so only its being a NaN is compared."""
    data_bytes = fmt.data_bytes(head_dim)
    if fmt.element is ElementCode.BF16:
        start = 0
    elif fmt.rope_tail_bf16:
        start = data_bytes - 2 * fmt.dims(head_dim)[1]
    else:
        return cache
    out = cache.clone()
    # byte offsets (in each page) of the low byte of every bf16 value in the records
    token = torch.arange(block_size).unsqueeze(1) * data_bytes
    low = (token + torch.arange(start, data_bytes, 2)).flatten()
    for page in out:
        pairs = page[low].to(torch.int32) | (page[low + 1].to(torch.int32) << 8)
        nan = ((pairs & 0x7F80) == 0x7F80) & ((pairs & 0x7F) != 0)
        pairs = torch.where(nan, torch.full_like(pairs, 0x7FC0), pairs)
        page[low], page[low + 1] = (pairs & 0xFF).to(torch.uint8), (pairs >> 8).to(torch.uint8)
    return out


def _place(arena: Arena, host: dict, v: Variant) -> dict:
    """Copy the host inputs into views of the arena (no allocation) and return those views."""
    out = {}
    small = iter_views(arena.small)
    ids = iter_views(arena.ids)
    for name, t in host.items():
        if t is None:
            out[name] = None
            continue
        if name in ("q_in", "kv", "q_out", "k_cache"):
            raw = getattr(arena, name)
            view = raw[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        elif t.dtype == torch.int64:
            view = ids(t.numel()).view(t.shape)
        else:
            view = small(t.numel()).view(t.dtype).view(t.shape) if t.dtype == torch.float32 else None
            if view is None:  # the norm weight: io dtype, taken from the float32 area's bytes
                view = small((t.numel() + 1) // 2).view(t.dtype)[: t.numel()].view(t.shape)
        view.copy_(t)
        out[name] = view
    return out


def iter_views(buf: torch.Tensor):
    """Consecutive, 16-byte aligned slices of buf."""
    start = 0
    align = max(1, 16 // buf.element_size())

    def take(count: int) -> torch.Tensor:
        nonlocal start
        view = buf[start : start + count]
        start += (count + align - 1) // align * align
        return view

    return take
