"""The tuning database on CPU: round trip, merge, lookup, mismatch and corruption, the dispatcher's
use of it, and hostile files (bad entries, files that are not a database, a FIFO or a huge file,
concurrent writers)."""

import json
import os
import subprocess
import sys

import pytest
from attn_prologue import dispatch, tuning
from attn_prologue.generated import registry
from attn_prologue.launch import LaunchConfig
from attn_prologue.variants import ArchFamily, IoDtype, Op, Request, arch_for_capability

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
        (64, 64, 1): LaunchConfig.from_key("w16_u1_pdl1_nc0")
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
        (64, 64, 1): LaunchConfig.from_key("w16_u1_pdl1_nc0"),
        (16, 16, 1): LaunchConfig.from_key("w4_u1_pdl1_nc1"),
        (8, 64, 1): LaunchConfig.from_key("w2_u2_pdl0_nc0"),
    }
    # and entries timed at a compress ratio beside those of ratio 1
    again.merge(
        [entry(64, "w8_u1_pdl1_nc1", compress_ratio=4), entry(64, "w2_u1_pdl1_nc1", compress_ratio=4)]
    )
    assert again.table_for(ENV)[("qkv_d512r64_fp8_ds_mla_bf16_sm90", 64)][
        (64, 64, 4)
    ] == LaunchConfig.from_key("w2_u1_pdl1_nc1")
    assert len(again.entries) == 6


def test_lookup_takes_the_nearest_tuned_head_counts():
    a, b, c, d = (
        LaunchConfig.from_key(k)
        for k in ("w4_u1_pdl1_nc1", "w8_u1_pdl1_nc1", "w2_u1_pdl1_nc1", "w16_u1_pdl0_nc0")
    )
    tuned = {
        (16, 16, 1): a,
        (64, 64, 1): b,
        (128, 128, 1): c,
        (8, 64, 1): d,
    }  # (live heads, heads written, r)
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


def test_lookup_takes_the_entries_of_the_call_compress_ratio():
    """A compressed writer's call uses the entries timed at its ratio, else those of ratio 1; never
    another ratio's."""
    plain, r4, r2 = (
        LaunchConfig.from_key(k) for k in ("w2_u1_pdl1_nc1", "w16_u1_pdl1_nc1", "w8_u1_pdl1_nc1")
    )
    tuned = {(64, 64, 1): plain, (64, 64, 4): r4}
    assert [tuning.pick(tuned, None, None, r) for r in (1, 4, 2)] == [plain, r4, plain]
    assert tuning.pick({(64, 64, 2): r2}, None, None, 4) is None  # only another ratio's: the default
    assert tuning.pick({(64, 64, 2): r2}, None) is None


def test_dispatch_binds_a_compressed_writer_to_its_ratio_entry(tmp_path):
    """The launchers of a KV-only writer: the r = 4 entries for r = 4 calls, the r = 1 entries for
    calls of ratio 1 and of a ratio with no entries (2), the arch default where neither exists."""
    env = tuning.environment_for("NVIDIA H200", 132, (9, 0))
    v = "kv_d512r64_fp8_ds_mla_bf16_sm90"
    db = tuning.TuningDatabase(
        [
            {**env.as_dict(), "variant": v, "bucket": 64, "config": "w2_u1_pdl1_nc1", "us": 1.0},
            {**env.as_dict(), "variant": v, "bucket": 64, "config": "w16_u1_pdl1_nc1", "us": 1.0, "compress_ratio": 4},
            {**env.as_dict(), "variant": v, "bucket": 2048, "config": "w8_u1_pdl1_nc1", "us": 1.0, "compress_ratio": 4},
        ]
    )  # fmt: skip
    rt = dispatch.Runtime(
        cache=RecordingCache(tmp_path), tuning_db=db.save(tmp_path / "db.json"), device_facts=fake_device()
    )
    req = Request(Op.KV, 512, 64, "fp8_ds_mla", IoDtype.BF16)
    at = {r: rt.launchers(req, 0, compress_ratio=r) for r in (1, 2, 4)}
    assert [at[r][dispatch.bucket_index(64)].config.key for r in (1, 2, 4)] == [
        "w2_u1_pdl1_nc1", "w2_u1_pdl1_nc1", "w16_u1_pdl1_nc1",
    ]  # fmt: skip
    assert at[4][dispatch.bucket_index(2048)].config.key == "w8_u1_pdl1_nc1"
    assert at[1][dispatch.bucket_index(2048)].config == ArchFamily.SM90.default_config


