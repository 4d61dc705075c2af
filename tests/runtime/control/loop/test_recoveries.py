"""A worker the runtime replaced is visible to the loop (.recoveries): one alert with the SIDs,
the cause and the time to recover, one decision row noting it, a log line and a webhook post,
on a real database; and lost devices as the tick's own alert (tick.device_breaches)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from modules_helpers import fill_run, make_plan, stand_in_plane, two_sites

from dmsc.data.control_records import alerts, decisions
from dmsc.data.db import Database, FaultRecord
from dmsc.runtime.control.advisors.base import FaultInfo
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.recoveries import describe, judge
from dmsc.runtime.control.loop.resizing import DeviceView
from dmsc.runtime.control.loop.runner import ControlLoop
from dmsc.runtime.control.loop.tick import LoopConfig, device_breaches


def _fault(i: int, detected: float, recovered: float | None, kind: str = "worker") -> FaultInfo:
    return FaultInfo(kind, "worker 1/0 did not answer", detected, recovered, 0, i, "s-1-0")


def test_judge_raises_each_new_worker_fault_once_and_resolves_the_open_ones() -> None:
    faults = [
        _fault(1, 50.0, 51.0),  # before the control plane started: not new
        _fault(2, 120.0, 120.2),
        _fault(3, 130.0, None),  # not recovered (no checkpoint verified)
        _fault(4, 140.0, 140.5, kind="checkpoint"),  # not a replacement
    ]
    new, back = judge(faults, alerted=(), open_=(), since_s=100.0)
    assert [f.id for f in new] == [2, 3] and back == []
    recovered = [*faults[:2], _fault(3, 130.0, 131.0)]
    new, back = judge(recovered, alerted=(2, 3), open_=(3,), since_s=100.0)
    assert new == [] and [f.id for f in back] == [3]
    reason, outcome = describe(faults[1])
    assert outcome == "recovered by the runtime in 0.20 s"
    assert reason.startswith("worker(s) s-1-0 lost and replaced: worker 1/0 did not answer")
    assert describe(faults[2])[1].startswith("not recovered")


class Posts:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, alert: int, body: Any) -> None:
        self.sent.append(alert)

    def close(self, wait_s: float) -> None:
        pass


def test_a_replaced_worker_raises_an_alert_a_decision_a_log_line_and_a_post(
    tmp_path: Path,
) -> None:
    plan = make_plan(two_sites())
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, task = fill_run(db, two_sites(), plan, steps=10, step_s=lambda s: 1.0)
    cp = stand_in_plane(db, run, plan)
    log = logging.getLogger("test-recoveries")
    log.setLevel(logging.INFO)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    policy = Policy.model_validate({"webhook": "http://127.0.0.1:9/hook"})
    loop = ControlLoop(cp, LoopConfig(policy, "act"), 1.0, log, [])
    posts = Posts()
    loop.webhook = posts  # type: ignore[assignment]
    loop.fault_alerts.post = loop._post
    loop.once()
    assert alerts(db, run) == []  # nothing lost yet
    now = time.time()
    db.add(FaultRecord(
        run_id=run, task_id=task, kind="worker", services="r1-s1-0", reason="stage 1 exited",
        detected_at=now - 0.3, recovered_at=now - 0.1, checkpoint_step=5, steps_lost=2,
    ))  # fmt: skip
    loop.once()
    (alert,) = alerts(db, run)
    assert alert.slo == "fault:worker" and abs(alert.value - 0.2) < 1e-6
    assert alert.task_id == task and alert.resolved_at is not None
    assert "r1-s1-0" in alert.reason and "stage 1 exited" in alert.reason
    assert "recovered by the runtime in 0.20 s" in alert.reason
    (row,) = [d for d in decisions(db, run) if d.module == "recovery"]
    assert (row.verdict, row.target, row.outcome) == (
        "note", "r1-s1-0", "recovered by the runtime in 0.20 s",
    )  # fmt: skip
    assert posts.sent == [alert.id]
    said = f"alert {alert.id}: fault:worker: worker(s) r1-s1-0"
    assert any(line.startswith(said) for line in lines)
    loop.once()  # seen once: not raised again
    assert len(alerts(db, run)) == 1 and posts.sent == [alert.id]
    # the modules ran on the first tick only (nothing new since): the loop's own counter
    assert cp.metrics.get_sample_value("dmsc_control_loop_module_runs_total") == 1.0


def test_devices_short_of_the_replicas_are_an_alert_while_they_last() -> None:
    held = ({"a": 1, "b": 1}, {"a": 1, "b": 1})
    view = DeviceView(2, 2, held, {"a": 2, "b": 1}, "the Ray cluster's nodes")
    (breach,) = device_breaches(view)
    assert (breach.slo, breach.value, breach.action) == ("devices", 1.0, "alert")
    assert "b short of 1" in breach.reason
    assert device_breaches(DeviceView(2, 2, held, {"a": 2, "b": 2}, "spec")) == []
    assert device_breaches(None) == []
