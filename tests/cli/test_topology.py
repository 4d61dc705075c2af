"""``dmsc topology``: list, show (with a plot), generate (a file --topology reads, a fabric's
figures), and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DmscRunner

pytestmark = pytest.mark.integration
PNG = b"\x89PNG\r\n\x1a\n"


def test_list_and_show(tmp_path: Path, dmsc: DmscRunner) -> None:
    res = dmsc("topology", "list", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert (rows["nsfnet"]["nodes"], rows["nsfnet"]["links"]) == (14, 22)
    png = tmp_path / "nsfnet.png"
    res = dmsc("topology", "show", "nsfnet", "--plot", str(png), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["connected"] and len(out["link_list"]) == 22 and out["km_max"] == 2400
    assert png.read_bytes()[:8] == PNG


def test_a_generated_graph_is_a_topology_the_simulator_reads(
    tmp_path: Path, dmsc: DmscRunner
) -> None:
    graph = tmp_path / "ring.csv"
    res = dmsc("topology", "generate", "ring", "--sites", "8", "--seed", "1", "--out",
               str(graph), "--plot", str(tmp_path / "ring.png"), "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (json.loads(res.stdout)["nodes"], json.loads(res.stdout)["links"]) == (8, 8)
    shown = json.loads(dmsc("topology", "show", str(graph), "--json").stdout)
    assert shown["links"] == 8 and shown["degree_max"] == 2
    res = dmsc("simulate", "--lightpaths", "--topology", str(graph), "--loads", "20",
               "--requests", "500", "--warmup", "100", "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["loads"][0]["requests"] == 500


def test_a_fabric_and_bad_input(dmsc: DmscRunner) -> None:
    res = dmsc("topology", "generate", "fat-tree", "--k", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["hosts"] == 16
    for args, needle in [
        (["generate", "fat-tree", "--k", "3"], "even k"),
        (["generate", "torus", "--dims", "4,x"], "--dims"),
        (["generate", "moebius"], "unknown kind"),
        (["show", "atlantis"], "neither a topology"),
    ]:
        res = dmsc("topology", *args)
        err = " ".join(res.stderr.split())
        assert res.returncode == 2 and needle in err and "Traceback" not in err, res.stderr
