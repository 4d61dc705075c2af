"""A training request is resolved once, when it is submitted (issue 30, must-have 2): the task
stores its parameters and its run starts from them, so a ``--dp`` task runs the planner once and
a ``--data`` task reads its text once (before: twice each, at the check and again at the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import control_plane, one_box

from dmsc.data import corpus
from dmsc.planner import solve
from dmsc.planner.solve import plan_job
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration


def test_a_dp_task_on_its_own_data_plans_once_and_reads_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = load_spec(ClusterSpec, one_box(tmp_path, 4))
    job = JobSpec(global_batch=8, micro_batch=2, pp=2, dp=1)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 300)
    calls: dict[str, int] = {"plan_job": 0, "text_from": 0}

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(solve, "plan_job", counted("plan_job", solve.plan_job))
    monkeypatch.setattr(corpus, "text_from", counted("text_from", corpus.text_from))
    with control_plane(plan, tmp_path) as cp:
        cp.cluster = cluster
        out = cp.train(TrainRequest(steps=2, dp=2, data=str(text), checkpoint_every=0))
        assert out["state"] == "done" and out["steps"] == 2
        assert cp.plan.job.dp == 2  # it ran at dp 2
    assert calls == {"plan_job": 1, "text_from": 1}
