"""Dispatcher selection and errors, the scratch pool's accounting, locking and views, the tuning
database (round trip, merge, mismatch and corruption), and the config heuristic, on CPU."""

import dataclasses
import json
import os
import subprocess
import sys

import attn_prologue as ap
import pytest
from attn_prologue import dispatch, tuning, variants
from attn_prologue.errors import ScratchError, UnsupportedError
from attn_prologue.formats import UnknownFormatError
from attn_prologue.generated import registry
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import (
    ArchFamily,
    Conversions,
    IoDtype,
    Op,
    Request,
    Variant,
    arch_for_capability,
    find,
    generated,
    parse_name,
    unsupported_reason,
)


# ---- dispatch ----------------------------------------------------------------------------------
def test_capabilities_map_to_families_and_targets():
    assert arch_for_capability(9, 0) == (ArchFamily.SM90, "sm_90a")
    assert arch_for_capability(10, 0) == (ArchFamily.SM100, "sm_100a")
    assert arch_for_capability(12, 0) == (ArchFamily.SM120, "sm_120a")
    assert arch_for_capability(12, 1) == (ArchFamily.SM120, "sm_121a")
    assert arch_for_capability(10, 3) == (ArchFamily.SM100, "sm_103a")  # B300
    assert arch_for_capability(11, 0) == (ArchFamily.SM100, "sm_110a")  # Thor
    for unknown in ((8, 0), (12, 2), (10, 1)):
        with pytest.raises(UnsupportedError, match=f"{unknown[0]}.{unknown[1]}.*supported"):
            arch_for_capability(*unknown)
    with pytest.raises(UnsupportedError, match="did you mean sm_90a"):
        variants.check_targets(["sm_90"])
    assert {t for f in ArchFamily for t in f.targets} == set(variants.TARGETS)


def request_of(v: Variant, conversions=None) -> Request:
    return Request(v.op, v.head_dim, v.rope_dim, v.cache_format, v.io_dtype, v.q_out, conversions, v.q_layout)


def test_every_generated_variant_is_found_by_its_request():
    names = sorted(generated())
    assert len(names) == len(registry.VARIANTS) > 100
    for name in names:
        v = parse_name(name)
        assert find(request_of(v, v.conversions), v.arch) == v
        if v.conversions is v.arch.default_conversions:
            assert find(request_of(v), v.arch) == v  # the default needs no choice


def test_portable_request_for_a_format_without_arch_conversions_uses_the_single_module():
    req = Request(Op.KV, 512, 64, "bf16", IoDtype.BF16, conversions=Conversions.PORTABLE)
    assert find(req, ArchFamily.SM120).name == "kv_d512r64_bf16_bf16_sm120"


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(head_dim=96), "head_dim=96: the lane mapping needs D == 128 or D % 256 == 0"),
        (dict(cache_format="mxfp4"), "mxfp4 stores D=128/R=64 records, not D=512/R=64"),
        (dict(rope_dim=32), "fp8_ds_mla stores D=512/R=64 records, not D=512/R=32"),
        (dict(head_dim=256, cache_format="bf16"), "it is supported but was not generated"),
    ],
)
def test_a_miss_says_what_list_why_says_and_names_the_nearest(change, reason):
    req = dataclasses.replace(Request(Op.QKV, 512, 64, "fp8_ds_mla", IoDtype.BF16), **change)
    with pytest.raises(UnsupportedError) as info:
        find(req, ArchFamily.SM120)
    msg = str(info.value)
    assert reason in msg and "nearest generated: " in msg
    why = unsupported_reason(req.variant(ArchFamily.SM120))
    assert why is None or why in msg  # the same sentence `list --why` prints
    nearest = msg.split("nearest generated: ")[1].split(", ")
    assert len(nearest) == 3 and all(n in generated() for n in nearest)


def test_native_conversions_are_not_offered_on_sm90():
    req = Request(Op.QKV, 512, 64, "fp8_ds_mla", IoDtype.BF16, conversions=Conversions.NATIVE)
    with pytest.raises(UnsupportedError, match="sm90 has no native ue8m0x2/e2m1x2 conversions"):
        find(req, ArchFamily.SM90)


def test_unknown_format_is_a_typed_error_naming_the_known_ones():
    with pytest.raises(UnknownFormatError, match="known formats: bf16, fp8_ds_mla"):
        find(Request(Op.KV, 512, 64, "fp9", IoDtype.BF16), ArchFamily.SM90)


