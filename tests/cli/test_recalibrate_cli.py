"""``dmsc calibrate --from-run RUN`` and ``dmsc plan --calibrated`` on a database that holds
runs with and without a recalibration (made here from figures, without a deployment: the
control plane's side is tests/integration/test_prediction_compare.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from runtime_helpers import run_figures_on

from dmsc.cli import main
from dmsc.data.calibrations import record_fit, run_fits
from dmsc.data.db import Database
from dmsc.data.traces import add_step_traces
from dmsc.planner.recalibrate import RunFigures, fit_run
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "examples/clusters/local-cpu.yaml"
JOB = ("--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "4")
FIXED = ("--tp", "1", "--pp", "3", "--dp", "1", "--schedule", "1f1b")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


@pytest.fixture
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Database, dict[str, int]]:
    """A database with a run without traces, a traced run whose task was not fitted, and a
    run of local-cpu fitted to figures 1.5 times slower than its plan."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DMSC_DATABASE_URL", raising=False)
    db = Database(f"sqlite:///{tmp_path / 'home' / 'dmsc.sqlite'}")
    cluster = load_spec(ClusterSpec, LOCAL)
    job = JobSpec(global_batch=8, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    ids = {"empty": db.new_run("gpt-mini", "local-cpu", {}).id}
    for name in ("unfitted", "fitted"):
        run_id = db.new_run("gpt-mini", "local-cpu", {}).id
        task = db.new_task(run_id, "train", {}).id
        add_step_traces(db, task, 0, {(0, 0): ([("F", 0, 0.0, 0.1)], {})}, {})
        ids[name], ids[f"{name}_task"] = run_id, task
    record_fit(db, ids["unfitted"], ids["unfitted_task"], "local-cpu", "the task timed no step")
    slower = {s.index: s.microbatch_s * 1.5 for s in plan.stages}
    figures = RunFigures(slower, {}, plan.prediction.iteration_time_s * 1.5, steps=3)
    fit = fit_run(plan, cluster, figures, source="test figures")
    record_fit(db, ids["fitted"], ids["fitted_task"], "local-cpu", fit)
    return db, ids


def test_from_run_refuses_a_run_it_cannot_write_naming_file_field_and_reason(
    runs: tuple[Database, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, ids = runs
    for run_id, reason in (
        (999, "no run 999 in this database"),
        (ids["empty"], f"run {ids['empty']} has no step traces"),
        (ids["unfitted"], f"run {ids['unfitted']} was not recalibrated: the task timed no step"),
    ):
        code, out, err = run(capsys, "calibrate", "--from-run", str(run_id))
        assert code == 2 and out == "", err
        assert "dmsc.sqlite" in err and "--from-run" in err and reason in err
        assert "Traceback" not in err


def test_from_run_writes_the_fit_and_plan_calibrated_plans_on_it(
    runs: tuple[Database, dict[str, int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, ids = runs
    dst = tmp_path / "refit.yaml"
    code, out, err = run(capsys, "calibrate", "--from-run", str(ids["fitted"]), "--out", str(dst))
    assert code == 0, err
    assert f"wrote {dst}: run {ids['fitted']}, task {ids['fitted_task']}" in " ".join(out.split())
    spec = ClusterSpec.model_validate(yaml.safe_load(dst.read_text()))
    before = load_spec(ClusterSpec, LOCAL)
    assert spec.name == "local-cpu"
    speed = (
        spec.device_types["cpu"].peak_tflops["fp32"]
        / before.device_types["cpu"].peak_tflops["fp32"]
    )
    kept = json.loads(run_fits(db, ids["fitted"])[0].fit_json)
    assert speed == pytest.approx(kept["device_speed"]["cpu"])
    assert speed < 1 / 1.5  # every stage and the step 1.5 times slower: the devices more so

    code, out, err = run(capsys, "plan", "--cluster", str(LOCAL), *JOB, *FIXED, "--calibrated",
                         "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert f"recalibrated from run {ids['fitted']}, task {ids['fitted_task']}" in got["calibrated"]
    # the plan on the fit predicts the step the fit was made from
    _, ref_out, _ = run(capsys, "plan", "--cluster", str(LOCAL), *JOB, *FIXED, "--json")
    ref = json.loads(ref_out)["iteration_time_s"]
    assert got["iteration_time_s"] == pytest.approx(ref * 1.5, rel=1e-2)


def test_plan_calibrated_without_a_recalibration_of_the_cluster_exits_2(
    runs: tuple[Database, dict[str, int]], capsys: pytest.CaptureFixture[str]
) -> None:
    other = ROOT / "examples/clusters/two-sites-cpu.yaml"
    code, out, err = run(capsys, "plan", "--cluster", str(other), *JOB, "--calibrated")
    assert code == 2 and out == ""
    assert str(other) in err and "--calibrated" in err and "no recalibration of cluster" in err


def test_plan_calibrated_keeps_the_placement_the_fit_measured_within_the_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose links measured about 8 times slower than the spec: on its fit the search
    re-cuts the layers for a gain within the margin, and ``--calibrated`` keeps the plan the
    run measured (its stages, predicted on the fit) and says why."""
    from dmsc.planner.measured_choice import MARGIN
    from dmsc.planner.recalibrate import iteration_s, scaled

    (tmp_path / "home").mkdir()
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DMSC_DATABASE_URL", raising=False)
    db = Database(f"sqlite:///{tmp_path / 'home' / 'dmsc.sqlite'}")
    cluster, model = load_spec(ClusterSpec, LOCAL), resolve_model("gpt-mini")
    job = JobSpec(global_batch=8, micro_batch=4, pp=3, schedule="1f1b")
    plan = plan_job(cluster, model, job, fixed=True).plan
    true = scaled(cluster, {"cpu": 1.0}, {"dc-0-dc-1": 0.13, "dc-1-dc-2": 0.12})
    figures = run_figures_on(plan, true, model)
    run_id = db.new_run("gpt-mini", "local-cpu", plan.model_dump(mode="json")).id
    task = db.new_task(run_id, "train", {}).id
    record_fit(db, run_id, task, "local-cpu", fit_run(plan, cluster, figures, source="test"))

    code, out, err = run(capsys, "plan", "--cluster", str(LOCAL), *JOB, *FIXED, "--calibrated",
                         "--json")  # fmt: skip
    assert code == 0, err
    got = json.loads(out)
    assert "kept the measured plan's placement" in got["calibrated"], got["calibrated"]
    assert f"within the {MARGIN:.0%} margin" in got["calibrated"]
    assert [st["chunks"] for st in got["stages"]] == [
        [list(c) for c in st.chunks] for st in plan.stages
    ]
    assert got["iteration_time_s"] == pytest.approx(iteration_s(plan, true, model), rel=1e-3)


def test_plan_calibrated_prices_the_routing_a_run_of_the_same_mixture_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recalibrated moe-mini run at ep = 2 whose busiest rank received 1.3 of an even share:
    `dmsc plan --calibrated` on the same model and ep prices that routing and says so; another
    ep, a searched strategy or an explicit --expert-imbalance does not take it."""
    from dataclasses import replace

    (tmp_path / "home").mkdir()
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DMSC_DATABASE_URL", raising=False)
    db = Database(f"sqlite:///{tmp_path / 'home' / 'dmsc.sqlite'}")
    two = ROOT / "examples/clusters/two-sites-cpu.yaml"
    cluster = load_spec(ClusterSpec, two)
    job = JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2, overlap_dp_comm=False)
    plan = plan_job(cluster, resolve_model("moe-mini"), job, fixed=True).plan
    run_id = db.new_run("moe-mini", cluster.name, plan.model_dump(mode="json")).id
    task = db.new_task(run_id, "train", {}).id
    figures = RunFigures({0: plan.stages[0].microbatch_s}, {}, plan.prediction.iteration_time_s)
    fit = replace(fit_run(plan, cluster, figures, source="test figures"), expert_imbalance=1.3)
    record_fit(db, run_id, task, cluster.name, fit)

    moe = ("--model", "moe-mini", "--global-batch", "8", "--micro-batch", "4")
    fixed = ("--tp", "1", "--pp", "1", "--dp", "2", "--ep", "2")
    base = ("plan", "--cluster", str(two), *moe, "--calibrated", "--json")

    def routing(*extra: str) -> tuple[float, str]:
        code, out, err = run(capsys, *base, *extra)
        assert code == 0, err
        return json.loads(out)["expert_imbalance"], err

    learned, err = routing(*fixed)
    assert learned == pytest.approx(1.3) and "1.30 of an even share" in err
    code, out, _ = run(capsys, *base[:-1], *fixed)  # the plan's header names it too
    assert code == 0 and "routing 1.30 of even" in out
    given, err = routing(*fixed, "--expert-imbalance", "1.1")
    assert given == pytest.approx(1.1) and "even share" not in err
    code, out, err = run(capsys, *base, "--tp", "1", "--pp", "1", "--dp", "2", "--ep", "1")
    assert code == 0 and "expert_imbalance" not in json.loads(out)  # another ep: not taken
    code, out, err = run(capsys, *base)  # searched: another ep would route otherwise
    assert code == 0 and json.loads(out).get("expert_imbalance", 1.0) == 1.0
