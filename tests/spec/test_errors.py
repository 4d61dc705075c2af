"""Located errors of the spec layer: an unknown field named with the field it likely misspells,
and a shape flag blamed for its own bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.spec import ClusterSpec, JobSpec, ModelSpec, SpecError, load_spec, parse_any_model
from dmsc.spec.presets import resolve_model
from dmsc.spec.suggest import fields_at

ROOT = Path(__file__).resolve().parents[2]
SELENE = ROOT / "examples" / "clusters" / "a100-selene.yaml"


def test_a_misspelt_cluster_field_is_named_with_the_right_one(tmp_path: Path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text(SELENE.read_text().replace("memory_gib:", "memroy_gib:"))
    with pytest.raises(SpecError) as err:
        load_spec(ClusterSpec, bad)
    assert err.value.source == str(bad)
    assert err.value.field == "device_types.a100-80gb.memroy_gib"
    # The missing memory_gib is the same problem, not one more.
    assert err.value.reason == "unknown field; did you mean memory_gib?"


def test_a_field_like_none_lists_the_known_ones(tmp_path: Path) -> None:
    bad = tmp_path / "extra.yaml"
    bad.write_text(SELENE.read_text() + "colour: blue\n")
    with pytest.raises(SpecError) as err:
        load_spec(ClusterSpec, bad)
    assert err.value.field == "colour"
    assert err.value.reason.startswith("unknown field (known: name, propagation_us_per_km, ")


@pytest.mark.parametrize(
    ("doc", "field", "guess"),
    [
        ({"layres": 4, "hidden": 64, "heads": 4, "seq": 8, "vocab": 9}, "layres", "layers"),
        (
            {
                "kind": "layers",
                "layer_list": [
                    {"forwrd_gflop": 1, "params": 1, "activation_bytes": 1, "output_bytes": 1}
                ],
            },
            "layer_list[0].forwrd_gflop",
            "forward_gflop",
        ),
    ],
)
def test_a_misspelt_model_field_is_named_in_any_kind_of_model(
    doc: dict[str, object], field: str, guess: str
) -> None:
    with pytest.raises(SpecError) as err:
        parse_any_model(doc, "model.yaml")
    assert (err.value.field, err.value.reason) == (field, f"unknown field; did you mean {guess}?")


def test_fields_at_walks_models_dicts_lists_and_unions() -> None:
    assert "memory_gib" in fields_at(ClusterSpec, ("device_types", "a100", "x"))
    assert "layers" in fields_at(ModelSpec, ("transformer", "x"))
    assert "forward_gflop" in fields_at(ModelSpec, ("layers", "layer_list", 0, "x"))
    assert "global_batch" in fields_at(JobSpec, ("x",))
    assert fields_at(ClusterSpec, ("name", "x")) == []


def test_a_bad_shape_flag_is_the_flags_fault() -> None:
    with pytest.raises(SpecError) as err:
        resolve_model("gpt3-1.3b", {"layers": -1})
    assert (err.value.source, err.value.field) == ("command line", "--layers")
    with pytest.raises(SpecError) as err:
        resolve_model("gpt3-1.3b", {"hidden": 100})  # not divisible by the preset's heads
    assert (err.value.source, err.value.field) == ("command line", "--hidden")
    with pytest.raises(SpecError) as err:
        resolve_model("gpt3-1.3b", {"heads": 7})  # it does not divide the preset's hidden
    assert (err.value.source, err.value.field) == ("command line", "--heads")
    assert err.value.reason == "7 does not divide the hidden size 2048 of preset gpt3-1.3b"
