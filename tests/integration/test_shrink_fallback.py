"""A shrink after a lost node whose smaller layout does not start either: the task fails naming
the cause, the control plane says it has no deployment, and the next training task redeploys on
the devices online from the checkpoint kept, training on as single-process training would
(issue 32 point 5). Real workers on this machine, through a launcher that reports the devices
online and refuses starts while the test says no room is left (the Ray case without a cluster:
tests/integration/test_ray_shrink.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from runtime_helpers import reference_losses

from dmsc.data.corpus import stdlib_text, task_corpora
from dmsc.data.db import Database
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.control.launch.launchers import LocalLauncher, WorkerHandle, WorkerStartError
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.training.restart import NoDeployment
from dmsc.runtime.transport.messages import StatusRequest, TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)
LOST_AFTER = 2  # replica 0's worker goes once step 2 is done; the checkpoint of step 2 is kept


class Cramped(LocalLauncher):
    """This machine's workers; the devices online and whether a new worker finds room are the
    test's to say."""

    def __init__(self) -> None:
        super().__init__()
        self.online = {"site-a": 2, "site-b": 2}
        self.room = True

    def capacity(self) -> dict[str, int]:
        return dict(self.online)

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle:
        if not self.room:
            raise WorkerStartError(f"no node of site-a has room for {cfg.sid}")
        return super().start(cfg, workdir)


def _lose_replica_0(cp: ControlPlane, launcher: Cramped) -> None:
    """Once step ``LOST_AFTER`` is done, replica 0's worker dies with its site-a device, and no
    worker finds room any more."""
    dep = cp.deployment
    real = dep.train_step

    def train_step(step: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = real(step, *args, **kwargs)
        if step == LOST_AFTER and launcher.room:
            victim = dep.handle((0, 0)).process
            os.kill(victim.pid, signal.SIGKILL)
            end = time.monotonic() + 30
            while victim.poll() is None and time.monotonic() < end:
                time.sleep(0.05)
            launcher.online, launcher.room = {"site-a": 1, "site-b": 2}, False
        return out

    dep.train_step = train_step  # type: ignore[method-assign]


def test_a_shrink_that_starts_nothing_leaves_a_said_state_and_the_next_task_redeploys(
    tmp_path: Path,
) -> None:
    spec = load_spec(ClusterSpec, EXAMPLES / "two-sites-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=1, dp=2)
    plan = plan_job(spec, SPEC, job, fixed=True).plan
    assert [r.datacenter for st in plan.stages for r in st.replicas] == ["site-a", "site-a"]
    corpus, _ = task_corpora(None, SPEC.seq, 0, stdlib_text(), None)
    want = reference_losses(SPEC, 0, 1e-3, [corpus.batch(s, 8) for s in range(5)], 1)
    launcher = Cramped()
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    cp = ControlPlane(plan, db, home=tmp_path, launcher=launcher, cluster=spec)
    try:
        cp.start()
        _lose_replica_0(cp, launcher)
        with pytest.raises(NoDeployment) as failed:
            cp.train(TrainRequest(steps=5, checkpoint_every=2))
        state = cp.status(StatusRequest())
        launcher.room = True  # room again in site-b (site-a still has one device online)
        out = cp.train(TrainRequest(steps=2))
        events = [(e.action, e.replicas_after) for e in db.scale_events(cp.run.id)]
        where = {r.datacenter for st in cp.plan.stages for r in st.replicas}
        got = [m.loss for m in db.metrics(out["task"])]
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()
    said = str(failed.value)
    assert "after losing replica(s) [0]" in said and "dp 1 did not start" in said, said
    assert f"the checkpoint of step {LOST_AFTER} is kept" in said, said
    assert "no workers since replica(s) [0] were lost" in state["undeployed"], state
    assert out["state"] == "done" and "undeployed" not in cp.status(StatusRequest())
    assert events == [("redeploy", 2)]  # the plan's dp, on the two site-b devices online
    assert where == {"site-b"} and cp.plan.job.dp == 2
    # from the checkpoint of step 2: steps 2 and 3 as single-process training's
    assert max(abs(a - b) for a, b in zip(got, want[LOST_AFTER:4], strict=True)) < 1e-4
