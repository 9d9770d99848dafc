"""tools/same_kernels.py, the check that a build-speed change left every kernel's bytes alone, on two
small caches laid out as `build` lays them out (meta.json, kernel.so, kernel.ptx per entry)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("same_kernels", REPO / "tools" / "same_kernels.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

KERNELS = [
    ("sm_90a", "kv_d512r64_mxfp8_bf16_sm90", "w4_u1_pdl1_nc1_cs"),
    ("sm_120f", "kv_d128r64_bf16_bf16_sm120", "w4_u1_pdl1_nc1_cs"),
]


def write_cache(root: Path, source_hash: str, so_bytes: dict) -> None:
    for target, variant, config in KERNELS:
        if (variant, target) not in so_bytes:
            continue
        d = root / "fingerprint-linux-x86_64" / target / variant / f"{config}-{source_hash}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"target": target, "variant": variant, "config": config}))
        (d / "kernel.so").write_bytes(so_bytes[(variant, target)])
        (d / "kernel.ptx").write_text(f"// {variant}\n")
    native = root / "native" / "torch_ops" / "abc"  # a native part's entry: no kernel.so, not compared
    native.mkdir(parents=True)
    (native / "meta.json").write_text("{}")


def test_same_bytes_under_other_source_hashes_are_the_same(tmp_path, capsys):
    so = {(v, t): f"{v}{t}".encode() for t, v, _ in KERNELS}
    write_cache(tmp_path / "a", "1111", so)
    write_cache(tmp_path / "b", "2222", so)  # (an edited shared source: new directories, same bytes)
    assert tool.main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["same"] == 2 and result["entries"] == [2, 2]
    assert "2 the same bytes" in capsys.readouterr().out


def test_a_changed_byte_or_a_missing_entry_is_reported(tmp_path, capsys):
    so = {(v, t): f"{v}{t}".encode() for t, v, _ in KERNELS}
    write_cache(tmp_path / "a", "1111", so)
    first = (KERNELS[0][1], KERNELS[0][0])
    write_cache(tmp_path / "b", "2222", {first: so[first] + b"\0"})
    assert tool.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    result = tool.compare(tmp_path / "a", tmp_path / "b")
    assert result["so_differ"] == [":".join(KERNELS[0])] and result["ptx_differ"] == []
    assert result["only_before"] == [":".join(KERNELS[1])] and result["only_after"] == []
    assert "kernel.so differs in 1" in capsys.readouterr().out
