"""``dmsc plan --schedule interleaved --interleave 2 --pp 2``, then ``dmsc up``, ``train`` and
``down`` as a user runs them on ``two-sites-cpu.yaml``: two worker processes, each holding its
two chunks of gpt-mini (issue 31, point 4; ``dmsc up`` used to refuse the plan)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import EXAMPLES
from runtime_helpers import dmsc

from dmsc.planner.plan import Plan


def test_plan_up_train_down_interleaved(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    args = ["--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2"]
    strategy = ["--tp", "1", "--pp", "2", "--dp", "1", "--schedule", "interleaved"]
    cluster = str(EXAMPLES / "two-sites-cpu.yaml")
    res = dmsc(
        tmp_path,
        "plan",
        "--cluster",
        cluster,
        *args,
        *strategy,
        "--interleave",
        "2",
        "--out",
        str(plan),
    )
    assert res.returncode == 0, res.stderr
    stages = Plan.model_validate_json(plan.read_text()).stages
    assert [len(st.chunks) for st in stages] == [2, 2]
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        res = dmsc(tmp_path, "train", "--steps", "2", "--json")
        assert res.returncode == 0, res.stderr
        *progress, last = [json.loads(line) for line in res.stdout.splitlines()]
        assert [p["step"] for p in progress] == [0, 1] and last["steps"] == 2
        assert last["loss_last"] < last["loss_first"]
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
