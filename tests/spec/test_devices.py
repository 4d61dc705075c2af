"""Device presets, generations and measured efficiencies in the cluster spec (issue 13, items 3
and 4): figures come from the preset under what the spec gives, a type's name gives its
generation, and a bad preset or curve names its field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dmsc.spec import ClusterSpec, DeviceTypeSpec, SpecError, load_spec
from dmsc.spec.devices import DEVICE_PRESETS


def _cluster(device: dict[str, object], key: str = "gpu") -> ClusterSpec:
    return ClusterSpec.model_validate(
        {
            "device_types": {key: device},
            "node_types": {"n": {"device": key, "devices": 8, "link": {"bandwidth_gbit_s": 3600}}},
            "datacenters": [
                {
                    "name": "dc",
                    "nodes": [{"type": "n", "count": 1}],
                    "network": {"gbit_s_per_node": 800},
                }
            ],
        }
    )


@pytest.mark.parametrize("name", list(DEVICE_PRESETS))
def test_every_preset_is_a_device_of_its_generation(name: str) -> None:
    dev = DeviceTypeSpec(preset=name)
    assert dev.generation == DEVICE_PRESETS[name]["generation"]
    assert dev.peak_tflops["bf16"] > 0 and dev.sm_count


def test_the_spec_overrides_its_preset() -> None:
    dev = DeviceTypeSpec.model_validate({"preset": "h100-sxm", "memory_gib": 64})
    assert dev.memory_gib == 64 and dev.memory_bw_gbyte_s == 3350 and dev.generation == "h100"


def test_a_device_type_takes_the_generation_its_name_says() -> None:
    fig = {"peak_tflops": {"bf16": 989}, "memory_gib": 80, "memory_bw_gbyte_s": 3350}
    assert _cluster(fig, "h100-80gb").device_types["h100-80gb"].generation == "h100"
    assert _cluster(fig, "dgx-a100").device_types["dgx-a100"].generation == "a100"
    assert _cluster(fig, "cpu").device_types["cpu"].generation == "generic"
    named = _cluster({**fig, "generation": "b200"}, "h100-80gb")
    assert named.device_types["h100-80gb"].generation == "b200"  # what the spec says wins


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValidationError, match=r"unknown device 'h800'.*h100-sxm"):
        DeviceTypeSpec(preset="h800")


def test_a_bad_measured_curve_names_its_field(tmp_path: Path) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text(
        "device_types:\n"
        "  gpu:\n"
        "    preset: h100-sxm\n"
        "    measured: {source: bench, gemm: {bf16: [[10, 0.7], [1, 0.5]]}}\n"
        "node_types: {n: {device: gpu, devices: 8, link: {bandwidth_gbit_s: 3600}}}\n"
        "datacenters: [{name: dc, nodes: [{type: n, count: 1}], network: {gbit_s_per_node: 800}}]\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(ClusterSpec, spec)
    assert "device_types.gpu.measured" in str(err.value)
    assert "gemm.bf16: gflop must increase" in str(err.value)
    over = spec.read_text().replace("[[10, 0.7], [1, 0.5]]", "[[1, 1.5]]")
    spec.write_text(over)
    with pytest.raises(SpecError, match="less than or equal to 1"):
        load_spec(ClusterSpec, spec)
