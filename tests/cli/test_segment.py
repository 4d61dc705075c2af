"""``dmsc segment --method block``: a chain of micro-models, what each reads, cycles refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

if TYPE_CHECKING:
    from conftest import DmscRunner

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-cpu.yaml")
VISION = ROOT / "examples" / "models" / "multitask-vision.yaml"

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_block_groups_are_a_chain_with_their_inputs(stages: int, dmsc: DmscRunner) -> None:
    res = dmsc(
        "segment", "--cluster", LOCAL, "--model", str(VISION), "--method", "block",
        "--stages", str(stages), "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    segments = json.loads(res.stdout)["segments"]
    group = {b: k for k, s in enumerate(segments) for b in s["members"]}
    edges = yaml.safe_load(VISION.read_text())["edges"]
    assert all(group[a] <= group[b] for a, b in edges), "data flows back to an earlier group"
    for k, s in enumerate(segments):
        inputs = sorted({group[a] for a, b in edges if group[b] == k and group[a] != k})
        expected = ", ".join(f"group {g}" for g in inputs) or None
        assert s["reads_from"] == expected
    assert segments[0]["reads_from"] is None
    assert all(s["reads_from"] for s in segments[1:])  # each later group reads something


def test_block_table_shows_what_each_group_reads(dmsc: DmscRunner) -> None:
    res = dmsc(
        "segment", "--cluster", LOCAL, "--model", str(VISION), "--method", "block",
        "--stages", "2",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "reads from" in res.stdout and "group 0" in res.stdout.split("group 1", 1)[1]


@pytest.mark.parametrize("method", ["block", "business"])
def test_a_cyclic_block_graph_is_refused_with_its_cycle(
    method: str, tmp_path: Path, dmsc: DmscRunner
) -> None:
    doc = yaml.safe_load(VISION.read_text())
    doc["edges"].append(["stage3", "stage1"])  # stage1 -> stage2 -> stage3 -> stage1
    model = tmp_path / "cyclic.yaml"
    model.write_text(yaml.safe_dump(doc))
    res = dmsc(
        "segment", "--cluster", LOCAL, "--model", str(model), "--method", method,
        "--stages", "2",
    )  # fmt: skip
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = " ".join(res.stderr.split())
    assert "edges" in err and "cycle" in err and "Traceback" not in err
    assert "stage1 -> stage2 -> stage3 -> stage1" in err
