"""``dmsc plan --tp 2 --pp 2 --dp 1``, then ``dmsc up``, ``status``, ``train`` and ``infer`` as a
user runs them on ``two-sites-cpu.yaml``: four worker processes, two tensor-parallel ranks per
stage."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import EXAMPLES
from runtime_helpers import dmsc

from dmsc.planner.plan import Plan


def test_plan_up_status_train_with_tp2_pp2(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    args = ["--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2"]
    strategy = ["--tp", "2", "--pp", "2", "--dp", "1", "--out", str(plan)]
    cluster = str(EXAMPLES / "two-sites-cpu.yaml")
    res = dmsc(tmp_path, "plan", "--cluster", cluster, *args, *strategy)
    assert res.returncode == 0, res.stderr
    refused = dmsc(tmp_path, "up", "--plan", str(plan))  # sequence parallel: not run
    assert refused.returncode == 2 and "job.sequence_parallel" in refused.stderr
    res = dmsc(tmp_path, "plan", "--cluster", cluster, *args, *strategy, "--no-sequence-parallel")
    assert res.returncode == 0, res.stderr
    job = Plan.model_validate_json(plan.read_text()).job
    assert (job.tp, job.pp, job.dp, job.sequence_parallel) == (2, 2, 1, False)
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        sids = sorted(s["sid"] for s in status["services"])
        assert len(sids) == 4 and all(s["health"] == "ok" for s in status["services"])
        assert [sid.rsplit("-", 2)[1:] for sid in sids] == [["r0", "t0"], ["r0", "t1"]] * 2
        res = dmsc(tmp_path, "train", "--steps", "3", "--json")
        assert res.returncode == 0, res.stderr
        *progress, last = [json.loads(line) for line in res.stdout.splitlines()]
        assert [p["step"] for p in progress] == [0, 1, 2] and last["steps"] == 3
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "5")
        assert res.returncode == 0 and res.stdout.startswith("def "), res.stderr
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