def test_a_bad_compress_ratio_entry_is_skipped(tmp_path):
    path = tmp_path / "db.json"
    good, bad = entry(64, "w2_u1_pdl1_nc1", compress_ratio=4), entry(64, "w2_u1_pdl1_nc1", compress_ratio=0)
    path.write_text(json.dumps({"format": tuning.DB_FORMAT, "entries": [good, bad]}))
    with pytest.warns(tuning.TuningDatabaseWarning, match="compress_ratio must be a positive integer"):
        db = tuning.TuningDatabase.load(path)
    assert db.entries == [good]


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

    def __init__(self, root, built=()):
        self.root, self.keys, self.built = root, [], set(built)

    def load(self, key):
        self.keys.append(key)
        return object()

    def has(self, key):
        return key in self.built


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


def test_a_defaults_only_entry_serves_only_calls_with_the_defaults(tmp_path):
    """A tuned defaults_only config (its module reads `numerics` as the defaults' constant) is bound for
    calls with the format's default bits. A call with other bits gets the first built of: the config
    folded to its bits (`build --numerics`), the config reading them, the arch default config."""
    from attn_prologue.codegen import build
    from attn_prologue.jit.kernel_cache import KernelKey
    from attn_prologue.variants import parse_name

    env = tuning.environment_for("NVIDIA H200", 132, (9, 0))
    name, key = "kv_d512r64_fp8_ds_mla_bf16_sm90", "w8_u1_pdl1_nc1_cs_lq_d"
    fmt = parse_name(name).format
    vllm, flashmla = fmt.numerics_flags("preset=vllm"), fmt.numerics_flags("preset=flashmla")
    folded = LaunchConfig.from_key(f"w8_u1_pdl1_nc1_cs_lq_n{vllm}")
    twin = LaunchConfig.from_key(key[:-2])
    db = tuning.TuningDatabase([{**env.as_dict(), "variant": name, "bucket": 2048, "config": key, "us": 1.0}])
    req, i = Request(Op.KV, 512, 64, "fp8_ds_mla", IoDtype.BF16), dispatch.bucket_index(2048)

    def runtime(*built):
        cache = RecordingCache(tmp_path, built=[KernelKey(name, c, "sm_90a") for c in built])
        return dispatch.Runtime(
            cache=cache, tuning_db=db.save(tmp_path / "db.json"), device_facts=fake_device()
        )

    rt = runtime(folded)
    for bits in (None, fmt.numerics_flags()):
        assert rt.launchers(req, 0, numerics=bits)[i].config.key == key
    assert rt.launchers(req, 0, numerics=vllm)[i].config == folded
    assert (
        rt.launchers(req, 0, numerics=flashmla)[i].config == ArchFamily.SM90.default_config
    )  # neither built
    assert runtime(twin).launchers(req, 0, numerics=flashmla)[i].config == twin
    assert (
        rt.launchers(req, 0, config=folded, numerics=vllm)[0].config == folded
    )  # forced, folding these bits
    forced = LaunchConfig.from_key("w16_u1_pdl1_nc1_d")  # a forced config is treated alike
    assert {la.config for la in rt.launchers(req, 0, config=forced, numerics=vllm)} == {
        ArchFamily.SM90.default_config
    }
    # the build compiles folded modules for the spellings asked for; one the format lacks folds nothing
    keys = build.build_keys(
        [parse_name(name)], {"sm_90a"}, [LaunchConfig.from_key(key)], ["preset=vllm", "preset=flashinfer"]
    )
    assert sorted(k.config.key for _, k in keys) == sorted([key, folded.key])
    assert [
        k.config.key
        for _, k in build.build_keys([parse_name(name)], {"sm_90a"}, [LaunchConfig.from_key(key)])
    ] == [key]


def test_shipped_database_loads_and_names_valid_configs():
    db = tuning.TuningDatabase.load(tuning.shipped_database_path())
    assert db.entries and all(e["capability"] == "9.0" for e in db.entries)

    def shapes(gpu):
        return {(e["variant"], e["bucket"], *tuning.entry_shape(e)) for e in db.entries if e["gpu"] == gpu}

    # the H100's entries were re-timed from the H200's (tune --like): one for each of its shapes; and the
    # H100 alone has the index_q modules' sweep (every bucket of both bf16 formats; no H200 has run it)
    assert {e["gpu"] for e in db.entries} == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    h100 = shapes("NVIDIA H100 80GB HBM3")
    index_q = {s for s in h100 if s[0].startswith("index_q_")}
    assert h100 - index_q == shapes("NVIDIA H200")
    assert {(s[0], s[1]) for s in index_q} == {
        (f"index_q_d128r64_{fmt}_bf16_sm90", 1 << i) for fmt in ("fp8_token", "mxfp4") for i in range(16)
    }
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