def test_default_configs_and_their_arithmetic():
    from attn_prologue.codegen.archs import ARCH_SPECS, resident_warps

    for family in ArchFamily:
        assert ARCH_SPECS[family.value].default_config == family.default_config
        assert family.default_config.warps_per_cta == 4  # see codegen/archs.py for why, SM120 included
    # registers are allocated per warp in multiples of 8 per thread, CTAs whole: 41-48 registers give
    # 40 resident warps with 4-warp CTAs (10 CTAs of 6,144 registers), 40 registers give 48
    assert {resident_warps(r, 4, 64, 32) for r in range(41, 49)} == {40}
    assert resident_warps(40, 4, 64, 32) == 48 and resident_warps(44, 2, 48, 24) == 42
    assert resident_warps(32, 1, 48, 24) == 24  # CTA-limited
    h200 = ARCH_SPECS["sm90"].parts[1]
    assert round(h200.bytes_per_clock_per_sm, 1) == 18.4 and 12 < h200.warps_needed < 13
    text = ARCH_SPECS["sm120"].reasoning()
    assert "GB10" in text and "40-40 warps per SM" in text and "4-warp" in text


def test_launch_config_keys_round_trip():
    from attn_prologue.launch import all_configs

    for c in all_configs():
        assert LaunchConfig.from_key(c.key) == c
    with pytest.raises(ValueError):
        LaunchConfig(warps_per_cta=3)
    with pytest.raises(ValueError):
        LaunchConfig.from_key("w4")


# ---- scratch pool --------------------------------------------------------------------------------
def test_pool_accounting_views_lock_and_does_not_fit():
    pool = ap.ScratchPool()
    added = pool.reserve(max_tokens=16, padded_heads=8, head_dim=128, micro_batches=2, device="cpu")
    assert added == pool.reserved_bytes == 2 * 16 * 8 * 128 * 2
    assert (
        pool.reserve(max_tokens=8, padded_heads=8, head_dim=128, micro_batches=2, device="cpu") == 0
    )  # fits
    buf0 = pool.buffer(padded_heads=8, head_dim=128, micro_batch=0, device="cpu")
    buf1 = pool.buffer(padded_heads=8, head_dim=128, micro_batch=1, device="cpu")
    assert buf0.data_ptr() != buf1.data_ptr() and not buf0.any() and not buf1.any()  # zeroed once
    pool.lock()
    v = pool.view(5, padded_heads=8, head_dim=128, micro_batch=1, device="cpu")
    assert v.shape == (5, 8, 128) and v.data_ptr() == buf1.data_ptr()
    assert (
        pool.view(5, padded_heads=8, head_dim=128, micro_batch=1, device="cpu") is v
    )  # cached, no new tensor
    with pytest.raises(ScratchError, match="do not fit the locked scratch pool"):
        pool.view(17, padded_heads=8, head_dim=128, device="cpu")
    with pytest.raises(ScratchError, match="locked"):
        pool.reserve(max_tokens=32, padded_heads=8, head_dim=128, device="cpu")
    with pytest.raises(ScratchError, match="no scratch reserved"):
        pool.buffer(padded_heads=16, head_dim=128, device="cpu")
    assert pool.reserved_bytes == added


class Claimant:
    """Stands in for a bound op (which needs a GPU): records what the pool tells it."""

    def __init__(self):
        self.reasons = []

    def invalidate(self, reason):
        self.reasons.append(reason)


def test_pool_grows_before_lock_keeps_zero_once_ownership_and_retires_old_buffers():
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, padded_heads=8, head_dim=128, micro_batches=1, device="cpu")
    op = Claimant()
    t = pool.claim(2, owner=op, padded_heads=8, head_dim=128, device="cpu")
    v = pool.view(10, padded_heads=8, head_dim=128, device="cpu")  # not locked: grows (zeroed)
    assert v.shape[0] == 10 and not v.any() and v.data_ptr() != t.data_ptr()
    assert op.reasons and "replaced by a larger one (10 tokens)" in op.reasons[0]  # its buffer is gone
    assert pool.reserved_bytes == 10 * 8 * 128 * 2  # the old buffer is not counted (nor held by the pool)
    with pytest.raises(ScratchError, match="already serves H=2"):  # ownership moved to the new buffer
        pool.claim(4, padded_heads=8, head_dim=128, device="cpu")
    again = Claimant()
    pool.claim(2, owner=again, padded_heads=8, head_dim=128, device="cpu")
    pool.release()
    assert pool.reserved_bytes == 0 and again.reasons == [
        "its scratch buffer was released; bind the layer again"
    ]
    assert len(op.reasons) == 1  # told once


