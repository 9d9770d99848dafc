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
fallback works on hardware where the native path is fine).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from . import reference
from .jit import compiler
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
    mode = os.environ.get(ENV_MODE, "auto")
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
    module's current one; anything else is a miss (the test runs again)."""

    def __init__(self, cache_root: Path):
        self.path = Path(cache_root) / RECORD_NAME
        self._memo: dict[tuple[str, str], Variant] = {}
        self._lock = threading.Lock()

    def lookup(self, env: str, v: Variant, fallback: Variant) -> Variant | None:
        memo = self._memo.get((env, v.name))
        if memo is not None:
            return memo
        entry = self._read().get(env, {}).get(v.name)
        if not isinstance(entry, dict) or entry.get("source") != compiler.source_hash(v.name):
            return None
        use = {v.name: v, fallback.name: fallback}.get(entry.get("use"))
        if use is not None:
            self._memo[(env, v.name)] = use
        return use

    def store(self, env: str, v: Variant, use: Variant, ok: bool, detail: str) -> None:
        self._memo[(env, v.name)] = use
        entry = {"source": compiler.source_hash(v.name), "use": use.name, "ok": ok, "detail": detail}
        with self._lock:
            record = self._read()
            record.setdefault(env, {})[v.name] = entry
            try:
                self._write(record)
            except OSError as exc:  # a read-only cache: the outcome still holds for this process
                warnings.warn(f"self-test outcome not saved to {self.path}: {exc}", SelfTestWarning)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=".selftest-", suffix=".tmp", dir=self.path.parent
        )  # O_EXCL, mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def warn_failed(v: Variant, fallback: Variant, env: str, detail: str) -> None:
    bar = "!" * 78
    warnings.warn(
        f"\n{bar}\nattn_prologue self-test FAILED for {v.name} on {env}: {detail}.\n"
        f"Falling back to {fallback.name} (portable conversions). Please report this.\n{bar}",
        SelfTestWarning,
        stacklevel=4,
    )


def run(launcher: Launcher, errors: torch.Tensor) -> tuple[bool, str]:
    """Run the launcher's kernel on a few random tokens and compare bytes with the reference."""
    v = launcher.variant
    device = torch.device("cuda", launcher.device_index)
    fmt = v.format
    g = torch.Generator(device=device).manual_seed(20261129)
    dt = v.io_dtype.torch_dtype
    n, h, p, d, bs = 9, 4, 8, v.head_dim, 16
    q_in = torch.randn(n, h, d, generator=g, device=device).to(dt)
    kv = torch.randn(n, d, generator=g, device=device).to(dt)
    kv[1] *= 1e-3  # a small-amax block and a large one
    kv[2] *= 50
    theta = torch.rand(64, v.rope_dim // 2, generator=g, device=device) * 6.28
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pos = torch.randint(0, 64, (n,), generator=g, device=device)
    slots = torch.randperm(4 * bs, generator=g, device=device)[:n].contiguous()
    slots[3] = -1
    cache = torch.randint(
        0, 256, (4, bs * fmt.bytes_per_token(d)), generator=g, device=device, dtype=torch.uint8
    )
    kv_scale = torch.tensor([0.02], device=device) if fmt.needs_tensor_scale else None
    q_scale = torch.tensor([0.05], device=device) if v.q_out is QOut.FP8 else None
    weight = (torch.rand(d, generator=g, device=device) + 0.5).to(dt) if v.op is Op.KV_NORM else None
    out_dtype = torch.uint8 if q_scale is not None else dt
    q_out = torch.full((n, p, d), 0x55 if q_scale is not None else 7, dtype=out_dtype, device=device)
    got_cache, got_q = cache.clone(), q_out.clone()
    want_cache, want_q = cache.clone(), q_out.clone()
    values = dict(
        q_in=q_in, kv=kv, q_out=got_q, norm_weight=weight, k_cache=got_cache, slot_mapping=slots, positions=pos,
        cos_sin_cache=cs, kv_scale=kv_scale, q_scale=q_scale, errors=errors, eps=1e-6, block_size=bs,
        n_write_heads=p, checked=0,
    )  # fmt: skip
    launcher(**{k: values[k] for k in launcher.arguments if k in values})
    if v.op is Op.QKV:
        wq = want_q.view(torch.float8_e4m3fn) if q_scale is not None else want_q
        reference.qnorm_rope_kv_insert(
            q_in,
            kv,
            wq,
            want_cache,
            slots,
            pos,
            cs,
            1e-6,
            bs,
            v.cache_format,
            kv_scale=kv_scale,
            q_scale=q_scale,
        )
    else:
        reference.kv_rope_insert(
            kv,
            want_cache,
            slots,
            pos,
            cs,
            bs,
            v.cache_format,
            norm_weight=weight,
            eps=1e-6,
            kv_scale=kv_scale,
        )
    torch.cuda.synchronize(device)
    if os.environ.get(ENV_FAULT):
        got_cache.view(-1)[got_cache.numel() // 2] ^= 0x10  # injected fault
    bad_cache = int((got_cache != want_cache).sum())
    bad_q = int((got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum()) if v.op is Op.QKV else 0
    if bad_cache or bad_q:
        return False, f"{bad_cache} cache bytes and {bad_q} q_out bytes differ from the reference"
    return True, "bit-exact against the reference"
