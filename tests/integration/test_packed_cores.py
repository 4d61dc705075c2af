"""A deployment on a cluster spec whose devices share this machine's cores (``shared_cores``,
as ``dmsc calibrate`` writes it) with more workers than cores: each worker process runs on the
core the packing gave its stage (read back from the kernel), the busiest stage alone, and the
deployment trains."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest
import yaml
from runtime_helpers import MEASURED_CPU, dmsc

from dmsc.data.db import Database
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute import cpuset
from dmsc.runtime.compute.calibrate import calibrated_cluster
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

pytestmark = pytest.mark.integration
LOCAL = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "local-cpu.yaml"


def test_workers_run_on_the_cores_they_were_packed_onto(tmp_path: Path) -> None:
    mine = sorted(cpuset.available() or [])
    if len(mine) < 2:
        pytest.fail("this test needs a machine of two cores or more (the project's has two)")
    figures = {**MEASURED_CPU, "cores": 2.0}
    cluster = ClusterSpec.model_validate(calibrated_cluster(load_spec(ClusterSpec, LOCAL), figures))
    assert cluster.shared_cores == 2
    job = JobSpec(global_batch=4, micro_batch=2, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    # two cores, as on the project's machine, wherever the test runs: the packing takes the
    # cores the control plane may run on
    os.sched_setaffinity(0, mine[:2])
    cp = ControlPlane(plan, Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}"), home=tmp_path,
                      cluster=cluster)  # fmt: skip
    try:
        cp.start()
        packed = cp.deployment.layout.cpus
        busiest = max(plan.stages, key=lambda st: st.microbatch_s).index
        assert sorted(packed) == [(0, 0), (1, 0), (2, 0)]
        assert [k for k, v in packed.items() if v == packed[(busiest, 0)]] == [(busiest, 0)]
        assert {c for v in packed.values() for c in v} == set(mine[:2])
        for h in cp.deployment.handles:
            assert (
                psutil.Process(h.process.pid).cpu_affinity()
                == packed[(h.config.stage, h.config.replica)]
            )
        assert cp.train(TrainRequest(steps=2))["median_step_s"] > 0
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()
        os.sched_setaffinity(0, mine)


def test_dmsc_up_says_in_its_log_the_cores_its_workers_run_on(tmp_path: Path) -> None:
    """The control log's ``workers' cores`` line, through ``dmsc up --cluster`` as a user runs
    it, names the core each worker process runs on (read back from the kernel)."""
    mine = sorted(cpuset.available() or [])
    if len(mine) < 2:
        pytest.fail("this test needs a machine of two cores or more (the project's has two)")
    figures = {**MEASURED_CPU, "cores": 2.0}
    cluster = calibrated_cluster(load_spec(ClusterSpec, LOCAL), figures)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster, sort_keys=False))
    spec = ClusterSpec.model_validate(cluster)
    job = JobSpec(global_batch=4, micro_batch=2, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(spec, resolve_model("gpt-mini"), job, fixed=True).plan
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    os.sched_setaffinity(0, mine[:2])  # the control plane `dmsc up` starts inherits two cores
    try:
        res = dmsc(tmp_path, "up", "--plan", str(tmp_path / "plan.json"), "--cluster",
                   str(tmp_path / "c.yaml"))  # fmt: skip
    finally:
        os.sched_setaffinity(0, mine)
    assert res.returncode == 0, res.stderr
    try:
        line = next(
            json.loads(x)["msg"]
            for x in (tmp_path / "logs" / "control.log").read_text().splitlines()
            if "workers' cores" in x
        )
        said = {
            (int(m[1]), int(m[2])): [int(m[3])]
            for m in re.finditer(r"stage (\d+)/(\d+) on \[(\d+)\]", line)
        }
        assert sorted(said) == [(0, 0), (1, 0), (2, 0)]
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        for s in status["services"]:
            pid = s["pid"]
            assert psutil.Process(pid).cpu_affinity() == said[(s["stage"], s["replica"])]
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