def test_a_bound_op_is_told_when_its_scratch_buffer_is_released():
    """A real bound op (on CPU, kernel stubbed) registers with the pool: after release() its next call
    is refused and it holds no buffer."""
    from .support.bad_inputs import BS, H, P, valid
    from .support.stub_kernels import StubRuntime, stub_bind

    rt = StubRuntime()
    op = stub_bind(runtime=rt, num_heads=H, padded_heads=P, max_tokens=12, block_size=BS)
    a = valid("cpu")
    args = [a[k] for k in ("q_in", "kv", "k_cache", "slot_mapping", "positions", "cos_sin_cache")]
    op(*args)
    op.pool.release()
    with pytest.raises(ScratchError, match="its scratch buffer was released; bind the layer again"):
        op(*args)
    assert rt.kernel.calls == 1 and op.buffers == []


def test_a_zero_once_claim_is_for_one_head_count_and_one_q_layout():
    """The live elements of a zero-once buffer depend on the Q layout as well as on H (interleaved Q
    puts head h's dims in 16-element chunks P * 16 apart), so a second layout is refused like a
    second H; writers of every head (pads rewritten per call) never share a zero-once buffer."""
    key = dict(padded_heads=64, head_dim=512, device="cpu")
    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, micro_batches=2, **key)
    pool.claim(16, **key)
    pool.claim(16, q_layout="head_major", **key)  # the same claim again is fine
    with pytest.raises(ScratchError, match=r"H=16 live heads \(head_major\).*H=16 \(interleaved\)"):
        pool.claim(16, q_layout="interleaved", **key)
    with pytest.raises(ScratchError, match="a writer of every head cannot share it"):
        pool.claim(16, writes_pads=True, **key)
    pool.claim(16, writes_pads=True, micro_batch=1, **key)
    pool.claim(48, q_layout="interleaved", writes_pads=True, micro_batch=1, **key)  # any H, any layout
    with pytest.raises(ScratchError, match="cannot be zero-once for H=16"):
        pool.claim(16, micro_batch=1, **key)
    pool.view(8, micro_batch=1, **key)  # grows (not locked): the new buffer keeps the claim's kind
    with pytest.raises(ScratchError, match="cannot be zero-once"):
        pool.claim(16, micro_batch=1, **key)


def test_claimants_are_held_weakly():
    import gc

    pool = ap.ScratchPool()
    pool.reserve(max_tokens=4, padded_heads=8, head_dim=128, micro_batches=1, device="cpu")
    pool.claim(2, owner=Claimant(), padded_heads=8, head_dim=128, device="cpu")
    gc.collect()
    pool.release()  # a dropped bound op is not kept alive, nor called


# ---- tuning database -----------------------------------------------------------------------------
ENV = tuning.Environment(
    gpu="NVIDIA H200", sms=132, capability="9.0", driver="13000", package="0.1.0", dsl="abc"
)


def entry(bucket, config, **over):
    e = {
        **ENV.as_dict(),
        "variant": "qkv_d512r64_fp8_ds_mla_bf16_sm90",
        "bucket": bucket,
        "config": config,
        "us": 1.0,
    }
    e.update(over)
    return e


def test_buckets():
    assert [tuning.bucket_of(n) for n in (0, 1, 2, 3, 64, 65, 32768)] == [1, 1, 2, 4, 64, 128, 32768]
    assert tuning.default_buckets(32768) == [2**i for i in range(16)]


def test_database_round_trip_merge_and_lookup(tmp_path):
    db = tuning.TuningDatabase([entry(1, "w2_u1_pdl1_nc1"), entry(64, "w8_u1_pdl1_nc1")])
    path = db.save(tmp_path / "db.json")
    again = tuning.TuningDatabase.load(path)
    again.merge([entry(64, "w16_u1_pdl1_nc0"), entry(2048, "w4_u1_pdl1_nc1")])
    assert len(again.entries) == 3
    table = again.table_for(ENV)
    assert table[("qkv_d512r64_fp8_ds_mla_bf16_sm90", 64)] == {
        (64, 64): LaunchConfig.from_key("w16_u1_pdl1_nc0")
    }
    assert json.loads(path.read_text())["format"] == tuning.DB_FORMAT
    # entries tuned at other head counts are kept beside it, not merged over it
    again.merge(
        [
            entry(64, "w4_u1_pdl1_nc1", heads=16, padded_heads=16),
            entry(64, "w2_u2_pdl0_nc0", heads=8, padded_heads=64),
        ]
    )
    assert again.table_for(ENV)[("qkv_d512r64_fp8_ds_mla_bf16_sm90", 64)] == {
        (64, 64): LaunchConfig.from_key("w16_u1_pdl1_nc0"),
        (16, 16): LaunchConfig.from_key("w4_u1_pdl1_nc1"),
        (8, 64): LaunchConfig.from_key("w2_u2_pdl0_nc0"),
    }


