"""``dmsc modules list`` and ``dmsc replan --dry-run`` as a user runs them, on a database of
measurements in the test's own data directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from modules_helpers import TWO_SITES, fill_run, make_plan, two_sites

from dmsc.data.db import Database

if TYPE_CHECKING:
    from conftest import DmscRunner

# Each test runs `dmsc` as a process (a second or more each).
pytestmark = pytest.mark.integration


def _database(home: Path) -> Database:
    return Database(f"sqlite:///{home / 'dmsc.sqlite'}")


def test_modules_list_names_what_each_reads_and_proposes(dmsc: DmscRunner) -> None:
    out = dmsc("modules", "list", "--json")
    assert out.returncode == 0, out.stderr
    modules = {m["name"]: m for m in json.loads(out.stdout)["modules"]}
    assert list(modules) == ["traffic", "paths", "policy"]
    assert modules["policy"]["proposes"] == "exception"
    assert all(m["reads"] and m["description"] for m in modules.values())
    table = dmsc("--wide", "modules", "list")
    assert table.returncode == 0 and "move-stage" in table.stdout


def test_replan_without_dry_run_needs_the_running_deployment(dmsc: DmscRunner) -> None:
    out = dmsc("replan")
    assert out.returncode == 2 and "not running" in out.stderr
    assert "Traceback" not in out.stderr
    out = dmsc("replan", "--run", "3")
    assert out.returncode == 2 and "--run" in out.stderr and "--dry-run only" in out.stderr


def test_replan_with_no_run_says_so(dmsc: DmscRunner) -> None:
    out = dmsc("replan", "--dry-run")
    assert out.returncode == 0 and "no run" in out.stdout
    assert json.loads(dmsc("replan", "--dry-run", "--json").stdout)["decisions"] == []
    assert dmsc("replan", "--dry-run", "--run", "7").returncode == 2


def test_replan_dry_run_shows_the_proposal_and_the_decision(
    dmsc: DmscRunner, dmsc_home: Path, tmp_path: Path
) -> None:
    cluster = two_sites()
    plan = make_plan(cluster)
    slow = 3 * plan.prediction.iteration_time_s
    fill_run(_database(dmsc_home), cluster, plan, steps=20, compute_scale={1: 3.0},
             step_s=lambda s: slow)  # fmt: skip
    # two-sites-cpu's CPU figures are guesses: its step time is not compared with them
    guessed = json.loads(dmsc("replan", "--dry-run", "--json").stdout)
    assert guessed["predicted_step_s"] is None and "device type cpu" in guessed["not_comparable"]
    assert "policy" not in {d["module"] for d in guessed["decisions"]}
    # the same cluster as measured (its kernel overhead the one the cost model assumed)
    data = yaml.safe_load(TWO_SITES.read_text())
    data["device_types"]["cpu"]["op_overhead_us"] = 5.0
    measured = tmp_path / "two-sites-cpu.yaml"
    measured.write_text(yaml.safe_dump(data))
    given = ("--cluster", str(measured))
    out = dmsc("replan", "--dry-run", "--json", *given)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["dry_run"] is True and doc["cluster"] == "two-sites-cpu"
    by_module: dict[str, list[dict[str, object]]] = {}
    for d in doc["decisions"]:
        by_module.setdefault(str(d["module"]), []).append(d)
    (move,) = by_module["paths"]
    assert (move["kind"], move["verdict"]) == ("move-stage", "apply")
    assert "within the horizon" in str(move["why"])
    (breach,) = by_module["policy"]
    assert (breach["target"], breach["verdict"]) == ("slo:step-time", "raise")
    assert {d["target"] for d in by_module["traffic"]} >= {"boundary 0->1", "step time"}

    assert doc["predicted_step_s"] == plan.prediction.iteration_time_s
    refused = dmsc("replan", "--dry-run", "--json", "--horizon-steps", "50", *given)
    refused = json.loads(refused.stdout)
    (move,) = [d for d in refused["decisions"] if d["module"] == "paths"]
    assert move["verdict"] == "refuse"

    table = dmsc("--wide", "replan", "--dry-run", *given)
    assert table.returncode == 0, table.stderr
    assert "Dry run: nothing applied" in table.stdout
    assert "move-stage" in table.stdout and "apply" in table.stdout
    assert "slo:step-time" in table.stdout


def test_replan_asks_for_the_cluster_it_cannot_find(
    dmsc: DmscRunner, dmsc_home: Path, tmp_path: Path
) -> None:
    renamed = yaml.safe_load(TWO_SITES.read_text()) | {"name": "far-away"}
    spec = tmp_path / "far.yaml"
    spec.write_text(yaml.safe_dump(renamed))
    cluster = two_sites().model_copy(update={"name": "far-away"})
    fill_run(_database(dmsc_home), cluster, make_plan(cluster), steps=8)
    out = dmsc("replan", "--dry-run")
    assert out.returncode == 2
    assert "far-away" in out.stderr and "--cluster PATH" in out.stderr
    given = dmsc("replan", "--dry-run", "--json", "--cluster", str(spec))
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["cluster"] == "far-away"
