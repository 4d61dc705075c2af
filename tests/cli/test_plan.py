"""``dmsc plan`` as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import pytest

from dmsc.planner.plan import Plan

if TYPE_CHECKING:
    from conftest import DmscRunner

# Each test runs `dmsc` as a process (a second or more each).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-cpu.yaml")
NSF = str(ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml")
SELENE = str(ROOT / "examples" / "clusters" / "a100-selene.yaml")


def test_plan_json_and_file_validate_against_the_schema(tmp_path: Path, dmsc: DmscRunner) -> None:
    out = tmp_path / "plan.json"
    res = dmsc(
        "plan",
        "--cluster",
        LOCAL,
        "--model",
        "gpt-mini",
        "--global-batch",
        "8",
        "--tp",
        "1",
        "--pp",
        "3",
        "--dp",
        "1",
        "--out",
        str(out),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    for key in ("iteration_time_s", "strategy", "stages", "paths", "solver", "search_seconds"):
        assert key in summary
    assert summary["solver"] == "milp" and summary["optimal"]
    assert len(summary["stages"]) == 3
    schema = json.loads(dmsc("schema", "plan").stdout)
    document = json.loads(out.read_text())
    jsonschema.validate(document, schema)
    plan = Plan.model_validate(document)
    assert plan.schema_version == "dmsc.plan/1"
    # Every stage has a SID, its devices are distinct, and every crossing has a path.
    assert len({s.sid for s in plan.stages}) == 3
    devices = [d for s in plan.stages for r in s.replicas for d in r.devices]
    assert len(devices) == len(set(devices))
    crossings = sum(
        a.datacenter != b.datacenter for a, b in zip(plan.stages, plan.stages[1:], strict=False)
    )
    assert len(plan.paths) == crossings


def test_a_diloco_plan_puts_its_replicas_in_two_datacenters(
    tmp_path: Path, dmsc: DmscRunner
) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-mini", "--cluster", LOCAL, "--global-batch", "16"]
    args += ["--micro-batch", "4", "--tp", "1", "--pp", "1", "--dp", "2", "--sync", "diloco:10"]
    res = dmsc(*args, "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["sync"] == {
        "mode": "diloco",
        "inner_steps": 10,
        "compress": "none",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }
    assert summary["traffic_bytes"]["dp"] > 0
    document = json.loads(out.read_text())
    jsonschema.validate(document, json.loads(dmsc("schema", "plan").stdout))
    plan = Plan.model_validate(document)
    assert (
        len({rep.datacenter for rep in plan.stages[0].replicas}) == 2
    )  # where `dmsc up` puts them
    text = dmsc(*args).stdout
    assert "2 islands (whole pipelines)" in text and "sync diloco:10" in text


def test_plan_searches_the_strategy_and_compares_solvers(tmp_path: Path, dmsc: DmscRunner) -> None:
    png = tmp_path / "gantt.png"
    res = dmsc(
        "plan",
        "--cluster",
        NSF,
        "--model",
        "llama3-8b",
        "--global-batch",
        "64",
        "--gpus",
        "256",
        "--compare",
        "--gantt",
        str(png),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["strategy"]["tp"] * out["strategy"]["pp"] * out["strategy"]["dp"] == 256
    assert {r["solver"] for r in out["compare"]} == {
        "milp",
        "tabu",
        "greedy",
        "compute-first",
        "random",
    }
    best = min(r["pipeline_s"] for r in out["compare"] if not r["blocked"])
    milp = next(r for r in out["compare"] if r["solver"] == "milp")
    assert milp["pipeline_s"] == pytest.approx(best)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["alternatives"]


@pytest.mark.parametrize(
    "case",
    [
        [LOCAL, "--model", "gpt-mini", "--global-batch", "16"],
        # a fixed strategy: the search is another test's; here, 8 runs of the placement
        [
            NSF,
            "--model",
            "llama3-8b",
            "--global-batch",
            "64",
            "--tp",
            "8",
            "--pp",
            "4",
            "--dp",
            "8",
        ],
    ],
)
def test_compare_gives_each_solver_the_figure_its_own_run_gives(
    case: list[str], dmsc: DmscRunner
) -> None:
    args = ["plan", "--cluster", *case, "--time-limit", "5"]
    res = dmsc(*args, "--compare", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["solver"]: r for r in json.loads(res.stdout)["compare"]}
    table = dmsc(*args, "--compare").stdout
    for solver in ("tabu", "greedy", "compute-first"):
        one = dmsc(*args, "--solver", solver)
        assert one.returncode == 0, one.stderr
        # The iteration `--solver` prints is the one in its row of the comparison.
        shown = re.search(r"^iteration (\S+ \S+),", one.stdout, re.M)
        assert shown, one.stdout
        row = next(line for line in table.splitlines() if f" {solver} " in line)
        assert shown.group(1) in row, (solver, row, shown.group(1))
        alone = json.loads(dmsc(*args, "--solver", solver, "--json").stdout)
        assert rows[solver]["iteration_s"] == pytest.approx(alone["iteration_time_s"], rel=1e-9)


def test_plan_table(dmsc: DmscRunner) -> None:
    res = dmsc(
        "plan",
        "--cluster",
        LOCAL,
        "--model",
        "gpt-mini",
        "--global-batch",
        "8",
        "--tp",
        "1",
        "--pp",
        "3",
        "--dp",
        "1",
        "--solver",
        "tabu",
    )
    assert res.returncode == 0, res.stderr
    assert "SID" in res.stdout and "solver tabu" in res.stdout


def test_seeded_plans_repeat(dmsc: DmscRunner) -> None:
    args = (
        "plan",
        "--cluster",
        LOCAL,
        "--model",
        "gpt-mini",
        "--global-batch",
        "8",
        "--tp",
        "1",
        "--pp",
        "3",
        "--dp",
        "1",
        "--solver",
        "random",
        "--seed",
        "7",
        "--json",
    )
    a, b = json.loads(dmsc(*args).stdout), json.loads(dmsc(*args).stdout)
    assert a["stages"] == b["stages"] and a["paths"] == b["paths"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--cluster", SELENE, "--model", "gpt3-175b", "--global-batch", "8", "--gpus", "99999"],
            "asked for 99999 devices",
        ),
        (["--cluster", LOCAL, "--model", "gpt3-175b", "--global-batch", "8"], "no strategy fits"),
        (
            [
                "--cluster",
                LOCAL,
                "--model",
                "gpt-mini",
                "--global-batch",
                "8",
                "--tp",
                "1",
                "--pp",
                "4",
                "--dp",
                "1",
            ],
            "needs 4 devices",
        ),
        (
            [
                "--cluster",
                LOCAL,
                "--model",
                "llama3-8b",
                "--global-batch",
                "8",
                "--tp",
                "1",
                "--pp",
                "3",
                "--dp",
                "1",
            ],
            "GiB per device",
        ),
    ],
)
def test_infeasible_requests_exit_1_with_the_binding_constraint(
    args: list[str], needle: str, dmsc: DmscRunner
) -> None:
    res = dmsc("plan", *args)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert needle in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tp", "2"], "--tp/--pp/--dp"),
        (["--solver", "magic"], "--solver"),
        (["--paths", "0"], "--paths"),
        (["--gpus", "0"], "--gpus"),
        (["--expert-imbalance", "1.2"], "--expert-imbalance"),  # not with a searched strategy
        (["--tp", "1", "--pp", "1", "--dp", "1", "--expert-imbalance", "2"], "more than ep=1"),
    ],
)
def test_bad_plan_flags_exit_2(args: list[str], needle: str, dmsc: DmscRunner) -> None:
    res = dmsc("plan", "--cluster", LOCAL, "--model", "gpt-mini", "--global-batch", "8", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle in res.stderr and "Traceback" not in res.stderr


VISION = str(ROOT / "examples" / "models" / "multitask-vision.yaml")


@pytest.mark.parametrize(
    ("args", "count"),
    [
        (["--model", "gpt3-1.3b", "--stages", "3", "--method", "layer"], 3),
        (["--model", VISION, "--stages", "3", "--method", "block"], 3),
        (["--model", VISION, "--method", "business"], 3),
    ],
)
def test_segment_command(args: list[str], count: int, dmsc: DmscRunner) -> None:
    res = dmsc("segment", "--cluster", SELENE, *args, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["segments"]) == count
    assert out["slowest_s"] == max(s["time_s"] for s in out["segments"])


def test_segment_errors(dmsc: DmscRunner) -> None:
    res = dmsc("segment", "--cluster", SELENE, "--model", "gpt3-1.3b", "--method", "block")
    assert res.returncode == 2 and "kind: blocks" not in res.stdout
    res = dmsc("segment", "--cluster", SELENE, "--model", "gpt3-175b", "--stages", "2")
    assert res.returncode == 1 and "infeasible" in res.stderr


@pytest.mark.parametrize("schedule", [["--schedule", "1f1b"], ["--schedule", "interleaved"]])
def test_the_gantt_chart_ends_at_the_iteration_the_plan_prints(
    schedule: list[str], tmp_path: Path, dmsc: DmscRunner
) -> None:
    png = tmp_path / "g.png"
    interleave = ["--interleave", "2"] if "interleaved" in schedule else []
    args = ["--model", "gpt-mini", "--global-batch", "16", "--micro-batch", "2"]
    fixed = ["--tp", "1", "--pp", "2", "--dp", "1", *schedule, *interleave]
    res = dmsc("plan", "--cluster", LOCAL, *args, *fixed, "--gantt", str(png))
    assert res.returncode == 0, res.stderr
    said = re.search(r"^iteration (\S+ \S+),", res.stdout, re.M)
    drawn = re.search(
        r"^Gantt chart of one iteration \((\S+ \S+)(, interleaved v=2)?\)", res.stdout, re.M
    )
    assert said and drawn, res.stdout
    assert drawn.group(1) == said.group(1)
    assert bool(drawn.group(2)) == bool(interleave)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