def test_lookup_takes_the_nearest_tuned_head_counts():
    a, b, c, d = (
        LaunchConfig.from_key(k)
        for k in ("w4_u1_pdl1_nc1", "w8_u1_pdl1_nc1", "w2_u1_pdl1_nc1", "w16_u1_pdl0_nc0")
    )
    tuned = {(16, 16): a, (64, 64): b, (128, 128): c, (8, 64): d}  # (live heads, heads written)
    assert [tuning.pick(tuned, h) for h in (16, 64, 128)] == [a, b, c]
    assert tuning.pick(tuned, 8, 64) == d  # pads written: the (8, 64) entry
    assert (
        tuning.pick(tuned, 8) == a
    )  # zero-once (8 written): log2 distance 1 + 1 to (16, 16), 0 + 3 to (8, 64)
    assert tuning.pick(tuned, 16, 64) == d  # 1 + 0 from (8, 64), 0 + 2 from (16, 16), 2 + 0 from (64, 64)
    assert tuning.pick(tuned, 32) == b  # 1 + 1 to both (16, 16) and (64, 64): the larger
    assert tuning.pick(tuned, 4096) == c
    assert tuning.pick(tuned, None) == c  # no Q heads (KV ops): the largest
    assert tuning.pick({}, 16) is None and tuning.pick(None, 16) is None


