"""The ATTN_PROLOGUE_* variables: one parser (env.py), values taken without regard to case, an empty
value is the default, a bad value is an EnvironmentVariableError naming the variable and what it takes
from the first use that reads it, and never a failed `import attn_prologue`. Timeouts are finite and
positive; a mistyped tuning-database path is reported and the shipped database still read. Every
variable the package reads is in the table and in docs/environment.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from attn_prologue import env, tuning
from attn_prologue.env import EnvironmentVariableError
from attn_prologue.jit.kernel_cache import KernelCache

from .support.build import REPO

GOOD = [
    ("ATTN_PROLOGUE_CACHE_TRUST", " Shared ", "shared"),
    ("ATTN_PROLOGUE_CACHE_TRUST", "OWN", "own"),
    ("ATTN_PROLOGUE_CACHE_TRUST", "", "own"),
    ("ATTN_PROLOGUE_NATIVE", "False", False),
    ("ATTN_PROLOGUE_NATIVE", "OFF", False),
    ("ATTN_PROLOGUE_NATIVE", "Yes", True),
    ("ATTN_PROLOGUE_NATIVE", "", True),
    ("ATTN_PROLOGUE_SELFTEST", "ALWAYS", "always"),
    ("ATTN_PROLOGUE_SELFTEST", "", "auto"),
    ("ATTN_PROLOGUE_SELFTEST_FAULT", "0", False),
    ("ATTN_PROLOGUE_SELFTEST_FAULT", "true", True),
    ("ATTN_PROLOGUE_LOCK_TIMEOUT", "2.5", 2.5),
    ("ATTN_PROLOGUE_LOCK_TIMEOUT", "", 900.0),
]
BAD = [
    ("ATTN_PROLOGUE_CACHE_TRUST", "team"),
    ("ATTN_PROLOGUE_NATIVE", "maybe"),
    ("ATTN_PROLOGUE_SELFTEST", "bogus"),
    ("ATTN_PROLOGUE_SELFTEST_FAULT", "2"),
    *[("ATTN_PROLOGUE_LOCK_TIMEOUT", v) for v in ("soon", "-1", "0", "inf", "nan")],
]


@pytest.mark.parametrize("name,raw,want", GOOD)
def test_values_are_typed_case_blind_and_empty_is_the_default(monkeypatch, name, raw, want):
    monkeypatch.setenv(name, raw)
    assert env.get(name) == want


@pytest.mark.parametrize("name,raw", BAD)
def test_a_bad_value_is_a_typed_error_naming_the_variable_and_what_it_takes(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(EnvironmentVariableError, match=re.escape(f"{name}={raw!r} is not valid: it takes")):
        env.get(name)


def test_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTN_PROLOGUE_CACHE", "rel")
    monkeypatch.setenv("ATTN_PROLOGUE_TUNING_DB", "db.json")
    assert env.get("ATTN_PROLOGUE_CACHE") == tmp_path / "rel"
    assert env.get("ATTN_PROLOGUE_TUNING_DB") == tmp_path / "db.json"


def test_timeouts_are_finite_and_positive():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number of seconds"):
            KernelCache("/nonexistent", lock_timeout=bad)
    assert KernelCache("/nonexistent", lock_timeout=0.25).lock_timeout == 0.25


USES = r"""
import json
import attn_prologue  # must not fail, whatever the values
from attn_prologue import env, native, selftest
from attn_prologue.jit.kernel_cache import KernelCache
from attn_prologue.variants import parse_name
uses = {
    "ATTN_PROLOGUE_CACHE_TRUST": lambda: KernelCache(lock_timeout=1),
    "ATTN_PROLOGUE_LOCK_TIMEOUT": lambda: KernelCache(trust="own"),
    "ATTN_PROLOGUE_NATIVE": native.enabled,
    "ATTN_PROLOGUE_SELFTEST": lambda: selftest.fallback_to_test(parse_name("qkv_d512r64_fp8_ds_mla_bf16_sm120")),
    "ATTN_PROLOGUE_SELFTEST_FAULT": lambda: env.get("ATTN_PROLOGUE_SELFTEST_FAULT"),
}
out = {}
for name, use in uses.items():
    try:
        out[name] = {"ok": repr(use())}
    except Exception as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""


def test_bad_values_never_fail_the_import_and_fail_typed_where_they_are_used():
    bad = {"ATTN_PROLOGUE_CACHE_TRUST": "", "ATTN_PROLOGUE_LOCK_TIMEOUT": "-1", "ATTN_PROLOGUE_NATIVE": "maybe",
           "ATTN_PROLOGUE_SELFTEST": "bogus", "ATTN_PROLOGUE_SELFTEST_FAULT": "2"}  # fmt: skip
    bad_trust = {**bad, "ATTN_PROLOGUE_CACHE_TRUST": "team"}
    for values in (bad, bad_trust):
        run = subprocess.run([sys.executable, "-c", USES], capture_output=True, text=True, cwd=REPO, timeout=300,
                             env={**_clean_env(), **values})  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        for name, outcome in got.items():
            if values[name] == "":  # empty: the default, not an error
                assert "ok" in outcome, (name, outcome)
                continue
            assert outcome.get("error") == "EnvironmentVariableError", (name, outcome)
            assert outcome["message"].startswith(f"{name}={values[name]!r} is not valid"), outcome


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("ATTN_PROLOGUE_")}


def test_a_tuning_database_path_that_does_not_exist_is_reported_and_the_shipped_one_read(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ATTN_PROLOGUE_TUNING_DB", str(tmp_path / "tunnig.json"))
    with pytest.warns(tuning.TuningDatabaseWarning, match="tunnig.json does not exist: reading the shipped"):
        assert tuning.database_to_read() == tuning.shipped_database_path()
    assert tuning.database_path() == tmp_path / "tunnig.json"  # where `tune` would create it
    (tmp_path / "tunnig.json").write_text('{"format": 1, "entries": []}')
    assert tuning.database_to_read() == tmp_path / "tunnig.json"


def _read_by_the_package() -> set[str]:
    names = set()
    for folder in ("runtime", "codegen", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"\bATTN_PROLOGUE_[A-Z_]*[A-Z]\b", path.read_text()))
    return names


def test_every_variable_the_package_reads_is_in_the_table_and_the_docs():
    assert _read_by_the_package() == set(env.VARIABLES)
    doc = (REPO / "docs" / "environment.md").read_text()
    rows = re.findall(r"^\| `(ATTN_PROLOGUE_[A-Z_]+)` \|", doc, re.M)
    assert sorted(rows) == sorted(env.VARIABLES), "docs/environment.md lists exactly the variables"
    assert "environment.md" in (REPO / "docs" / "README.md").read_text()
    for var in env.VARIABLES.values():
        assert var.accepts in doc, var.name


def test_the_package_never_reads_the_environment_for_its_own_variables_elsewhere():
    offenders = []
    for folder in ("runtime", "codegen"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name == "env.py":
                continue
            if re.search(r"os\.environ(\.get)?\(?\[?\s*(ENV_|\"ATTN_PROLOGUE_)", path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
