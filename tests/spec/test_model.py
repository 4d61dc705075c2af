from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.netmodel import count_params
from dmsc.spec import MODEL_PRESETS, LayerListSpec, SpecError, TransformerSpec, resolve_model


@pytest.mark.parametrize(
    ("name", "published"),
    [
        # Brown et al. 2020 Table 2.1; Meta Llama 3 model cards; Mixtral paper (46.7B total).
        ("gpt3-125m", 125e6),
        ("gpt3-1.3b", 1.3e9),
        ("gpt3-6.7b", 6.7e9),
        ("gpt3-13b", 13e9),
        ("gpt3-175b", 175e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
        ("mixtral-8x7b", 46.7e9),
    ],
)
def test_preset_parameter_counts(name: str, published: float) -> None:
    model = resolve_model(name)
    assert abs(count_params(model) - published) / published < 0.03


def test_every_preset_validates() -> None:
    for name in MODEL_PRESETS:
        assert isinstance(resolve_model(name), TransformerSpec)


def test_shape_overrides() -> None:
    model = resolve_model("gpt3-175b", {"layers": 4, "seq": 1024, "hidden": None})
    assert isinstance(model, TransformerSpec)
    assert (model.layers, model.seq, model.hidden) == (4, 1024, 12288)


def test_shape_flags_define_a_model() -> None:
    model = resolve_model(None, {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 100})
    assert isinstance(model, TransformerSpec) and model.ffn_size == 256
    with pytest.raises(SpecError, match="--heads"):
        resolve_model(None, {"layers": 2, "hidden": 64, "seq": 32, "vocab": 100})


def test_bad_shapes() -> None:
    with pytest.raises(SpecError) as info:
        resolve_model("gpt3-175b", {"heads": 7})
    assert info.value.field == "--heads" and "does not divide the hidden size" in info.value.reason
    with pytest.raises(SpecError, match="unknown model"):
        resolve_model("gpt5")


def test_layer_list_file(tmp_path: Path) -> None:
    path = tmp_path / "cnn.yaml"
    path.write_text(
        "kind: layers\nname: cnn\nlayer_list:\n"
        "  - {forward_gflop: 1.5, params: 1000, activation_bytes: 4096, output_bytes: 1024}\n"
        "  - {forward_gflop: 0.5, params: 50, activation_bytes: 1024, output_bytes: 64}\n"
    )
    model = resolve_model(str(path))
    assert isinstance(model, LayerListSpec) and len(model.layer_list) == 2
    path.write_text(
        "kind: layers\nlayer_list:\n  - {forward_gflop: -1, params: 1, "
        "activation_bytes: 1, output_bytes: 1}\n"
    )
    with pytest.raises(SpecError) as info:
        resolve_model(str(path))
    assert info.value.field == "layer_list[0].forward_gflop"
