"""tools/like_report.py: the summary of a `tune --like` run that docs/tuning.md quotes, on a
hand-made sweep (expected values derived in the comments) and on the committed H100 run."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("like_report", REPO / "tools" / "like_report.py")
like_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(like_report)


def test_report_on_a_hand_made_sweep():
    def t(bucket, config, us):
        return {"variant": "v", "bucket": bucket, "heads": 64, "padded_heads": 64, "compress_ratio": 1,
                "config": config, "us": us}  # fmt: skip

    sweep = {
        "default": "D",
        # bucket 1: the source chose A (1.0, the fastest), the default takes 2.0
        # bucket 2: the source chose B (3.0), the fastest is the default (2.0)
        "timings": [t(1, "A", 1.0), t(1, "D", 2.0), t(2, "B", 3.0), t(2, "D", 2.0)],
    }
    database = {
        "entries": [
            {"gpu": "G", "variant": "v", "bucket": 1, "heads": 64, "padded_heads": 64, "config": "A"},
            {"gpu": "G", "variant": "v", "bucket": 2, "heads": 64, "padded_heads": 64, "config": "B"},
            {"gpu": "other", "variant": "v", "bucket": 2, "heads": 64, "padded_heads": 64, "config": "D"},
        ]
    }
    r = like_report.report(sweep, database, "G")
    assert r["shapes"] == 2 and r["source_choice_fastest"] == 1
    # source over fastest: 1.0 and 1.5 -> median 1.25, geomean sqrt(1.5) = 1.22
    assert r["source_choice"]["median"] == 1.25 and r["source_choice"]["geomean"] == 1.22
    # default over fastest: 2.0 and 1.0; source over default: 0.5 and 1.5 (slower at one, by > 5%)
    assert r["arch_default"]["median"] == 1.5
    assert r["source_over_default"] == {"geomean": 0.87, "slower": 1, "slower_by_5pct": 1, "worst": 1.5}
    # a sweep that kept its `like` record needs no database: the same choices give the same report
    liked = {**sweep, "like": {"gpu": "G", "choices": [
        {"variant": "v", "bucket": 1, "heads": 64, "padded_heads": 64, "compress_ratio": 1, "config": "A"},
        {"variant": "v", "bucket": 2, "heads": 64, "padded_heads": 64, "compress_ratio": 1, "config": "B"},
    ]}}  # fmt: skip
    assert like_report.report(liked) == r


def test_the_committed_h100_run_says_what_docs_tuning_md_says():
    sweep = like_report._load(REPO / "results" / "tune-like-h100.json.gz")
    database = like_report._load(REPO / "results" / "tune-like-h100-source.json.gz")  # what --like followed
    r = like_report.report(sweep, database, "NVIDIA H200")
    assert (r["shapes"], r["source_choice_fastest"]) == (171, 55)
    assert r["source_choice"] == {"median": 1.017, "p90": 1.34, "geomean": 1.09}
    assert (r["arch_default"]["p90"], r["arch_default"]["geomean"]) == (1.47, 1.2)
    assert round(r["arch_default"]["median"], 2) == 1.15
    assert r["source_over_default"] == {"geomean": 0.91, "slower": 67, "slower_by_5pct": 10, "worst": 1.35}
    text = " ".join((REPO / "docs" / "tuning.md").read_text().split())
    for phrase in ("fastest at 55 of the 171", "1.017x the fastest at the median, 1.34x at the 90th percentile and 1.09x",
                   "was 1.15x, 1.47x and 1.20x", "0.91x in geometric mean, but slower at 67 of the 171 shapes",
                   "by more than 5% at 10, by 1.35x at worst"):  # fmt: skip
        assert phrase in text, phrase
