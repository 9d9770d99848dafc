"""tools/profile_index_q.py's reading of Nsight Compute's raw CSV (no GPU): units converted, ncu's own
lines dropped, thousands separators read, an unknown unit never taken as 1, and the cases it profiles."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("profile_index_q", REPO / "tools" / "profile_index_q.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

METRICS = tool.CORE_METRICS + tool.STALL_METRICS[:2]


def csv_text(time_unit: str, time_value: str) -> str:
    # the layout of `ncu --csv --page raw`: ncu's log lines, a header, a units row, one row per kernel;
    # two kernels: 280 us moving 800 MB + 14 MB, and one with other values
    header = ["ID", "Kernel Name", *METRICS]
    units = ["", "", *("byte" if "bytes" in m else time_unit if "time" in m else "" for m in METRICS)]
    first = {"gpu__time_duration.sum": time_value, "dram__bytes_read.sum": "800,000,000",
             "dram__bytes_write.sum": "14,000,000", "smsp__inst_executed.sum": "134,217,728"}  # fmt: skip
    rows = [["0", "k_a", *(first.get(m, "1.5") for m in METRICS)], ["1", "k_b", *("2" for _ in METRICS)]]
    quoted = [",".join(f'"{v}"' for v in r) for r in (header, units, *rows)]
    return "==PROF== Connected to process 1\n" + "\n".join(quoted) + "\n==PROF== Disconnected\n"


def test_raw_csv_rows_convert_times_and_sizes():
    rows = tool.parse_raw_csv(csv_text("nsecond", "279,488"))
    assert [r["Kernel Name"] for r in rows] == ["k_a", "k_b"]
    case = {"kind": "op", "fmt": "fp8_token", "numerics": "vllm", "tokens": 32768}
    s = tool.summarize(case, rows[0])
    assert s["us"] == 279.49  # 279,488 ns
    assert s["dram_bytes"] == 814_000_000
    assert s["dram_tb_s"] == round(814e6 / 279.488e-6 / 1e12, 3)  # 2.912
    assert s["warp_instructions"] == 134_217_728
    assert set(s["stall_cycles_per_issue"]) == {"long_scoreboard", "short_scoreboard"}
    assert s["raw"]["units"]["gpu__time_duration.sum"] == "nsecond"
    assert set(s["raw"]) == set(METRICS) | {"units"}  # the metrics asked for, not ncu's other columns
    assert tool.summarize(case, tool.parse_raw_csv(csv_text("usecond", "279.488"))[0])["us"] == 279.49


def test_an_unknown_unit_gives_nan_not_a_silent_one():
    s = tool.summarize({"kind": "op"}, tool.parse_raw_csv(csv_text("fortnight", "3"))[0])
    assert math.isnan(s["us"]) and math.isnan(s["dram_tb_s"])


def test_no_kernel_rows_is_no_rows():
    assert tool.parse_raw_csv("==PROF== Connected\n==PROF== Disconnected\n") == []


def test_every_preset_and_format_is_profiled_beside_its_copies():
    cases = tool.cases(2048)
    ops = {(c["fmt"], c["numerics"]) for c in cases if c["kind"] == "op"}
    assert ops == {(f, p) for f in ("fp8_token", "mxfp4") for p in ("vllm", "sglang", "tokenspeed")}
    copies = [c for c in cases if c["kind"] == "copy"]
    assert {(c["fmt"], c["copy"]) for c in copies} == {
        (f, k) for f in ("fp8_token", "mxfp4") for k in ("sm", "sm1")
    }
    assert all(c["bytes"] == tool.b.min_bytes(2048, c["fmt"]) for c in copies)
