"""`build` covers the variant space: every axis on every target, every variant built for every
target it claims (and refused for one it does not), the summary table counts every kernel."""

from __future__ import annotations

import collections
import re

import pytest
from attn_prologue import index_q
from attn_prologue.codegen import build
from attn_prologue.codegen.variants import variant_space
from attn_prologue.formats import FORMATS
from attn_prologue.jit import compiler
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import DEFAULT_BUILD_TARGETS, Op, QOut

from .support.build import ENTRIES, VARIANTS, meta_of, ptx_of


def test_build_covers_every_axis_on_every_target():
    by_target = collections.defaultdict(list)
    for v, k in ENTRIES:
        by_target[k.target].append(v)
    assert set(by_target) == set(DEFAULT_BUILD_TARGETS)
    for target, vs in by_target.items():
        assert {v.cache_format for v in vs} == set(FORMATS), target
        assert {(v.op, v.q_out) for v in vs} == {
            (Op.QKV, QOut.IO),
            (Op.QKV, QOut.FP8),
            (Op.KV, QOut.IO),
            (Op.KV_NORM, QOut.IO),
            (Op.INDEX_Q, QOut.IO),
        }
        assert {v.io_dtype for v in vs} == {v.io_dtype for v in variant_space()}
        assert {v.head_dim for v in vs} == {512, 128}
    assert {(v.arch.value, v.conversions.value) for v in VARIANTS} == {
        ("sm90", "portable"),
        ("sm100", "native"),
        ("sm100", "portable"),
        ("sm120", "native"),
        ("sm120", "portable"),
    }


def test_compile_entry_refuses_a_target_the_variant_name_does_not_claim(tmp_path):
    with pytest.raises(compiler.CompileError, match="is built for sm_90a, not sm_100a"):
        compiler.compile_entry("kv_d512r64_bf16_bf16_sm90", LaunchConfig(), "sm_100a", tmp_path / "entry")
    assert not (tmp_path / "entry").exists()  # refused before anything was compiled


@pytest.mark.slow
def test_build_reports_every_kernel(built):
    assert f"build: {len(VARIANTS)} variants" in built.output
    assert f"build: {len(ENTRIES)} kernels ready" in built.output
    table = built.output[built.output.index("target ") :]
    for target in DEFAULT_BUILD_TARGETS:
        assert re.search(rf"^{target}\s+{sum(k.target == target for _, k in ENTRIES)}\s", table, re.M), target


@pytest.mark.slow
def test_every_variant_is_built_for_every_target_it_claims(built):
    for v in VARIANTS:
        keys = [k for w, k in ENTRIES if w == v]
        default = v.arch.default_config.key
        tuned = build.tuned_configs()
        folds = {t: set() for t in DEFAULT_BUILD_TARGETS}
        # index_q: each config built folded to each preset's bits (defaults_only for the defaults')
        if v.op is Op.INDEX_Q:
            bits = build.folded_bits(v, index_q.PRESETS) | {v.default_numerics}
            for t in folds:
                configs = tuned.get((v.name, t), set()) | {v.arch.default_config}
                folds[t] = {c.folded_to(b, v.default_numerics) for c in configs for b in bits}
            default = v.arch.default_config.folded_to(v.default_numerics, v.default_numerics).key
        defaults = [k for k in keys if k.config.key == default]
        assert sorted(k.target for k in defaults) == sorted(
            t for t in v.arch.targets if t in DEFAULT_BUILD_TARGETS
        )
        for k in keys:
            meta = meta_of(built, k)
            assert (meta["variant"], meta["target"], meta["config"]) == (v.name, k.target, k.config.key)
            assert (
                k.config.key == default or k.config in tuned.get((v.name, k.target), set()) | folds[k.target]
            )
            assert meta["dsl_fingerprint"] == compiler.dsl_fingerprint()
            assert meta["source_hash"] == compiler.source_hash(v.name)
            assert re.search(rf"^\.target {k.target}$", ptx_of(built, k), re.M)
            so = built.cache.entry_dir(k) / "kernel.so"
            assert so.read_bytes()[:4] == b"\x7fELF"
            assert meta["resources"]["registers"] > 0  # the cubin's attributes were found
