"""Residency rules in a cluster spec: validation (file, field, reason) and the pure checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.spec import ClusterSpec, SpecError, load_spec
from dmsc.spec.residency import (
    ResidencyError,
    ResidencySpec,
    allowed_datacenters,
    check_dataset_read,
    check_model_placement,
    check_model_store,
)

TWO_DCS = """
device_types:
  gpu: {peak_tflops: {bf16: 100}, memory_gib: 40, memory_bw_gbyte_s: 1000}
node_types:
  box: {device: gpu, devices: 4, link: {bandwidth_gbit_s: 800}}
datacenters:
  - {name: eu, nodes: [{type: box, count: 2}], network: {gbit_s_per_node: 400}}
  - {name: us, nodes: [{type: box, count: 2}], network: {gbit_s_per_node: 400}}
links:
  - {a: eu, b: us, km: 6000, bandwidth_gbit_s: 100}
"""

RULES = """
residency:
  home: eu
  rules:
    - name: patients-stay-in-eu
      datasets: [/data/patients]
      models: [medllm, "tiny@3"]
      datacenters: [eu]
"""


def _load(tmp_path: Path, text: str) -> ClusterSpec:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_spec(ClusterSpec, path)


def test_a_residency_section_loads(tmp_path: Path) -> None:
    res = _load(tmp_path, TWO_DCS + RULES).residency
    assert res is not None and res.home == "eu"
    assert [r.name for r in res.model_rules("medllm")] == ["patients-stay-in-eu"]
    assert res.model_rules("tiny") and not res.model_rules("tiny", 2)  # tiny@3: version 3 only
    assert not res.model_rules("other")


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        (("datacenters: [eu]", "datacenters: [asia]"), "residency.rules[0].datacenters[0]",
         "unknown datacenter 'asia'"),
        (("home: eu", "home: mars"), "residency.home", "unknown datacenter 'mars'"),
        (("datacenters: [eu]", "datacenters: []"), "residency.rules[0].datacenters",
         "at least 1 item"),
        (("datasets: [/data/patients]", "datasets: [data/patients]"), "residency.rules[0]",
         "not an absolute path"),
        (('"tiny@3"', '"tiny@latest"'), "residency.rules[0]", "not NAME or NAME@VERSION"),
        (("      datasets: [/data/patients]\n      models: [medllm, \"tiny@3\"]\n", ""),
         "residency.rules[0]", "at least one dataset or model"),
        (("datacenters: [eu]", "datacentres: [eu]"), "residency.rules[0].datacentres",
         "did you mean datacenters"),
        (("      datasets: [/data/patients]\n", "      derived: true\n"), "residency.rules[0]",
         "derived: holds data computed from datasets; the rule names none"),
    ],
)  # fmt: skip
def test_a_bad_rule_is_named_by_file_field_and_reason(
    tmp_path: Path, change: tuple[str, str], field: str, reason: str
) -> None:
    text = TWO_DCS + RULES.replace(*change)
    with pytest.raises(SpecError) as info:
        _load(tmp_path, text)
    assert info.value.source.endswith("c.yaml")
    assert info.value.field == field
    assert reason in info.value.reason


def test_duplicate_rule_names_are_refused(tmp_path: Path) -> None:
    rule = "    - {name: r, models: [m], datacenters: [eu]}\n"
    with pytest.raises(SpecError) as info:
        _load(tmp_path, TWO_DCS + "residency:\n  rules:\n" + rule + rule)
    assert info.value.field == "residency.rules[1].name"


def _res() -> ResidencySpec:
    return ResidencySpec.model_validate(
        {
            "home": "us",
            "rules": [
                {"name": "eu-data", "datasets": ["/data/patients", "/lake/*.eu.txt"],
                 "datacenters": ["eu", "ch"]},
                {"name": "no-us", "models": ["med*"], "datacenters": ["eu", "ch", "uk"]},
                {"name": "swiss", "models": ["medllm"], "datacenters": ["ch"]},
            ],
        }
    )  # fmt: skip


def test_datasets_match_by_path_folder_and_glob() -> None:
    res = _res()
    assert res.dataset_rules("/data/patients/a.txt")  # a file in the folder
    assert res.dataset_rules("/data")  # a folder holding the dataset reads it too
    assert res.dataset_rules("/lake/x.eu.txt")
    assert not res.dataset_rules("/lake/x.us.txt")
    assert not res.dataset_rules("/data/patients-public")


def test_each_check_names_the_rule_it_breaks() -> None:
    res = _res()
    check_dataset_read(res, "/data/patients/a.txt", ["eu", "ch"], "task 1")
    with pytest.raises(ResidencyError, match=r"'eu-data'.*datacenter us") as info:
        check_dataset_read(res, "/data/patients/a.txt", ["eu", "us"], "task 1")
    assert info.value.rule == "eu-data"
    check_model_placement(res, "medllm", ["ch"], "the move")
    with pytest.raises(ResidencyError, match=r"'swiss'.*datacenter eu"):
        check_model_placement(res, "medllm", ["ch", "eu"], "the move")
    with pytest.raises(ResidencyError, match=r"'no-us'.*datacenter us"):
        check_model_store(res, "medbert", "a checkpoint")
    check_model_store(res, "gpt", "a checkpoint")  # no rule names it
    check_model_store(None, "medllm", "a checkpoint")  # no residency section


def test_allowed_datacenters_intersect_every_rule() -> None:
    res = _res()
    assert allowed_datacenters(res, "medllm", ["eu", "us", "ch"]) == (
        frozenset({"ch"}),
        ("no-us", "swiss"),
    )
    assert allowed_datacenters(res, "gpt", ["eu", "us"]) == (frozenset({"eu", "us"}), ())
