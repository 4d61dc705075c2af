"""A training task's reply compares its measured step with the prediction for the job that
ran (issue 29, point 5: `dmsc train --batch 32` was compared with the batch-16 prediction); the
task of the plan's job refits the cluster spec, which `dmsc calibrate --from-run` writes and
`dmsc plan --calibrated` plans on (issue 32, point 6)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from runtime_helpers import MEASURED_CPU, control_plane

from dmsc.cli import main
from dmsc.data.calibrations import run_fits
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration
LOCAL = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "local-cpu.yaml"
FIGURES = MEASURED_CPU


def test_a_task_of_another_batch_is_compared_with_its_own_prediction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = resolve_model("gpt-mini")
    cluster = ClusterSpec.model_validate(calibrated_cluster(load_spec(ClusterSpec, LOCAL), FIGURES))
    job = JobSpec(global_batch=4, micro_batch=2, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, model, job, fixed=True).plan
    with control_plane(plan, tmp_path) as cp:
        cp.cluster = cluster  # the plan's cluster spec known: its tasks refit it
        own = cp.train(TrainRequest(steps=2))
        assert own["predicted_step_s"] == plan.prediction.iteration_time_s
        assert own["prediction"] == "the plan's" and own["not_comparable"] is None
        cp.cluster = None  # the plan's cluster spec unknown: nothing to re-estimate on
        other = cp.train(TrainRequest(steps=1, batch=8))
        assert other["predicted_step_s"] is None
        assert other["not_comparable"].startswith("not comparable: the plan predicts batch 4")
        cp.cluster = cluster
        other = cp.train(TrainRequest(steps=1, batch=8))
        again = cp.train(TrainRequest(steps=2))  # the plan's job again: pooled with the first
    job8 = JobSpec.model_validate({**job.model_dump(), "global_batch": 8, "micro_batch": 4})
    want = plan_job(cluster, model, job8, fixed=True).plan.prediction.iteration_time_s
    assert other["predicted_step_s"] == want > plan.prediction.iteration_time_s
    assert other["prediction"].startswith("re-estimated for batch 8 in 2 micro-batches at dp 1")
    # the task of the plan's job was fitted; those without the spec or of another job were not
    fits = run_fits(cp.db, cp.run.id)
    assert [(f.task_id, f.spec_json is not None) for f in fits] == [
        (again["task"], True), (other["task"], False), (other["task"] - 1, False),
        (own["task"], True),
    ]  # fmt: skip
    assert fits[1].reason is not None and fits[1].reason.startswith("the task ran batch 8")
    assert fits[2].reason is not None and "has no spec of cluster" in fits[2].reason
    assert fits[3].measured_step_s == own["median_step_s"]
    assert fits[3].predicted_before_s == pytest.approx(plan.prediction.iteration_time_s, rel=1e-3)
    assert fits[3].predicted_after_s == pytest.approx(own["median_step_s"], rel=1e-3)
    # the second task of the plan's job learnt from the first as well: its 2 steps and the
    # first's (no warm-up left out of 2), not the other job's
    assert json.loads(fits[0].fit_json)["pooled"] == [own["task"]]
    steps = [m.step_s for t in (own["task"], again["task"]) for m in cp.db.metrics(t)]
    assert fits[0].measured_step_s == pytest.approx(statistics.median(steps))
    # written by `dmsc calibrate --from-run`, planned on by `dmsc plan --calibrated`
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    monkeypatch.delenv("DMSC_DATABASE_URL", raising=False)
    spec_file, refit = tmp_path / "cluster.yaml", tmp_path / "refit.yaml"
    spec_file.write_text(yaml.safe_dump(cluster.model_dump(mode="json", exclude_none=True)))
    for args in (
        ["calibrate", "--from-run", str(cp.run.id), "--out", str(refit)],
        ["plan", "--cluster", str(spec_file), "--model", "gpt-mini", "--global-batch", "4",
         "--micro-batch", "2", "--tp", "1", "--pp", "3", "--dp", "1", "--schedule", "1f1b",
         "--calibrated", "--out", str(tmp_path / "plan2.json")],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as done:
            main(args)
        assert not done.value.code, capsys.readouterr().err
    said = " ".join(capsys.readouterr().out.split())
    assert (
        f"recalibrated from run {cp.run.id}, task {again['task']} pooled with task {own['task']}"
        in said
    )
    assert ClusterSpec.model_validate(yaml.safe_load(refit.read_text())).name == cluster.name
    replanned = Plan.model_validate_json((tmp_path / "plan2.json").read_text())
    assert replanned.prediction.iteration_time_s == pytest.approx(fits[0].measured_step_s, rel=1e-2)
