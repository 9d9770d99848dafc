"""SM120, SM121 and SM100 dispatch on CPU, with the device's capability faked: a request resolves to
the module and compile target of that arch; a recorded first-use self-test outcome is honoured
(passed: the native module; failed: the portable one); and once a shape is bound, a KV-only call
does no per-device work on any arch (no device-facts read, no self-test lookup, no environment key),
so its per-call cost is SM90's. Real parts: the Runtime, the variant resolution, the self-test
records on disk, validation and the one-call function's fast path; only the compiled kernel (a
Python stand-in) and the CUDA device index (the tensors are CPU tensors) are not real."""

from __future__ import annotations

import time

import pytest
import torch
from attn_prologue import dispatch, ops, selftest
from attn_prologue.formats import get_format
from attn_prologue.variants import ArchFamily, Conversions, IoDtype, Op, Request, arch_for_capability


class StubCache:
    """Stands in for the kernel cache: records what is loaded, hands out a counting Python kernel."""

    def __init__(self, root):
        self.root = root
        self.keys = []
        self.calls = 0

    def load(self, key):
        self.keys.append(key)

        def kernel(*args):
            self.calls += 1

        return kernel


class CpuRuntime(dispatch.Runtime):
    def errors_buffer(self, device=None):  # the counters live on the CPU with the tensors
        return torch.zeros(2, dtype=torch.int32)


def facts_for(capability, name, sms):
    def facts(index):
        arch, target = arch_for_capability(*capability)
        return dispatch.DeviceFacts(index, name, capability, arch, target, sms, f"{name}|{capability}")

    return facts


DEVICES = {
    "H200 (9.0)": ((9, 0), "NVIDIA H200", 132),
    "RTX PRO 6000 (12.0)": ((12, 0), "NVIDIA RTX PRO 6000 Blackwell", 188),
    "GB10 (12.1)": ((12, 1), "NVIDIA GB10", 48),
    "B200 (10.0)": ((10, 0), "NVIDIA B200", 148),
}
FMT, D = "nvfp4_v41", 512


def inputs(n=4, bs=16):
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(64, 32, generator=g)
    return dict(
        kv=torch.randn(n, D, generator=g).to(torch.bfloat16),
        k_cache=torch.zeros(4, bs * get_format(FMT).bytes_per_token(D), dtype=torch.uint8),
        slot_mapping=torch.arange(n, dtype=torch.int64),
        positions=torch.arange(n, dtype=torch.int64),
        cos_sin_cache=torch.cat((theta.cos(), theta.sin()), 1).contiguous(),
    )


def runtime_for(device, tmp_path, record_ok=True):
    capability, name, sms = DEVICES[device]
    cache = StubCache(tmp_path)
    rt = CpuRuntime(
        cache=cache, tuning_db=tmp_path / "no-db.json", device_facts=facts_for(capability, name, sms)
    )
    facts = rt.device(0)
    v = Request(Op.KV, D, 64, FMT, IoDtype.BF16).variant(facts.arch)
    fallback = selftest.fallback_to_test(v)
    if fallback is not None:  # what a first use on that machine would have recorded
        rt.selftests.store(
            facts.selftest_key, v, v if record_ok else fallback, record_ok, "recorded by the test"
        )
    return rt, cache, v, fallback


def call(rt, a, n=None):
    ops.kv_rope_insert(a["kv"], a["k_cache"], a["slot_mapping"], a["positions"], a["cos_sin_cache"], 16, FMT,
                       runtime=rt)  # fmt: skip


@pytest.fixture(autouse=True)
def cpu_device_index(monkeypatch):
    monkeypatch.setattr(dispatch, "_index", lambda device: 0)


@pytest.mark.parametrize("device", list(DEVICES))
def test_each_arch_binds_its_module_and_target(device, tmp_path):
    rt, cache, v, fallback = runtime_for(device, tmp_path)
    call(rt, inputs())
    arch, target = arch_for_capability(*DEVICES[device][0])
    assert {k.target for k in cache.keys} == {target}
    assert {k.variant for k in cache.keys} == {v.name}
    assert v.arch is arch and (v.conversions is Conversions.NATIVE) == arch.has_native_block_conversions
    assert (fallback is not None) == (arch is not ArchFamily.SM90)  # sm90 runs the portable module itself
    assert cache.calls == 1


@pytest.mark.parametrize("device", ["RTX PRO 6000 (12.0)", "B200 (10.0)"])
def test_a_failed_self_test_record_binds_the_portable_module(device, tmp_path):
    rt, cache, v, fallback = runtime_for(device, tmp_path, record_ok=False)
    call(rt, inputs())
    assert {k.variant for k in cache.keys} == {fallback.name} and fallback.name.endswith("_portable")


def test_kv_calls_do_no_per_device_work_after_binding_and_cost_what_sm90_costs(tmp_path, monkeypatch):
    counts = {"facts": 0, "lookup": 0, "env": 0}
    real_env = selftest.environment_key

    def counted_env(*a, **k):
        counts["env"] += 1
        return real_env(*a, **k)

    monkeypatch.setattr(selftest, "environment_key", counted_env)
    per_call = {}
    for device in ("H200 (9.0)", "RTX PRO 6000 (12.0)", "GB10 (12.1)", "B200 (10.0)"):
        rt, cache, v, _ = runtime_for(device, tmp_path / device.split()[0])
        a = inputs()
        call(rt, a)  # binds
        real_facts, real_lookup = rt._read_facts, rt.selftests.lookup

        def facts(index, real_facts=real_facts):
            counts["facts"] += 1
            return real_facts(index)

        def lookup(*args, real_lookup=real_lookup):
            counts["lookup"] += 1
            return real_lookup(*args)

        rt._read_facts, rt.selftests.lookup = facts, lookup
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(300):
                call(rt, a)
            best = min(best, (time.perf_counter() - t0) / 300)
        per_call[device] = best
        assert cache.calls == 1 + 5 * 300  # every call reached the kernel
        assert counts == {"facts": 0, "lookup": 0, "env": 0}, device  # no per-call device work
    assert max(per_call.values()) < 2 * per_call["H200 (9.0)"], (
        per_call
    )  # the bound: within 2x of SM90
