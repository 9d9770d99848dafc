"""First-use self-test of code paths that have not run on this machine before.

The native-conversion modules (SM100/SM120: cvt ue8m0x2 / e2m1x2) are verified here only by
compiling and reading their PTX; the first time one is bound on a real GPU, it runs on a few random
tokens against the reference. A mismatch warns loudly and binds the portable-conversion module of
the same variant instead. The outcome is remembered per device, package and DSL version (a JSON
file beside the kernel cache), so the test runs once per machine, not once per process.

ATTN_PROLOGUE_SELFTEST=always tests every variant (portable ones too); =off disables it.
ATTN_PROLOGUE_SELFTEST_FAULT=1 corrupts one output byte before the comparison (to show the
fallback works on hardware where the native path is fine).
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import torch

ENV_MODE = "ATTN_PROLOGUE_SELFTEST"
ENV_FAULT = "ATTN_PROLOGUE_SELFTEST_FAULT"
_lock = threading.Lock()
_memo: dict[tuple, str] = {}


class SelfTestWarning(RuntimeWarning):
    pass


def record_path() -> Path:
    from .kernel_cache import default_cache_dir

    return default_cache_dir().parent / "selftest.json"


def _environment_key(device: torch.device) -> str:
    import importlib.metadata

    from . import compiler

    props = torch.cuda.get_device_properties(device)
    return f"{props.name}|sm{props.major}{props.minor}|{importlib.metadata.version('attn-prologue')}|{compiler.dsl_fingerprint()}"


def _load_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(path)


def resolve(device: torch.device, name: str, config, target: str) -> str:
    """The variant to bind: `name`, or its portable fallback if `name` failed its self-test."""
    from . import dispatch

    mode = os.environ.get(ENV_MODE, "auto")
    info = dispatch.variant_info(name)
    if mode == "off" or (info.conversions != "native" and mode != "always"):
        return name
    env = _environment_key(device)
    memo_key = (env, name)
    if memo_key in _memo:
        return _memo[memo_key]
    with _lock:
        path = record_path()
        record = _load_record(path)
        entry = record.get(env, {}).get(name)
        if entry is None:
            ok, detail = run(device, name, config, target)
            chosen = name
            if not ok:
                fallback = dispatch.select_variant(
                    arch=info.arch,
                    op=info.op,
                    head_dim=info.head_dim,
                    rope_dim=info.rope_dim,
                    cache_format=info.cache_format,
                    io_dtype=info.io_dtype,
                    q_out=info.q_out,
                    conversions="portable",
                )
                warnings.warn(
                    f"\n{'!' * 78}\nattn_prologue self-test FAILED for {name} on {env}: {detail}.\n"
                    f"Falling back to {fallback} (portable conversions). Please report this.\n{'!' * 78}",
                    SelfTestWarning,
                    stacklevel=3,
                )
                chosen = fallback
            entry = {"ok": ok, "use": chosen, "detail": detail}
            record.setdefault(env, {})[name] = entry
            _save_record(path, record)
        _memo[memo_key] = entry["use"]
        return entry["use"]


def run(device: torch.device, name: str, config, target: str) -> tuple[bool, str]:
    """Run `name` on a few random tokens and compare bytes with the reference."""
    from . import dispatch, ops, reference
    from .formats import get_format

    info = dispatch.variant_info(name)
    fmt = get_format(info.cache_format)
    g = torch.Generator(device=device).manual_seed(20261129)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[info.io_dtype]
    n, h, p, d, bs = 9, 4, 8, info.head_dim, 16
    q_in = torch.randn(n, h, d, generator=g, device=device).to(dt)
    kv = torch.randn(n, d, generator=g, device=device).to(dt)
    kv[1] *= 1e-3  # a small-amax block and a large one
    kv[2] *= 50
    theta = torch.rand(64, info.rope_dim // 2, generator=g, device=device) * 6.28
    cs = torch.cat((theta.cos(), theta.sin()), 1).contiguous()
    pos = torch.randint(0, 64, (n,), generator=g, device=device)
    slots = torch.randperm(4 * bs, generator=g, device=device)[:n].contiguous()
    slots[3] = -1
    cache = torch.randint(
        0, 256, (4, bs * fmt.bytes_per_token(d)), generator=g, device=device, dtype=torch.uint8
    )
    kv_scale = torch.tensor([0.02], device=device) if fmt.needs_tensor_scale else None
    q_scale = torch.tensor([0.05], device=device) if info.q_out == "fp8" else None
    weight = (torch.rand(d, generator=g, device=device) + 0.5).to(dt) if info.op == "kv_norm" else None
    out_dtype = torch.uint8 if q_scale is not None else dt
    q_out = torch.full((n, p, d), 0x55 if q_scale is not None else 7, dtype=out_dtype, device=device)
    k = ops.Kernel(name, config, target)
    got_cache, got_q = cache.clone(), q_out.clone()
    want_cache, want_q = cache.clone(), q_out.clone()
    args = dict(
        q_in=q_in,
        kv=kv,
        q_out=got_q,
        norm_weight=weight,
        k_cache=got_cache,
        slot_mapping=slots,
        positions=pos,
        cos_sin_cache=cs,
        kv_scale=kv_scale,
        q_scale=q_scale,
        errors=ops.errors_buffer(device),
        eps=1e-6,
        block_size=bs,
        n_write_heads=p,
        checked=0,
    )
    k(**args)
    if info.op == "qkv":
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
            info.cache_format,
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
            info.cache_format,
            norm_weight=weight,
            eps=1e-6,
            kv_scale=kv_scale,
        )
    torch.cuda.synchronize(device)
    if os.environ.get(ENV_FAULT):
        got_cache.view(-1)[got_cache.numel() // 2] ^= 0x10  # injected fault
    bad_cache = int((got_cache != want_cache).sum())
    bad_q = int((got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum()) if info.op == "qkv" else 0
    if bad_cache or bad_q:
        return False, f"{bad_cache} cache bytes and {bad_q} q_out bytes differ from the reference"
    return True, "bit-exact against the reference"
