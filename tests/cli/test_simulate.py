"""``dmsc simulate``: the scenario's knobs from the command line (--k, --fit, --slots, --mix,
--guard-band, --modulations), and the lightpath experiment (--lightpaths)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from conftest import DmscRunner

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml"
CLUSTER = ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml"
RUN = ("--compare", "baseline,cba", "--arrivals", "60", "--loads", "3", "--json")

pytestmark = pytest.mark.integration


def _results(out: dict[str, Any]) -> dict[str, Any]:
    """The figures of every scheduler, without the wall-clock ones."""
    return {
        name: {k: v for k, v in s.items() if k != "wall_s"} for name, s in out["schedulers"].items()
    }


def test_flags_act_as_the_edited_scenario_file(tmp_path: Path, dmsc: DmscRunner) -> None:
    """The flags give the same figures as a scenario file edited by hand, and differ from the
    file's own settings."""
    cluster = yaml.safe_load(CLUSTER.read_text())
    for link in cluster["links"]:
        link["slots"] = 24
    (tmp_path / "narrow.yaml").write_text(yaml.safe_dump(cluster))
    scenario = yaml.safe_load(SCENARIO.read_text())
    scenario.update(
        cluster="narrow.yaml", k_paths=1, fit="best", guard_band=1, modulations="optical-rl-gym"
    )
    scenario["jobs"] = [
        {**scenario["jobs"][1], "weight": 2.0},
        scenario["jobs"][3],
    ]
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(scenario))

    flags = ("--k", "1", "--fit", "best", "--slots", "24", "--mix", "gpt3-13b=2,llama3-70b",
             "--guard-band", "1", "--modulations", "optical-rl-gym")  # fmt: skip
    by_flags = dmsc("simulate", "--scenario", str(SCENARIO), *flags, *RUN)
    by_file = dmsc("simulate", "--scenario", str(edited), *RUN)
    plain = dmsc("simulate", "--scenario", str(SCENARIO), *RUN)
    for res in (by_flags, by_file, plain):
        assert res.returncode == 0, res.stderr
    a, b, c = (json.loads(r.stdout) for r in (by_flags, by_file, plain))
    assert _results(a) == _results(b)
    assert _results(a) != _results(c)
    assert (a["k_paths"], a["fit"], a["slots"], a["guard_band"]) == (1, "best", 24, 1)
    assert a["modulations"] == "optical-rl-gym" and c["guard_band"] == 0
    assert a["jobs"] == [
        {"job": "gpt3-13b/pp8", "weight": 2.0},
        {"job": "llama3-70b/pp8", "weight": 0.2},
    ]
    assert (c["k_paths"], c["fit"], c["slots"], len(c["jobs"])) == (3, "first", 80, 4)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--k", "0"], "--k: must be between 1 and 10"),
        (["--k", "11"], "--k: must be between 1 and 10"),
        (["--fit", "worst"], "--fit: expected one of first, best, last, random, exact"),
        (["--guard-band", "-1"], "--guard-band: must be between 0 and 64"),
        (["--modulations", "nope"], "--modulations: 'nope' is neither a table"),
        (["--slots", "0"], "--slots: must be between 1 and 10000"),
        (["--mix", "gpt9"], "no job type 'gpt9'"),
        (["--mix", "gpt3-13b=x"], "NAME=WEIGHT"),
        (["--mix", "gpt3-13b=-1"], "must be a positive number"),
    ],
)
def test_bad_overrides_exit_2_naming_the_flag(
    args: list[str], needle: str, dmsc: DmscRunner
) -> None:
    res = dmsc("simulate", "--scenario", str(SCENARIO), "--arrivals", "5", *args)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and needle in err and "Traceback" not in err, res.stderr


def test_lightpaths_as_the_rmsa_literature_runs_them(tmp_path: Path, dmsc: DmscRunner) -> None:
    """``--lightpaths``: per load and fit, service and bandwidth blocking with 95% intervals
    over the seeds, the requests counted (after the warm-up), fragmentation and per-fiber
    utilisation; one chart of every fit, fragmentation over time, a spectrum heat map."""
    png = tmp_path / "blocking.png"
    res = dmsc("simulate", "--lightpaths", "--topology", "nsfnet", "--slots", "100", "--k", "5",
               "--guard-band", "1", "--modulations", "optical-rl-gym", "--bitrate",
               "uniform:25:100", "--loads", "100,400", "--requests", "1500", "--warmup", "500",
               "--seeds", "2", "--fit", "first,last", "--plot", str(png), "--json",
               "--fragmentation", str(tmp_path / "frag.png"), "--heatmap",
               str(tmp_path / "heat.png"), "--snapshot-at", "1200")  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["topology"], out["guard_band"], out["modulations"]) == (
        "nsfnet", 1, "optical-rl-gym",
    )  # fmt: skip
    assert sorted(out["fits"]) == ["first", "last"] and out["loads"] == out["fits"]["first"]
    for rows in out["fits"].values():
        low, high = rows
        assert (low["load"], high["load"]) == (100, 400)
        assert low["requests"] == high["requests"] == 2 * 1500
        assert 0 <= low["service_blocking"] < high["service_blocking"] < 1
        assert high["service_blocking"] <= high["bandwidth_blocking"] < 1
        assert low["ci95"] >= 0 and low["bandwidth_ci95"] >= 0 and low["us_per_request"] > 0
        assert 0 < high["external_fragmentation"] < 1 and high["spectrum_entropy"] > 0
        assert len(high["link_utilization"]) == len(out["links"]) == 22
    for chart in (png, tmp_path / "frag.png", tmp_path / "heat.png"):
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bitrate", "uniform:0:3"], "--bitrate: uniform:0:3 needs 0 < low <= high"),
        (["--topology", "nowhere"], "--topology: 'nowhere' is neither a topology"),
        (["--fit", "first,worst"], "--fit: unknown fit 'worst'"),
        (["--guard-band", "100"], "--guard-band: must be 0 or more, below --slots"),
        (["--requests", "0"], "--requests: must be between 1"),
        (["--snapshot-at", "99"], "--snapshot-at: must be a request of the run"),
    ],
)
def test_bad_lightpath_flags_exit_2_naming_the_flag(
    args: list[str], needle: str, dmsc: DmscRunner
) -> None:
    res = dmsc("simulate", "--lightpaths", "--requests", "10", "--warmup", "0", *args)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and needle in err and "Traceback" not in err, res.stderr
