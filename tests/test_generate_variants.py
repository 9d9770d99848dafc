"""CPU tests of the variant space and its names: every codegen parameter is part of a variant's
name and of its kernel cache key, names are unique and parse back, the supported space has exactly
the expected axes, and every combination left out says why. Nothing here compiles a kernel."""

from __future__ import annotations

import collections
import dataclasses
import enum
import typing
from pathlib import Path

import pytest
from attn_prologue import launch, variants
from attn_prologue.codegen import generate
from attn_prologue.codegen.variants import dropped_combinations, variant_space
from attn_prologue.formats import FORMATS
from attn_prologue.generated import registry
from attn_prologue.jit import compiler, kernel_cache
from attn_prologue.variants import (
    ArchFamily,
    Conversions,
    IoDtype,
    Op,
    QLayout,
    QOut,
    Variant,
    generated,
    parse_name,
    unsupported_reason,
)

from .support.sample_variants import BASES

GENERATED = generate.default_out_dir()


# ---- naming: every codegen parameter is part of the name ----------------------------------------
def _field_values(name: str, tp) -> list:
    """Every value a Variant field can take (Enums: all members; formats: all; dims: a few)."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return list(tp)
    if name == "cache_format":
        return sorted(FORMATS)
    if name == "head_dim":
        return sorted({d for d, _ in variants.HEAD_DIMS} | {256, 1024})
    if name == "rope_dim":
        return sorted({r for _, r in variants.HEAD_DIMS} | {32, 128})
    raise AssertionError(f"Variant field {name!r} ({tp}) has no perturbation rule: add one to this test")


def _perturbations(base: Variant) -> dict[tuple[str, object], Variant]:
    hints = typing.get_type_hints(Variant)
    out = {}
    for f in dataclasses.fields(Variant):
        values = [x for x in _field_values(f.name, hints[f.name]) if x != getattr(base, f.name)]
        assert values, f.name
        for x in values:
            out[(f.name, x)] = dataclasses.replace(base, **{f.name: x})
    return out


@pytest.mark.parametrize("base", BASES, ids=lambda v: v.name)
def test_name_changes_with_every_codegen_parameter(base):
    assert unsupported_reason(base) is None
    perturbed = _perturbations(base)
    assert {k for k, _ in perturbed} == {f.name for f in dataclasses.fields(Variant)}
    if base.arch.has_native_block_conversions:
        # every perturbation, supported or not, has its own name
        names = [base.name] + [v.name for v in perturbed.values()]
        assert len(set(names)) == len(names), collections.Counter(names).most_common(3)
    supported = [base] + [v for v in perturbed.values() if unsupported_reason(v) is None]
    names = [v.name for v in supported]
    assert len(set(names)) == len(names)
    # every name parses back; only generated variants (not the unsupported ones, nor a head dim the
    # template takes but HEAD_DIMS does not generate) are in the registry
    space = set(variant_space())
    assert sum(v in space for v in supported) >= 8  # the test is not vacuous
    for v in perturbed.values():
        assert (v.name in generated()) == (v in space or v.name in {g.name for g in space})
        if not v.arch.has_native_block_conversions and v.conversions is Conversions.NATIVE:
            # the one alias: an SM90 "native" module does not exist, its name is the portable one's
            assert parse_name(v.name) == dataclasses.replace(v, conversions=Conversions.PORTABLE)
        else:
            assert parse_name(v.name) == v
    assert parse_name(base.name) == base


def test_names_are_unique_over_the_supported_space():
    space = variant_space()
    assert len({v.name for v in space}) == len(space)
    by_name = collections.defaultdict(list)
    for v in variants.all_combinations():
        by_name[v.name].append(v)
    for name, vs in by_name.items():
        supported = [v for v in vs if unsupported_reason(v) is None]
        assert len(supported) <= 1, name
        if len(vs) > 1:  # the one alias: an SM90 module is the portable one, "native" does not exist there
            assert {v.conversions for v in vs} == set(Conversions) and not vs[
                0
            ].arch.has_native_block_conversions
    for v in space[::7]:
        assert parse_name(v.name) == v


@pytest.fixture
def fresh_fingerprints():
    """source_hash and dsl_fingerprint are memoized: clear them around a test that fakes their inputs."""
    compiler.source_hash.cache_clear()
    compiler.dsl_fingerprint.cache_clear()
    yield
    compiler.source_hash.cache_clear()
    compiler.dsl_fingerprint.cache_clear()


def _relpath(variant: str, config: launch.LaunchConfig, target: str) -> Path:
    return kernel_cache.KernelKey(variant, config, target).relpath()


def test_cache_key_changes_with_variant_config_and_target():
    base = BASES[0]
    cfg = launch.LaunchConfig()
    key = _relpath(base.name, cfg, "sm_120f")
    assert key == _relpath(base.name, cfg, "sm_120f")  # stable
    # the variant
    others = [v for v in _perturbations(base).values() if unsupported_reason(v) is None]
    paths = {_relpath(v.name, cfg, v.arch.targets[0]) for v in others} | {key}
    assert len(paths) == len(others) + 1
    # every LaunchConfig field
    configs = launch.all_configs()
    configs.append(launch.LaunchConfig(slots32=True))  # the caller's slot width (not swept by the tuner)
    configs.append(launch.LaunchConfig(folded_numerics=5))  # a build's folded parity choices (not swept)
    configs.append(launch.LaunchConfig(positions32=True))  # index_q's caller's positions width (not swept)
    assert len(set(configs)) == len(configs)
    assert all(launch.LaunchConfig.from_key(c.key) == c for c in configs)
    assert len({c.key for c in configs}) == len(configs)
    for f in dataclasses.fields(launch.LaunchConfig):
        changed = [
            c
            for c in configs
            if [x.name for x in dataclasses.fields(c) if getattr(c, x.name) != getattr(cfg, x.name)]
            == [f.name]
        ]
        assert changed, f"no supported config differs from the default in {f.name} only"
        for c in changed:
            assert _relpath(base.name, c, "sm_120f") != key, f.name
    assert len({_relpath(base.name, c, "sm_120f") for c in configs}) == len(configs)
    # the target
    assert _relpath(base.name, cfg, "sm_100a") != key


def test_cache_key_changes_with_the_source(tmp_path, monkeypatch, fresh_fingerprints):
    name = BASES[0].name
    cfg = launch.LaunchConfig()
    module = tmp_path / f"{name}.py"
    lib, base = tmp_path / "kernel_lib.py", tmp_path / "kernel_base.py"
    module.write_bytes(compiler.module_path(name).read_bytes())
    lib.write_bytes(compiler.kernel_lib_path().read_bytes())
    base.write_bytes(compiler.kernel_base_path().read_bytes())
    real = _relpath(name, cfg, "sm_120f")
    monkeypatch.setattr(compiler, "module_path", lambda v: module)
    monkeypatch.setattr(compiler, "kernel_lib_path", lambda: lib)
    monkeypatch.setattr(compiler, "kernel_base_path", lambda: base)
    compiler.source_hash.cache_clear()
    assert _relpath(name, cfg, "sm_120f") == real  # same bytes, same key

    module.write_text(module.read_text() + "# an edit of the generated module\n")
    compiler.source_hash.cache_clear()
    edited_module = _relpath(name, cfg, "sm_120f")
    assert edited_module != real

    lib.write_text(lib.read_text() + "# an edit of the shared helpers\n")
    compiler.source_hash.cache_clear()
    edited_lib = _relpath(name, cfg, "sm_120f")
    assert edited_lib not in (real, edited_module)

    base.write_text(base.read_text() + "# an edit of the methods every Kernel inherits\n")
    compiler.source_hash.cache_clear()
    assert _relpath(name, cfg, "sm_120f") not in (real, edited_module, edited_lib)


def test_cache_key_changes_with_the_dsl_version(monkeypatch, fresh_fingerprints):
    name = BASES[0].name
    cfg = launch.LaunchConfig()
    real = _relpath(name, cfg, "sm_120f")
    versions = {p: compiler.dsl_versions()[p] for p in compiler.DSL_PACKAGES}
    assert all(versions.values()), versions
    real_version = compiler.importlib.metadata.version
    for pkg in compiler.DSL_PACKAGES:
        monkeypatch.setattr(
            compiler.importlib.metadata,
            "version",
            lambda p, pkg=pkg: "0.0.0.dev0" if p == pkg else real_version(p),
        )
        compiler.dsl_fingerprint.cache_clear()
        assert _relpath(name, cfg, "sm_120f") != real, pkg
    monkeypatch.setattr(compiler.importlib.metadata, "version", real_version)
    compiler.dsl_fingerprint.cache_clear()
    assert _relpath(name, cfg, "sm_120f") == real


# ---- the variant space -------------------------------------------------------------------------
def test_every_dropped_combination_is_explained():
    combos = list(variants.all_combinations())
    dropped = dropped_combinations()
    space = variant_space()
    assert len(dropped) + len(space) == len(combos)
    assert {v for v, _ in dropped}.isdisjoint(space)
    for v, why in dropped:
        assert isinstance(why, str) and why.strip(), v
        assert why == unsupported_reason(v)


@pytest.mark.parametrize(
    "variant, words",
    [
        (
            Variant(Op.KV, QOut.IO, 320, 64, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["head_dim=320"],
        ),
        (
            Variant(Op.KV, QOut.IO, 512, 60, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["rope_dim=60"],
        ),
        (
            Variant(
                Op.KV, QOut.IO, 128, 64, "fp8_ds_mla", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE
            ),
            ["fp8_ds_mla", "D=128"],
        ),
        (
            Variant(Op.KV, QOut.FP8, 128, 64, "bf16", IoDtype.BF16, ArchFamily.SM90, Conversions.PORTABLE),
            ["kv", "FP8"],
        ),
        (
            Variant(Op.KV, QOut.IO, 128, 64, "mxfp4", IoDtype.BF16, ArchFamily.SM90, Conversions.NATIVE),
            ["sm90", "native"],
        ),
        (
            Variant(Op.KV, QOut.IO, 128, 64, "bf16", IoDtype.BF16, ArchFamily.SM120, Conversions.PORTABLE),
            ["bf16", "portable"],
        ),
    ],
)
def test_unsupported_reason_names_the_cause(variant, words):
    why = unsupported_reason(variant)
    assert why, variant
    for w in words:
        assert w in why, (w, why)


ARCH_CONVERSION_FORMATS = {
    "fp8_ds_mla",
    "mxfp8",
    "fp8_token",
    "mxfp4",
    "nvfp4_v41",
    "nvfp4_dsv4",
}  # UE8M0, 2^e or E2M1


def test_supported_space_has_exactly_the_expected_axes():
    space = variant_space()
    per_family = collections.Counter((v.arch.value, v.conversions.value) for v in space)
    assert per_family == {
        ("sm90", "portable"): 80,
        ("sm100", "native"): 80,
        ("sm100", "portable"): 46,
        ("sm120", "native"): 80,
        ("sm120", "portable"): 46,
    }
    assert len(space) == 332

    def shape(v):
        return (v.op, v.q_out, v.head_dim, v.rope_dim, v.cache_format, v.io_dtype, v.q_layout)

    primary = {
        (a, c): {shape(v) for v in space if (v.arch, v.conversions) == (a, c)}
        for a, c in [
            (ArchFamily.SM90, Conversions.PORTABLE),
            (ArchFamily.SM100, Conversions.NATIVE),
            (ArchFamily.SM120, Conversions.NATIVE),
        ]
    }
    first = next(iter(primary.values()))
    assert all(s == first for s in primary.values())  # every arch family offers the same 80 ops
    assert {(o, q) for o, q, *_ in first} == {
        (Op.QKV, QOut.IO),
        (Op.QKV, QOut.FP8),
        (Op.KV, QOut.IO),
        (Op.KV_NORM, QOut.IO),
        (Op.INDEX_Q, QOut.IO),
    }
    # the indexer's Q: D = 128, R = 64, its two quantized formats, both I/O dtypes; only MXFP4 has a
    # portable twin (its FP8 scale comes from the float32 bits on every target)
    index_q = {s for s in first if s[0] is Op.INDEX_Q}
    assert index_q == {
        (Op.INDEX_Q, QOut.IO, 128, 64, f, io, QLayout.HEAD_MAJOR)
        for f in ("fp8_token", "mxfp4")
        for io in IoDtype
    }
    first = first - index_q
    # per (format, D): the ops; NVFP4 records take no kv_norm, and the V4.1 compressed record no qkv
    full = {(Op.QKV, QOut.IO), (Op.QKV, QOut.FP8), (Op.KV, QOut.IO), (Op.KV_NORM, QOut.IO)}
    ops_of = collections.defaultdict(set)
    for o, q, d, r, f, _, layout in first:
        if layout is QLayout.HEAD_MAJOR:
            ops_of[(f, d, r)].add((o, q))
    assert ops_of == {
        ("fp8_ds_mla", 512, 64): full,
        ("mxfp8", 512, 64): full,
        ("fp8_token", 128, 64): full,
        ("mxfp4", 128, 64): full,
        ("bf16", 512, 64): full,
        ("bf16", 128, 64): full,
        ("fp8_tensor", 512, 64): full,
        ("fp8_tensor", 128, 64): full,
        ("nvfp4_dsv4", 512, 64): full - {(Op.KV_NORM, QOut.IO)},
        ("nvfp4_v41", 512, 64): {(Op.KV, QOut.IO)},
    }
    # the interleaved Q layout: qkv (both Q dtypes) for the caches FlashMLA reads on SM100, bf16 I/O
    assert {(o, q, f, io) for o, q, _, _, f, io, layout in first if layout is QLayout.INTERLEAVED} == {
        (Op.QKV, q, f, IoDtype.BF16) for q in QOut for f in ("fp8_ds_mla", "mxfp8")
    }
    assert {s[5] for s in first} == set(IoDtype)
    assert len(first) == (4 * 8 + 3 + 1) * 2 + 4
    for arch in (ArchFamily.SM100, ArchFamily.SM120):
        portable = {shape(v) for v in space if v.arch is arch and v.conversions is Conversions.PORTABLE}
        assert portable == {s for s in first if s[4] in ARCH_CONVERSION_FORMATS} | {
            s for s in index_q if s[4] == "mxfp4"
        }
    assert {v.cache_format for v in space if v.uses_arch_conversions} == ARCH_CONVERSION_FORMATS
    assert {v.cache_format for v in space} == set(FORMATS)


@pytest.mark.parametrize(
    "name, why",
    [
        ("kv_norm_d512r64_nvfp4_dsv4_bf16_sm120", "kv_norm is the indexer path"),
        ("qkv_d512r64_nvfp4_v41_bf16_sm90", "written by the kv-only writer"),
        ("qkv_q8_d512r64_nvfp4_v41_bf16_sm100", "written by the kv-only writer"),
    ],
)
def test_nvfp4_ops_that_are_not_generated_say_why(name, why):
    v = parse_name(name)
    assert why in unsupported_reason(v)
    assert name not in generated()


def test_manifest_registry_and_modules_agree():
    text = (GENERATED / "MANIFEST").read_text()
    assert text.endswith("\n") and not text.endswith("\n\n")
    names = text.splitlines()
    assert all(n and n == n.strip() and " " not in n for n in names)
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert names == [v.name for v in variant_space()]
    assert list(registry.VARIANTS) == names
    modules = sorted(p.stem for p in (GENERATED / "kernels").glob("*.py") if p.name != "__init__.py")
    assert modules == names
    for name in registry.VARIANTS:
        v = parse_name(name)
        assert v.name == name and unsupported_reason(v) is None
    assert generated() == frozenset(names)
