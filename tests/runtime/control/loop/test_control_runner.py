"""The control loop's runner on a real database (a control plane stand-in, no workers): a row and
a log line per decision, a move deferred while a task holds the lock and applied after, its
measured effect, advise mode, alerts with the exception queue; the webhook against a real HTTP
server on 127.0.0.1; and the policy file checked at the boundary (``dmsc up``'s flags:
tests/cli/test_control_flags.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from modules_helpers import fill_run, make_plan, stand_in_plane, two_sites
from prometheus_client import CollectorRegistry

from dmsc.cli.control_flags import loop_line
from dmsc.data.control_records import alerts, decisions
from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import Measurements, Proposal
from dmsc.runtime.control.loop import runner
from dmsc.runtime.control.loop.objectives import Policy, load_policy, with_flags
from dmsc.runtime.control.loop.runner import ControlLoop
from dmsc.runtime.control.loop.tick import LoopConfig
from dmsc.runtime.control.loop.views import with_loop, with_loop_status
from dmsc.runtime.control.loop.webhook import Webhook
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.transport.replies import LoopState
from dmsc.spec import SpecError


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(two_sites())


class Mover:
    name = "mover"
    description = reads = proposes = "test"

    def __init__(self, gain: float) -> None:
        self.gain = gain

    def propose(self, m: Measurements) -> list[Proposal]:
        if self.gain <= 0:
            return []
        now = m.metrics[-1].step_s
        return [Proposal("mover", "move-stage", "stage 1", "faster there", self.gain, now, 1.0)]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _plane(tmp_path: Path, plan: Plan, step_s: float = 1.0) -> tuple[Any, int]:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, task = fill_run(db, two_sites(), plan, steps=10, step_s=lambda s: step_s)
    cp = stand_in_plane(db, run, plan)
    return cp, task


def _loop(cp: Any, policy: Policy, mode: str, modules: list[Any]) -> tuple[ControlLoop, Lines]:
    log = logging.getLogger(f"test-loop-{id(cp)}")
    lines = Lines()
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    return ControlLoop(cp, LoopConfig(policy, mode), 1.0, log, modules), lines


def test_a_move_waits_for_the_lock_then_applies_and_its_effect_is_measured(
    tmp_path: Path, plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp, task = _plane(tmp_path, plan, step_s=1.0)
    moved: list[str] = []

    def fake_move(_cp: Any, _traces: Any, p: Proposal) -> dict[str, Any]:
        moved.append(p.target)
        return {"target": p.target, "move_s": 0.25}

    monkeypatch.setattr(runner, "apply_move", fake_move)
    mover = Mover(gain=0.5)
    loop, lines = _loop(cp, Policy(confirm_ticks=1), "act", [mover])
    with cp.lock:  # a training task holds the deployment: the tick does not wait
        t0 = time.perf_counter()
        loop.once()
        assert time.perf_counter() - t0 < 5
    rows = [d for d in decisions(cp.db, cp.run.id) if d.module == "mover"]
    assert [(d.verdict, d.outcome[:8]) for d in rows] == [("apply", "deferred")]
    assert moved == []
    loop.once()  # the lock is free: the pending move is applied
    (row,) = [d for d in decisions(cp.db, cp.run.id) if d.module == "mover"]
    assert moved == ["stage 1"] and row.outcome == "applied in 0.2 s"
    assert (row.task_before, row.step_before_s) == (task, 1.0)
    mover.gain = 0  # the new placement: nothing more to move
    # the next training task's first steps measure the effect
    nxt = cp.db.new_task(cp.run.id, "train", {"steps": 5}, state="running").id
    for step, s in enumerate([0.4, 0.6, 0.5]):
        cp.db.add_metric(nxt, step, 3.0, s, 100.0)
    loop.once()
    (row,) = [d for d in decisions(cp.db, cp.run.id) if d.module == "mover"]
    assert (row.task_after, row.step_after_s) == (nxt, 0.5)
    # one log line per decision row, and the outcome and the effect logged after
    assert sum(line.startswith(f"control decision {row.id}: apply") for line in lines.lines) == 1
    assert any("measured effect: step 0.500 s" in line for line in lines.lines)
    assert loop.cost.ticks == 3 and loop.cost.cpu_s > 0


class Pool:
    """An elastic serving pool whose replica start sees what the database holds by then."""

    def __init__(self, cp: Any) -> None:
        self.cp, self.alerts_then, self.replicas = cp, -1, 1

    def count(self) -> int:
        return self.replicas

    def scale_out(self, reason: str) -> str:
        self.alerts_then = len(alerts(self.cp.db, self.cp.run.id))
        self.replicas += 1
        return f"serve-{self.replicas - 1}"


def test_the_gateways_latencies_break_the_inference_objective_and_the_alert_precedes_its_action(
    tmp_path: Path, plan: Plan
) -> None:
    """The latencies come from the router (the gateway's requests are no task rows), and the
    alert is written when the breach is seen, before the replica it asks for starts (which
    takes seconds): its time is the detection's, its outcome follows."""
    cp, _ = _plane(tmp_path, plan)
    pool = Pool(cp)
    since: list[float] = []
    cp.inference = SimpleNamespace(
        in_flight=lambda: 0,
        pool=pool,
        answered_since=lambda s: since.append(s) or [2.5] * 10,
    )
    policy = Policy.model_validate(
        {"slos": {"infer_p99_s": {"max": 1.0, "action": "scale-out"}}, "window_s": 60}
    )
    loop, _ = _loop(cp, policy, "act", [])
    t0 = time.time()
    loop.once()
    assert since and abs(since[0] - (t0 - 60)) < 5  # the policy's window
    (alert,) = alerts(cp.db, cp.run.id)
    assert (alert.slo, alert.value) == ("infer_p99_s", 2.5)
    assert pool.alerts_then == 1  # the alert was in the database before the replica started
    assert alert.action_outcome == "added serving replica serve-1"


class Hook(BaseHTTPRequestHandler):
    answers: ClassVar[list[int]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []
    delay_s: ClassVar[float] = 0.0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(type(self).delay_s)
        type(self).bodies.append(body)
        code = type(self).answers.pop(0) if type(self).answers else 200
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[str]:
    Hook.answers, Hook.bodies, Hook.delay_s = [], [], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def _wait(predicate: Any, seconds: float = 10.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_advise_proposes_and_a_breach_alerts_queues_and_posts(
    tmp_path: Path, plan: Plan, hook: str
) -> None:
    cp, task = _plane(tmp_path, plan, step_s=1.0)
    Hook.answers = [503]  # the first post fails: retried
    policy = Policy.model_validate(
        {"slos": {"step_time_s": 0.5}, "webhook": hook, "confirm_ticks": 1}
    )
    loop, lines = _loop(cp, policy, "advise", [Mover(gain=0.5)])
    loop.webhook = Webhook(hook, loop._webhook_done, first_backoff_s=0.05)
    loop.once()
    rows = {d.module: d for d in decisions(cp.db, cp.run.id)}
    assert rows["mover"].outcome == "proposed (advise: not applied)"
    breach = rows["control-loop"]
    assert (breach.verdict, breach.target) == ("raise", "slo:step_time_s")
    (alert,) = alerts(cp.db, cp.run.id)
    assert (alert.slo, alert.value, alert.objective, alert.task_id) == (
        "step_time_s",
        1.0,
        0.5,
        task,
    )
    (exc,) = TaskQueue(cp.db, cp.run.id).exceptions()
    assert alert.exception_task == exc.id and exc.exception_type == "SLOBreach"
    sent = _wait(
        lambda: (
            alerts(cp.db, cp.run.id)[0].webhook.startswith("sent") and alerts(cp.db, cp.run.id)[0]
        )
    )
    assert sent.webhook == "sent (attempt 2)"
    assert [b["alert"]["id"] for b in Hook.bodies] == [alert.id, alert.id]
    assert any(line.startswith(f"alert {alert.id}: step_time_s") for line in lines.lines)
    loop.once()  # still broken: not raised again
    assert len(alerts(cp.db, cp.run.id)) == 1
    # the dashboard's part: settings, cost, decisions and alerts (a tenant's reader sees the
    # task at fault only when it is its own)
    doc = with_loop(lambda tenant: {"tasks": [{"id": task}] if tenant == "own" else []}, loop)
    control = doc(None)["control"]
    assert control["mode"] == "advise" and control["cost"]["ticks"] == 2
    assert control["slos"] == {"step_time_s": {"max": 0.5, "action": "alert"}}
    assert control["open_alerts"] == 1 and control["alerts"][0]["task"] == task
    assert {d["module"] for d in control["decisions"]} == {"mover", "control-loop"}
    assert doc("other")["control"]["alerts"][0]["task"] is None
    assert doc("own")["control"]["alerts"][0]["task"] == task
    # dmsc status's part: the newest decision (the exception raised), the open alert
    status = with_loop_status(lambda req: {"run": cp.run.id}, loop)(None)
    state = LoopState.model_validate(status["control"])
    assert (state.mode, state.ticks, state.open_alerts) == ("advise", 2, 1)
    assert state.last_decision is not None
    assert "raise control-loop exception (slo:step_time_s) -> raised: task" in state.last_decision
    line = loop_line(state)
    assert line.startswith("control loop: every 1 s, advise mode, 2 ticks, 1 open alert; last")
    loop.close()


def test_the_webhook_never_blocks_and_gives_up_as_it_says(hook: str) -> None:
    done: list[tuple[int, str]] = []
    Hook.delay_s = 1.0
    slow = Webhook(hook, lambda i, o: done.append((i, o)), attempts=2, first_backoff_s=0.05)
    t0 = time.perf_counter()
    assert slow.send(1, {"n": 1})
    assert time.perf_counter() - t0 < 0.1  # queued, not posted, by the caller's thread
    _wait(lambda: done)
    assert done == [(1, "sent")]
    Hook.delay_s, Hook.answers = 0.0, [400]
    slow.send(2, {"n": 2})
    _wait(lambda: len(done) == 2)
    assert done[1] == (2, "failed: HTTP 400 (not retried)") and len(Hook.bodies) == 2
    slow.close(1.0)
    dead = Webhook("http://127.0.0.1:9/none", lambda i, o: done.append((i, o)), attempts=2,
                   first_backoff_s=0.05)  # fmt: skip
    dead.send(3, {})
    _wait(lambda: len(done) == 3)
    assert done[2][1].startswith("failed: ConnectError") and done[2][1].endswith("after 2 attempts")
    dead.close(1.0)


def test_a_wrong_policy_names_file_field_and_reason(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("slos:\n  error_rate: {max: 5}\n")
    with pytest.raises(SpecError) as err:
        load_policy(bad)
    assert str(err.value).startswith(f"{bad}: slos") and "at most 1" in str(err.value)
    bad.write_text("slos:\n  step_time: 0.5\n")
    with pytest.raises(SpecError) as err:
        load_policy(bad)
    assert "step_time" in err.value.field and "step_time_s" in err.value.reason
    bad.write_text("slos:\n  infer_p99_s: {max: 1, action: move}\n")
    with pytest.raises(SpecError, match="action 'move' does not serve it"):
        load_policy(bad)
    with pytest.raises(SpecError) as err:
        with_flags(Policy(), ["step_time_s=fast"], None)
    assert err.value.field == "--slo"
    ok = with_flags(
        Policy(), ["step_time_s=0.5", "infer_p99_s=2:scale-out"], "http://127.0.0.1:1/x"
    )
    assert ok.slos.step_time_s is not None and ok.slos.step_time_s.max == 0.5
    assert ok.slos.infer_p99_s is not None and ok.slos.infer_p99_s.action == "scale-out"


def test_a_breach_whose_policy_names_scale_out_adds_a_serving_replica(
    tmp_path: Path, plan: Plan
) -> None:
    cp, _ = _plane(tmp_path, plan)
    asked: list[str] = []
    cp.inference.pool = SimpleNamespace(
        scale_out=lambda reason: asked.append(reason) or "serve-1", count=lambda: 2
    )
    for _ in range(3):  # three inference requests of 20 ms or more
        infer = cp.db.new_task(cp.run.id, "infer", {}, state="running").id
        time.sleep(0.02)
        cp.db.set_task_state(infer, "done")
    policy = Policy.model_validate({"slos": {"infer_p99_s": {"max": 0.01, "action": "scale-out"}}})
    loop, _ = _loop(cp, policy, "act", [])
    loop.once()
    (alert,) = alerts(cp.db, cp.run.id)
    assert alert.slo == "infer_p99_s" and alert.value >= 0.02 and alert.task_id is None
    assert alert.action_outcome == "added serving replica serve-1"
    assert asked == [f"policy: infer_p99_s {alert.value:.3g} > 0.01"]
    assert TaskQueue(cp.db, cp.run.id).exceptions() == []  # no task at fault: no exception
    assert loop.last["serving_replicas"] == 2


def test_the_policy_s_dp_min_bounds_the_shrink_after_a_lost_node(
    tmp_path: Path, plan: Plan
) -> None:
    """A task that lost replicas for good shrinks no lower than the policy's elastic dp_min
    (:mod:`dmsc.runtime.control.training.shrink`); without ``elastic``, to 1."""
    from dmsc.runtime.control.training.shrink import Shrink

    cp, _ = _plane(tmp_path, plan)
    cp.shrink = Shrink(cp)
    _loop(cp, Policy(), "advise", [])
    assert cp.shrink.dp_min == 1
    cp.metrics = CollectorRegistry()  # the loop's metrics, registered afresh
    _loop(cp, Policy.model_validate({"elastic": {"dp_min": 2, "dp_max": 4}}), "advise", [])
    assert cp.shrink.dp_min == 2


class Resizer:
    """A module that proposes a resize of dp between tasks."""

    name = "elastic-dp"
    description = reads = proposes = "test"

    def propose(self, m: Measurements) -> list[Proposal]:
        dp = {"current": 2, "proposed": 1}
        return [Proposal("elastic-dp", "resize-dp", "dp 2->1", "devices lost", 1.0, 1.0, 0.5,
                         {"dp": dp, "online": {"site-a": 2, "site-b": 2}})]  # fmt: skip


def test_a_resize_while_a_failed_shrink_left_no_deployment_is_skipped_and_says_so(
    tmp_path: Path, plan: Plan
) -> None:
    """A failed shrink stopped every worker (``undeployed``): a resize between tasks is skipped
    with the reason in its decision row, nothing re-planned or checkpointed (before, it re-planned
    and failed at the stopped deployment's checkpoint: a ``failed`` outcome); the loop's own
    resize proposals are a ``keep`` note while it lasts. Once deployed again, the resize
    re-plans on the devices online the proposal saw."""
    from dmsc.runtime.control.loop.moves import resize_now
    from dmsc.runtime.control.loop.resizing import NO_DEPLOYMENT
    from dmsc.runtime.control.loop.snapshot import devices

    cp, task = _plane(tmp_path, plan)
    cp.db.set_task_state(task, "done")  # between tasks: the lock is free
    cp.undeployed = "no workers since replica(s) [1] were lost"
    asked: list[tuple[int, Any]] = []

    def resized(dp: int, online: Any = None) -> Plan:
        asked.append((dp, online))
        return plan

    def relayout(new: Plan, action: str, why: str) -> None:
        raise RuntimeError("checkpoint: the deployment is stopped")

    cp.resized, cp.relayout = resized, relayout
    cp.inference.paused = lambda why, timeout_s: contextlib.nullcontext(0)  # none in flight
    loop, lines = _loop(cp, Policy(confirm_ticks=1), "act", [Resizer()])
    loop.once()
    (row,) = [d for d in decisions(cp.db, cp.run.id) if d.kind == "resize-dp"]
    assert row.outcome == f"not applied: {NO_DEPLOYMENT} ({cp.undeployed})"
    assert asked == [] and any(NO_DEPLOYMENT in line for line in lines.lines)
    # the loop's own proposals: blocked, with the same words
    cp.cluster = two_sites()
    m = Measurements(cp.run.id, plan, time.time())
    view = devices(cp, plan, 2, m)
    assert view is not None and view.blocked == f"{NO_DEPLOYMENT} ({cp.undeployed})"
    # deployed again: the resize re-plans on the devices online it was proposed for
    cp.undeployed = None
    cp.relayout = lambda new, action, why: None
    resize_now(cp, Resizer().propose(m)[0])
    assert asked == [(1, {"site-a": 2, "site-b": 2})]


def test_the_modules_heavy_imports_are_made_before_the_first_tick(
    tmp_path: Path, plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path optimisation's first re-plan imported the planner's solvers (OR-Tools, pandas:
    4.1 s of a tick) while training ran, and the task's steps ran up to twice as slow
    meanwhile: the loop's thread imports them as it starts, before it waits for a tick; an
    import that fails is logged and the loop goes on."""
    cp, _ = _plane(tmp_path, plan)
    loop, lines = _loop(cp, Policy(), "act", [])
    order: list[str] = []
    assert "dmsc.planner.solve" in runner.WARM  # what paths.replan imports
    monkeypatch.setattr(runner, "WARM", ("dmsc.planner.solve", "dmsc.no_such_module"))
    real = runner.importlib.import_module
    monkeypatch.setattr(runner.importlib, "import_module", lambda n: (order.append(n), real(n))[1])
    stopped = threading.Event()
    monkeypatch.setattr(loop, "once", lambda: (order.append("tick"), stopped.set()))
    loop.interval_s = 0.01
    loop.run(stopped)
    assert order == ["dmsc.planner.solve", "dmsc.no_such_module", "tick"]
    assert any("importing dmsc.no_such_module failed" in line for line in lines.lines)
