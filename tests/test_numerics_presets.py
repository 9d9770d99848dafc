"""The parity choices as data: the typed Numerics (every field coerced or refused), the string
spelling (presets and fields combined, no field twice), the presets table (each entry resolves on its
format, cites a source, names only known row classes) and the kernel bits it turns into."""

from __future__ import annotations

import pytest
from attn_prologue.formats import (
    FORMATS,
    NUMERICS_FLAGS,
    E4m3Nan,
    Fp4Zero,
    InfScale,
    Numerics,
    NumericsError,
    NumericsFlag,
    RopeOrder,
    ScaleFloor,
    get_format,
    preset_rows,
)
from attn_prologue.presets import PRESETS, ROW_CLASSES


def test_fields_are_coerced_from_their_value_strings_and_anything_else_is_refused():
    assert Numerics(scale_floor="scale", e4m3_nan="0x7e") == Numerics(
        scale_floor=ScaleFloor.SCALE, e4m3_nan=E4m3Nan.POS_MAX
    )
    for bad in (
        dict(scale_floor="bogus"),
        dict(scale_floor=1),
        dict(fp4_zero=ScaleFloor.SCALE),
        dict(preset=3),
    ):
        with pytest.raises(NumericsError):
            Numerics(**bad)
    with pytest.raises(NumericsError, match="got list"):
        Numerics.of(["scale_floor=scale"])


def test_spellings_are_matched_without_regard_to_case_and_typos_name_the_closest():
    assert Numerics.parse("Preset=vLLM, E4M3_NAN=0xFE, amax_floor=1E-4") == Numerics.parse(
        "preset=vllm, e4m3_nan=0xfe, amax_floor=1e-4"
    )
    with pytest.raises(NumericsError, match=r"\(did you mean scale\?\)"):
        Numerics.parse("scale_floor=sacle")
    with pytest.raises(NumericsError, match=r"\(did you mean rope_order\?\)"):
        Numerics.parse("rope_ordr=odd_cos")
    with pytest.raises(
        NumericsError, match=r"unknown numerics preset 'vlm' \(did you mean vllm\?\); presets: vllm"
    ):
        get_format("mxfp8").numerics_flags("preset=vlm")


def test_the_string_spelling_round_trips_and_names_each_field_once():
    n = Numerics.parse("preset=vllm-triton, fp4_zero=positive")
    assert n == Numerics(preset="vllm-triton", fp4_zero=Fp4Zero.POSITIVE)
    assert Numerics.parse(n.text()) == n and n.text() == "preset=vllm-triton, fp4_zero=positive"
    for bad in ("scale_floor=scale, scale_floor=amax", "preset=vllm, preset=trtllm", "scale_floor", "x=1"):
        with pytest.raises(NumericsError):
            Numerics.parse(bad)
    assert Numerics.parse("") == Numerics() and str(Numerics()) == "format defaults"


def test_a_field_overrides_its_preset_and_the_rest_keep_the_format_defaults():
    fmt = get_format("fp8_ds_mla")
    assert (
        fmt.numerics_flags("preset=vllm") == NumericsFlag.E4M3_NAN_NEG_MAX | NumericsFlag.INF_SCALE_OVERFLOW
    )
    assert fmt.numerics_flags("preset=vllm, e4m3_nan=0x7f") == NumericsFlag.INF_SCALE_OVERFLOW
    n = fmt.resolve_numerics("preset=trtllm, rope_order=even_sin")
    assert n.rope_order is RopeOrder.EVEN_SIN and n.inf_scale is InfScale.WRAPPED and n.preset is None
    assert fmt.resolve_numerics("") == fmt.numerics == fmt.resolve_numerics(None)


def test_a_preset_or_value_a_format_lacks_is_refused_with_what_it_has():
    with pytest.raises(NumericsError, match="unknown numerics preset 'vllm_triton'.*vllm-triton"):
        get_format("mxfp8").resolve_numerics("preset=vllm_triton")
    with pytest.raises(
        NumericsError, match="preset flashinfer has no cache format mxfp8: it covers nvfp4_dsv4"
    ):
        get_format("mxfp8").resolve_numerics("preset=flashinfer")
    with pytest.raises(NumericsError, match="fp8_token has no inf_scale=126"):
        get_format("fp8_token").resolve_numerics("inf_scale=126")
    with pytest.raises(NumericsError, match="fp8_tensor has no e4m3_nan choice"):
        get_format("fp8_tensor").resolve_numerics("e4m3_nan=0x7e")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_entry_resolves_on_its_format_and_cites_a_commit(name):
    for fmt_name, entry in PRESETS[name].formats.items():
        fmt = get_format(fmt_name)
        resolved = fmt.resolve_numerics(Numerics(preset=name))
        assert {k: getattr(resolved, k) for k in entry.numerics.given()} == entry.numerics.given()
        assert " @" in entry.source and set(entry.unmatched) <= set(ROW_CLASSES)
        assert all(entry.unmatched.values())


def test_the_preset_table_lists_every_entry_once():
    rows = preset_rows()
    assert len(rows) == sum(len(p.formats) for p in PRESETS.values())
    assert {(r["format"], r["preset"]) for r in rows} == {
        (f, p) for p, q in PRESETS.items() for f in q.formats
    }
    assert {r["format"] for r in rows} <= set(FORMATS)


def test_each_value_but_the_first_has_its_own_bit():
    bits = [int(b) for values in NUMERICS_FLAGS.values() for b in values.values()]
    assert sorted(bits) == sorted(int(f) for f in NumericsFlag) and len(set(bits)) == len(bits)
    for fmt in FORMATS.values():  # the defaults set no bit: a launch without numerics= is the default
        assert fmt.numerics_flags() == 0
