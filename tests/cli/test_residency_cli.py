"""The residency rules at the command line (issue 33, point 5): a bad rule and a plan that
breaks one are refused before anything runs, exit 2, with the file, field and reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from dmsc.cli.app import main
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
BAD = """
device_types:
  gpu: {peak_tflops: {bf16: 100}, memory_gib: 40, memory_bw_gbyte_s: 1000}
node_types:
  box: {device: gpu, devices: 4, link: {bandwidth_gbit_s: 800}}
datacenters:
  - {name: eu, nodes: [{type: box, count: 2}], network: {gbit_s_per_node: 400}}
residency:
  home: mars
  rules: [{name: r, models: [m], datacenters: [eu]}]
"""


def test_the_cli_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(BAD)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", str(path), "--model", "tiny"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "residency.home" in err and "Traceback" not in err


def test_dmsc_up_refuses_a_plan_a_rule_of_its_cluster_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan made before the rule: ``dmsc up --cluster`` stops before anything starts, exit 2,
    naming the plan, the rule and the datacenter."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # no control plane, should it get far
    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    last = plan.stages[-1].datacenter
    data = cluster.model_dump(mode="json", exclude_none=True)
    data["residency"] = {"rules": [{"name": "gpt-stays", "models": ["gpt-mini"],
                                    "datacenters": [plan.stages[0].datacenter]}]}  # fmt: skip
    (tmp_path / "ruled.yaml").write_text(yaml.safe_dump(data))
    up = ["up", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "ruled.yaml")]
    with pytest.raises(SystemExit) as exit_:
        main(up)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "plan.json: stages: residency rule 'gpt-stays'" in err and last in err