def test_an_untuned_gpu_is_noted_once_not_warned_and_ignored_unless_forced(tmp_path, caplog, recwarn):
    db = tuning.TuningDatabase(
        [entry(1, "w2_u1_pdl1_nc1", gpu="NVIDIA GB10", sms=48, capability="12.1")], tmp_path / "x"
    )
    tuning._NOTED.clear()
    with caplog.at_level("INFO", logger="attn_prologue.tuning"):
        assert db.table_for(ENV) == {}
        assert db.table_for(ENV) == {}  # a second bind: nothing more said
    notes = [r for r in caplog.records if "no entry matches" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO" and "tune" in notes[0].getMessage()
    assert not [w for w in recwarn if issubclass(w.category, tuning.TuningDatabaseWarning)]
    assert len(db.table_for(ENV, force=True)) == 1


@pytest.mark.parametrize(
    "text", ["{not json", '{"format": 99, "entries": []}', '{"format": 1, "entries": [{"variant": "x"}]}']
)
def test_corrupt_database_is_reported_and_ignored(tmp_path, text):
    p = tmp_path / "db.json"
    p.write_text(text)
    with pytest.warns(tuning.TuningDatabaseWarning, match="corrupt"):
        db = tuning.TuningDatabase.load(p)
    assert db.entries == []


class RecordingCache:
    """A kernel cache that loads nothing: it records what the dispatcher asks for."""

    def __init__(self, root):
        self.root, self.keys = root, []

    def load(self, key):
        self.keys.append(key)
        return object()


def fake_device(name="NVIDIA H200", capability=(9, 0), sms=132):
    def facts(index):
        arch, target = arch_for_capability(*capability)
        return dispatch.DeviceFacts(index, name, capability, arch, target, sms, f"{name}|fake")

    return facts


def test_dispatcher_prefers_the_database_over_the_default(tmp_path):
    """Each bucket gets the DB entry tuned at its head counts (or the nearest), else the arch default."""
    env = tuning.environment_for("NVIDIA H200", 132, (9, 0))
    db = tuning.TuningDatabase(
        [
            {**env.as_dict(), "variant": "qkv_d512r64_fp8_ds_mla_bf16_sm90", "bucket": 64,
             "config": "w16_u1_pdl1_nc0", "us": 1.0},
            {**env.as_dict(), "variant": "qkv_d512r64_fp8_ds_mla_bf16_sm90", "bucket": 64,
             "config": "w2_u2_pdl0_nc0", "us": 1.0, "heads": 16, "padded_heads": 16},
        ]
    )  # fmt: skip
    cache = RecordingCache(tmp_path)
    rt = dispatch.Runtime(cache=cache, tuning_db=db.save(tmp_path / "db.json"), device_facts=fake_device())
    req = Request(Op.QKV, 512, 64, "fp8_ds_mla", IoDtype.BF16)
    by_bucket = rt.launchers(req, 0, heads=64)
    assert len(by_bucket) == dispatch.MAX_BUCKET_LOG2 + 1
    assert by_bucket[dispatch.bucket_index(50)].config.key == "w16_u1_pdl1_nc0"
    assert by_bucket[dispatch.bucket_index(3000)].config == ArchFamily.SM90.default_config
    assert (
        rt.launchers(req, 0, heads=8)[dispatch.bucket_index(64)].config.key == "w2_u2_pdl0_nc0"
    )  # nearest: 16
    assert {k.target for k in cache.keys} == {"sm_90a"}
    assert {k.variant for k in cache.keys} == {"qkv_d512r64_fp8_ds_mla_bf16_sm90"}
    assert len(cache.keys) == 3  # one load per distinct config, not per bucket
    # a GPU the database was not tuned on gets the default everywhere
    other = dispatch.Runtime(cache=cache, tuning_db=tmp_path / "db.json", device_facts=fake_device(sms=114))
    assert {la.config for la in other.launchers(req, 0, heads=64)} == {ArchFamily.SM90.default_config}


def test_shipped_database_loads_and_names_valid_configs():
    db = tuning.TuningDatabase.load(tuning.shipped_database_path())
    assert db.entries and all(e["gpu"] == "NVIDIA H200" and e["capability"] == "9.0" for e in db.entries)
    for e in db.entries:
        assert e["variant"] in registry.VARIANTS
        LaunchConfig.from_key(e["config"])


# ---- tuning database: hostile files ----------------------------------------------------------------
@pytest.mark.parametrize(
    "bad,why",
    [
        ({"heads": 0}, "heads must be a positive integer"),
        ({"heads": -4}, "heads must be a positive integer"),
        ({"bucket": 3}, "power of two"),
        ({"bucket": True}, "bucket must be a positive integer"),
        ({"capability": "nine"}, "capability must look like 9.0"),
        ({"config": "w3"}, "not a launch-config key"),
        ({"variant": ["x"]}, "variant must be a string"),
        ({"sms": None}, "sms must be a positive integer"),
    ],
)
def test_one_bad_entry_is_skipped_and_the_rest_are_used(tmp_path, bad, why):
    good = [entry(1, "w2_u1_pdl1_nc1"), entry(64, "w8_u1_pdl1_nc1")]
    path = tmp_path / "db.json"
    path.write_text(
        json.dumps({"format": tuning.DB_FORMAT, "entries": [*good, {**entry(2, "w4_u1_pdl1_nc1"), **bad}]})
    )
    with pytest.warns(
        tuning.TuningDatabaseWarning, match=f"skipped 1 invalid entries, using the other 2.*{why}"
    ):
        db = tuning.TuningDatabase.load(path)
    assert db.entries == good


@pytest.mark.parametrize(
    "text",
    [
        '{"format": 1, "entries": [{"bucket": Infinity}]}',
        '{"format": 1, "entries": [{"us": NaN}]}',
        "[" * 100_000 + "]" * 100_000,
        "[]",
        "null",
    ],
)
def test_a_database_that_is_not_one_is_ignored_not_a_crash(tmp_path, text):
    path = tmp_path / "db.json"
    path.write_text(text)
    with pytest.warns(tuning.TuningDatabaseWarning):
        assert tuning.TuningDatabase.load(path).entries == []


def test_a_fifo_or_huge_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.warns(tuning.TuningDatabaseWarning, match="not a regular file"):
        assert tuning.TuningDatabase.load(fifo).entries == []
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(tuning.MAX_DB_BYTES + 1)
    with pytest.warns(tuning.TuningDatabaseWarning, match="more than"):
        assert tuning.TuningDatabase.load(big).entries == []


def test_concurrent_writers_keep_every_merge_and_readers_never_see_a_partial_file(tmp_path):
    path = tmp_path / "db.json"
    tuning.TuningDatabase([]).save(path)
    procs = [
        subprocess.Popen([sys.executable, "-c", MERGER, str(path), str(w)], stderr=subprocess.PIPE, text=True)
        for w in range(4)
    ]
    partial = 0
    while any(p.poll() is None for p in procs):
        data = json.loads(path.read_text())  # raises on a partial file
        partial += not isinstance(data.get("entries"), list)
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    entries = tuning.TuningDatabase.load(path).entries
    assert partial == 0 and len(entries) == 4 * 25  # no merge lost


MERGER = r"""
import sys
from attn_prologue import tuning
env = tuning.Environment(gpu="NVIDIA H200", sms=132, capability="9.0", driver="", package="0.1.0", dsl="abc")
for i in range(25):
    e = {**env.as_dict(), "variant": f"v{sys.argv[2]}_{i}", "bucket": 1, "config": "w4_u1_pdl1_nc1", "us": 1.0}
    tuning.TuningDatabase.merge_into(sys.argv[1], [e])
"""
