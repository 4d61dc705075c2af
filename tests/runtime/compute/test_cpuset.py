"""Nodes sharing one machine, each on cores of its own (a cluster spec's ``cpus``,
:mod:`dmsc.runtime.compute.cpuset`): the spec, the cores each stage replica gets, the node CPU
% over a cpuset's cores only, and ``dmsc up`` refusing cores it cannot keep (exit 2, the
field named, before anything starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from dmsc.cli.app import main
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.training.session import layout_from_plan
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "examples" / "clusters" / "local-cpu.yaml"


def _pinned(cores: list[list[int] | None]) -> ClusterSpec:
    """local-cpu with its three datacenters' nodes on ``cores`` (None: not pinned)."""
    spec = load_spec(ClusterSpec, LOCAL).model_dump(exclude_none=True)
    for dc, cpus in zip(spec["datacenters"], cores, strict=True):
        if cpus is not None:
            dc["nodes"][0]["cpus"] = cpus
    return ClusterSpec.model_validate(spec)


def test_a_node_group_s_cores_are_distinct_and_numbered_as_the_topology_numbers_nodes() -> None:
    spec = _pinned([[0], None, [1, 0]])
    assert spec.node_cpus() == [[0], None, [1, 0]]
    with pytest.raises(ValueError, match="a core is named twice"):
        _pinned([[0, 0], None, None])
    with pytest.raises(ValueError, match="cpus"):
        _pinned([[], None, None])


def test_each_stage_replica_runs_on_its_node_s_cores() -> None:
    model = resolve_model("gpt-mini")
    spec = _pinned([[0], None, [1]])
    plan = plan_job(spec, model, JobSpec(global_batch=8, micro_batch=2, pp=3), fixed=True).plan
    where = {st.index: st.replicas[0].nodes for st in plan.stages}
    layout = layout_from_plan(plan, model, spec=spec)
    want = {0: [0], 2: [1]}
    assert {s: layout.cpus.get((s, 0)) for s in where} == {s: want.get(where[s][0]) for s in where}
    assert layout_from_plan(plan, model).cpus == {}  # no spec: nothing pinned


def test_a_pinned_worker_reads_its_node_s_cpu_over_its_own_cores() -> None:
    """A process pinned to core 0 counts core 0's CPU seconds only (psutil's per-core counters
    as the reference), and its node has one core (on a one-core machine: the machine's)."""
    code = (
        "import psutil\n"
        "from dmsc.runtime.compute import cpuset\n"
        "cpuset.pin([0])\n"
        "busy, total = cpuset.node_cpu_times()\n"
        "t = psutil.cpu_times(percpu=True)[0]\n"
        "ref = sum(t) - t.guest - t.guest_nice\n"
        "print(cpuset.node_cores(), sorted(psutil.Process().cpu_affinity()), total, ref)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cores, affinity, total, ref = out.stdout.split(maxsplit=3)
    assert cores == "1" and affinity == "[0]"
    assert float(total) == pytest.approx(float(ref), rel=0.01)
    if (psutil.cpu_count() or 1) > 1:  # with more cores, not the machine's sum
        assert float(total) < 0.75 * sum(psutil.cpu_times()) - 1


def _up(tmp_path: Path, spec: ClusterSpec, *more: str) -> str:
    plan = plan_job(spec, resolve_model("gpt-mini"), JobSpec(global_batch=8, micro_batch=2, pp=2),
                    fixed=True).plan  # fmt: skip
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    doc = spec.model_dump(mode="json", exclude_none=True)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "c.yaml"),
              *more])  # fmt: skip
    assert exit_.value.code == 2
    return str(exit_.value)


def test_dmsc_up_refuses_cores_this_machine_lacks_and_a_launcher_that_cannot_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # no control plane, should it get far
    _up(tmp_path, _pinned([None, [4095], None]))
    err = capsys.readouterr().err
    assert "c.yaml: datacenters[1].nodes[0].cpus: core(s) [4095] are not among" in err
    assert "Traceback" not in err
    _up(tmp_path, _pinned([[0], None, None]), "--launcher", "ray")
    err = capsys.readouterr().err
    assert "datacenters[0].nodes[0].cpus: pins a node to cores of this machine" in err
    assert not (tmp_path / "home" / "control.json").exists()  # nothing started
