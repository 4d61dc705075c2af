"""The deployment examples under deploy/ stay what the README says they are."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_kuberay_cluster_gives_each_worker_group_its_datacenter_resource() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "kuberay-raycluster.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    pinned = next(
        line.split("==")[1].strip('",')
        for line in (ROOT / "pyproject.toml").read_text().split()
        if line.startswith('"ray==')
    )
    assert doc["spec"]["rayVersion"] == pinned
    groups = doc["spec"]["workerGroupSpecs"]
    assert len(groups) >= 2
    for group in groups:
        # KubeRay passes the value to `ray start --resources` as a JSON string inside quotes
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert resources == {f"dc:{group['groupName']}": 8}, group["groupName"]
