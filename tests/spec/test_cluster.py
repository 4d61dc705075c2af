from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.spec import ClusterSpec, SpecError, load_spec

BASE = """
device_types:
  gpu: {peak_tflops: {bf16: 100}, memory_gib: 40, memory_bw_gbyte_s: 1000}
node_types:
  box: {device: gpu, devices: 4, link: {bandwidth_gbit_s: 800}}
datacenters:
  - {name: a, nodes: [{type: box, count: 2}], network: {gbit_s_per_node: 400}}
"""


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_examples_load(selene: ClusterSpec, nsfnet: ClusterSpec, local_cpu: ClusterSpec) -> None:
    assert selene.device_count == 3072
    assert nsfnet.device_count == 4 * 32 * 8
    assert len(nsfnet.links) == 22
    assert all(link.slots == 80 and link.slot_ghz == 12.5 for link in nsfnet.links)
    assert len(local_cpu.datacenters) == 3


def test_minimal_cluster(tmp_path: Path) -> None:
    spec = load_spec(ClusterSpec, _write(tmp_path, BASE))
    assert spec.device_count == 8
    assert spec.datacenters[0].site_name == "a"


@pytest.mark.parametrize(
    ("text", "field", "reason"),
    [
        (
            BASE.replace("device: gpu", "device: tpu"),
            "node_types.box.device",
            "unknown device type",
        ),
        (BASE.replace("devices: 4", "devices: 0"), "node_types.box.devices", "greater than 0"),
        (BASE.replace("memory_gib: 40", "memory_gib: -1"), "memory_gib", "greater than 0"),
        (BASE.replace("type: box", "type: rack"), "datacenters[0].nodes[0].type", "unknown node"),
        (BASE + "colour: red\n", "colour", "unknown field"),
        (BASE.replace("count: 2", "count: two"), "datacenters[0].nodes[0].count", "integer"),
    ],
)
def test_bad_field_is_named(tmp_path: Path, text: str, field: str, reason: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(ClusterSpec, path)
    err = info.value
    assert err.source == str(path)
    assert field in err.field
    assert reason in err.reason
    assert str(path) in err.line() and field in err.line()


def test_link_needs_exactly_one_capacity(tmp_path: Path) -> None:
    text = BASE + (
        "  - {name: b, nodes: [{type: box, count: 1}], network: {gbit_s_per_node: 400}}\n"
        "links:\n  - {a: a, b: b, km: 100, bandwidth_gbit_s: 100, slots: 80}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(ClusterSpec, _write(tmp_path, text))
    assert info.value.field == "links[0]"
    assert "exactly one" in info.value.reason


def test_two_datacenters_need_links(tmp_path: Path) -> None:
    text = BASE + "  - {name: b, nodes: [{type: box, count: 1}], network: {gbit_s_per_node: 400}}\n"
    with pytest.raises(SpecError) as info:
        load_spec(ClusterSpec, _write(tmp_path, text))
    assert info.value.field == "links"


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(ClusterSpec, tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match="invalid YAML"):
        load_spec(ClusterSpec, _write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(SpecError, match="invalid JSON"):
        load_spec(ClusterSpec, _write(tmp_path, "{", name="c.json"))
    with pytest.raises(SpecError, match="mapping"):
        load_spec(ClusterSpec, _write(tmp_path, "- 1\n- 2\n"))


def test_json_spec(tmp_path: Path) -> None:
    import json

    import yaml

    path = _write(tmp_path, json.dumps(yaml.safe_load(BASE)), name="c.json")
    assert load_spec(ClusterSpec, path).device_count == 8


def test_a_named_topology_gives_the_fibers(tmp_path: Path, nsfnet: ClusterSpec) -> None:
    """``topology: {name: nsfnet, slots: 80}`` gives the fibers the example cluster lists one by
    one (its sites and lengths are NSFNET's); an unknown name is refused naming the known."""
    dcs = "\n".join(
        f"  - {{name: {dc.name}, site: '{dc.site}', nodes: [{{type: box, count: 2}}], "
        "network: {gbit_s_per_node: 400}}"
        for dc in nsfnet.datacenters
    )
    text = BASE.split("datacenters:")[0] + "datacenters:\n" + dcs + "\n"
    named = load_spec(ClusterSpec, _write(tmp_path, text + "topology: {name: nsfnet, slots: 80}\n"))
    key = sorted((x.a, x.b, x.km, x.slots) for x in named.links)
    assert key == sorted((x.a, x.b, x.km, x.slots) for x in nsfnet.links)
    with pytest.raises(SpecError, match=r"topology.name: unknown topology 'atlantis' \(known: "):
        load_spec(ClusterSpec, _write(tmp_path, text + "topology: {name: atlantis, slots: 8}\n"))
    with pytest.raises(SpecError, match="exactly one of bandwidth_gbit_s or slots"):
        load_spec(ClusterSpec, _write(tmp_path, text + "topology: {name: nsfnet}\n"))
