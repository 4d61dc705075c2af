"""``dmsc plan --tp 2 --pp 2 --dp 1``, then ``dmsc up``, ``status``, ``train`` and ``infer`` as a
user runs them on ``two-sites-cpu.yaml``: four worker processes, two tensor-parallel ranks per
stage, with the sequence parallelism such a plan asks for; the same steps without it give the
same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXAMPLES
from runtime_helpers import dmsc

from dmsc.planner.plan import Plan


def _train(home: Path, plan: Path) -> list[float]:
    """``dmsc up`` of ``plan``, its four ranks and their telemetry checked, 3 steps trained
    (their losses), a prompt answered, ``dmsc down``."""
    res = dmsc(home, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        status = json.loads(dmsc(home, "status", "--json").stdout)
        sids = sorted(s["sid"] for s in status["services"])
        assert len(sids) == 4 and all(s["health"] == "ok" for s in status["services"])
        assert [sid.rsplit("-", 2)[1:] for sid in sids] == [["r0", "t0"], ["r0", "t1"]] * 2
        # every rank's own process use, not only each replica's first rank's (they were None)
        pids = {s["pid"] for s in status["services"]}
        assert len(pids) == 4 and all(s["rss_bytes"] > 50 << 20 for s in status["services"])
        res = dmsc(home, "train", "--steps", "3", "--json")
        assert res.returncode == 0, res.stderr
        *progress, last = [json.loads(line) for line in res.stdout.splitlines()]
        assert [p["step"] for p in progress] == [0, 1, 2] and last["steps"] == 3
        res = dmsc(home, "infer", "--prompt", "def ", "--tokens", "5")
        assert res.returncode == 0 and res.stdout.startswith("def "), res.stderr
        return [float(p["loss"]) for p in progress]
    finally:
        assert dmsc(home, "down").returncode == 0


def test_plan_up_status_train_with_tp2_pp2(tmp_path: Path) -> None:
    args = ["--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2"]
    cluster = str(EXAMPLES / "two-sites-cpu.yaml")
    losses = {}
    for name, extra in (("sp", []), ("plain", ["--no-sequence-parallel"])):
        home = tmp_path / name
        home.mkdir()
        plan = home / "plan.json"
        strategy = ["--tp", "2", "--pp", "2", "--dp", "1", "--out", str(plan), *extra]
        res = dmsc(home, "plan", "--cluster", cluster, *args, *strategy)
        assert res.returncode == 0, res.stderr
        job = Plan.model_validate_json(plan.read_text()).job
        assert (job.tp, job.pp, job.dp, job.sequence_parallel) == (2, 2, 1, name == "sp")
        losses[name] = _train(home, plan)
    assert losses["sp"] == pytest.approx(losses["plain"], abs=1e-4)
