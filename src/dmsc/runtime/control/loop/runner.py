"""The control loop as it runs in the control plane: a thread that ticks every ``interval_s``.

Each tick (:meth:`ControlLoop.once`) takes a snapshot (:mod:`.snapshot`), runs the pure tick
over it (:mod:`.tick`) and acts on the result:

- every new decision is one row in ``control_decisions`` and one line in the control log. A move
  accepted in ``act`` mode (steady: :mod:`.hysteresis`) is applied (:func:`.moves.apply_move`)
  when the plane's task lock is free, that is between training tasks: the loop never waits for
  the lock, a move it cannot take now is ``deferred`` and tried again at the next tick (a
  resize of dp is handed to the running task instead: :mod:`.moves`). The
  move restarts the workers, so it first waits for the inference requests in flight
  (:mod:`.moves`); requests still running then defer it too, and none is cut. In ``advise``
  mode it is only ``proposed``. An applied move's effect is measured afterwards: the median
  step time of the task it was measured on against the first steps of the next training task,
  written into the same row;
- an exception (a breach with a task at fault) goes into the exception queue;
- a log line of a worker or of the control plane that shows a failure (out of memory, NCCL or
  gloo, a checkpoint) raises an alert too (:mod:`.symptoms`), and so does each worker the
  runtime replaced, with a decision row that notes it (:mod:`.recoveries`);
- a newly broken objective is one row in ``alerts`` and one line in the log, written when the
  tick sees the breach, then the policy's action (``scale-out``: one more serving replica,
  when ``dmsc up --autoscale`` made a pool; its outcome written into the row once the replica
  serves) and a post to the policy's webhook (queued, from its own thread: :mod:`.webhook`);
  an objective that holds again resolves its alert.

The loop's cost is measured on every tick (wall and CPU time of the tick's thread) and kept
in :attr:`ControlLoop.cost` and the control plane's Prometheus metrics
(``dmsc_control_loop_tick_seconds``, ``dmsc_control_loop_cpu_seconds_total``, and
``dmsc_control_loop_module_runs_total``: the ticks that ran the modules). A tick that fails is
logged and the loop goes on.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
from prometheus_client import Counter, Histogram

from dmsc.data.control_records import (
    add_alert,
    add_decision,
    alert_json,
    decisions,
    get_alert,
    set_alert,
    set_decision,
)
from dmsc.data.records import _now
from dmsc.runtime.control.advisors.base import FunctionalModule, Proposal
from dmsc.runtime.control.advisors.orchestrator import Decision
from dmsc.runtime.control.advisors.paths import PathOptimisation
from dmsc.runtime.control.advisors.policy import raise_into_queue
from dmsc.runtime.control.advisors.traffic import TrafficPrediction
from dmsc.runtime.control.loop.hysteresis import after_move
from dmsc.runtime.control.loop.moves import StillServing, apply_move, hand_over, resize_now
from dmsc.runtime.control.loop.recoveries import FaultAlerts
from dmsc.runtime.control.loop.snapshot import Predictions, take
from dmsc.runtime.control.loop.symptoms import LogAlerts, remote_symptoms
from dmsc.runtime.control.loop.tick import (
    Breach,
    LoopConfig,
    LoopState,
    Snapshot,
    TickResult,
    effect_of,
    median_step,
    tick,
)
from dmsc.runtime.control.loop.webhook import Webhook
from dmsc.runtime.transport.logs import log_dir
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec


def loop_modules(cluster: ClusterSpec | None) -> list[FunctionalModule]:
    """The functional modules a tick runs: traffic prediction, and path optimisation with the
    plan's cluster spec (the loop checks the policy's objectives itself)."""
    modules: list[FunctionalModule] = [TrafficPrediction()]
    if cluster is not None:
        modules.append(PathOptimisation(cluster))
    return modules


# Modules the functional modules import on their first run, imported when the loop starts
# instead: path optimisation re-plans with the planner's solvers, whose OR-Tools CP-SAT imports
# pandas (2.2 s of CPU on the 2-core machine, ``python -X importtime``). Imported in the first
# run that found a training task, it took 4.1 s of that tick (py-spy) while the task's steps ran
# up to twice as slow (steps 12-20 of 60 in every run of benchmarks/recalibration.py).
WARM = ("dmsc.planner.solve",)


@dataclass
class Cost:
    """What the loop has cost so far."""

    ticks: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_wall_s: float = 0.0
    last_wall_s: float = 0.0
    modules_ran: int = 0

    def as_json(self) -> dict[str, Any]:
        n = max(1, self.ticks)
        return {
            "ticks": self.ticks,
            "mean_wall_ms": self.wall_s / n * 1e3,
            "mean_cpu_ms": self.cpu_s / n * 1e3,
            "max_wall_ms": self.max_wall_s * 1e3,
            "last_wall_ms": self.last_wall_s * 1e3,
            "ticks_with_modules": self.modules_ran,
        }


@dataclass
class PendingMove:
    decision: int
    proposal: Proposal
    task_before: int | None
    step_before_s: float | None


class ControlLoop:
    """The loop over one control plane ``cp`` (module docstring)."""

    def __init__(
        self,
        cp: Any,
        config: LoopConfig,
        interval_s: float,
        log: logging.Logger,
        modules: list[FunctionalModule] | None = None,
    ) -> None:
        self.cp, self.config, self.interval_s, self.log = cp, config, interval_s, log
        self.modules = modules if modules is not None else loop_modules(cp.cluster)
        self.state = LoopState()
        self.cost = Cost()
        self.predictions = Predictions()
        self.alert_ids: dict[str, int] = {}
        self.pending: PendingMove | None = None
        self.effects: list[tuple[int, int]] = []  # (decision, training task before the move)
        self.last: dict[str, Any] = {}
        self._tried_now = False  # a move was tried at this tick already
        self._ticking = threading.Lock()
        shrink, el = getattr(cp, "shrink", None), config.policy.elastic
        if shrink is not None and el is not None:  # a lost node's shrink keeps dp_min too
            shrink.dp_min = el.dp_min
        self.webhook: Webhook | None = None
        if config.policy.webhook is not None:
            self.webhook = Webhook(config.policy.webhook, self._webhook_done)
        post = self._post if self.webhook else None
        since = psutil.Process().create_time()  # faults of this process's time are new
        self.fault_alerts = FaultAlerts(cp.db, cp.run.id, log, config.mode, since, post)
        home = getattr(cp, "home", None)  # the logs' folder: alerts on failure symptoms
        self.log_alerts = None
        if home is not None:  # what they gained since this process started (.symptoms)
            self.log_alerts = LogAlerts(
                log_dir(home), cp.db, cp.run.id, log, post, since, remote_symptoms(cp, since)
            )
        reg = getattr(cp, "metrics", None)
        self.m_tick = Histogram(
            "dmsc_control_loop_tick_seconds",
            "Control loop tick (wall time)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=reg,
        )
        self.m_cpu = Counter(
            "dmsc_control_loop_cpu_seconds_total", "CPU time of the loop's ticks", registry=reg
        )
        self.m_alerts = Counter("dmsc_control_alerts_total", "Alerts raised", ["slo"], registry=reg)
        self.m_runs = Counter(
            "dmsc_control_loop_module_runs_total", "Ticks that ran the modules", registry=reg
        )

    # -- the thread ----------------------------------------------------------------------------
    def run(self, stopped: threading.Event) -> None:
        """Tick every ``interval_s`` until ``stopped``; a failed tick is logged, not fatal.
        The modules' heavy imports are made first (:data:`WARM`), while the workers start."""
        for name in WARM:
            try:
                importlib.import_module(name)
            except Exception:  # the tick that needs it will say why
                self.log.exception("control loop: importing %s failed", name)
        while not stopped.wait(self.interval_s):
            try:
                self.once()
            except Exception:
                self.log.exception("control loop: the tick failed")

    def start(self, stopped: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stopped,), name="control-loop")
        thread.daemon = True
        thread.start()
        return thread

    def close(self) -> None:
        if self.webhook is not None:
            self.webhook.close(wait_s=2.0)

    def as_json(self) -> dict[str, Any]:
        """The loop's settings, cost and last snapshot, for the dashboard."""
        return {
            "interval_s": self.interval_s,
            "mode": self.config.mode,
            "slos": {k: v.model_dump() for k, v in self.config.policy.slos.set().items()},
            "webhook": self.config.policy.webhook is not None,
            "cost": self.cost.as_json(),
            "last": self.last,
        }

    def status_json(self) -> dict[str, Any]:
        """The loop in a few fields for ``dmsc status``: its interval and mode, its ticks, the
        open alerts and its newest decision (one read of the database)."""
        newest = decisions(self.cp.db, self.cp.run.id, 1)
        last = None
        if newest:
            d = newest[0]
            last = f"{d.id}: {d.verdict} {d.module} {d.kind} ({d.target})"
            last += f" -> {d.outcome}" if d.outcome else ""
        return {
            "interval_s": self.interval_s,
            "mode": self.config.mode,
            "ticks": self.cost.ticks,
            "open_alerts": len(self.alert_ids)
            + len(self.fault_alerts.open)
            + (len(self.log_alerts.alert_ids) if self.log_alerts else 0),
            "last_decision": last,
        }

    # -- one tick ------------------------------------------------------------------------------
    def once(self) -> TickResult:
        with self._ticking:  # a task's resize outcome waits for the tick's own writes
            return self._once()

    def _once(self) -> TickResult:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        self._tried_now = False
        pol, st = self.config.policy, self.state
        snap = take(
            self.cp, time.time(), self.predictions, st.key, pol.window_s, st.ran_s,
            pol.replan_interval_s, asked=bool(st.busy),  # a node over the threshold: traces
        )  # fmt: skip
        res = tick(snap, self.config, self.state, self.modules)
        self.state = res.state
        raised = self._record(res, snap)
        self._alerts(res, raised)
        self._retry_pending(snap)
        self._effects(snap)
        if self.log_alerts is not None:
            for _ in self.log_alerts.once(snap.measured.taken_s, self.config.policy.window_s):
                self.m_alerts.labels("log").inc()
        for _ in self.fault_alerts.once(snap.measured.faults, self.cost.ticks + 1):
            self.m_alerts.labels("fault").inc()
        wall = time.perf_counter() - wall0
        c = self.cost
        c.ticks += 1
        c.wall_s += wall
        cpu = time.thread_time() - cpu0
        c.cpu_s += cpu
        self.m_cpu.inc(cpu)
        c.max_wall_s = max(c.max_wall_s, wall)
        c.last_wall_s = wall
        c.modules_ran += res.modules_ran
        if res.modules_ran:
            self.m_runs.inc()
        self.m_tick.observe(wall)
        self.last = {**snap.summary(), "breaches": [b.slo for b in res.breaches]}
        return res

    def _record(self, res: TickResult, snap: Snapshot) -> dict[str, int]:
        """A row and a log line per new decision, each acted on; the exception tasks raised,
        by target."""
        raised: dict[str, int] = {}
        m = snap.measured
        for d in res.recorded:
            p = d.proposal
            row = add_decision(
                self.cp.db,
                self.cp.run.id,
                tick=self.cost.ticks + 1,
                mode=self.config.mode,
                module=p.module,
                kind=p.kind,
                target=p.target,
                verdict=d.verdict,
                reason=f"{p.reason}\n{d.reason}",
                gain_s_per_step=p.predicted_gain_s_per_step,
                cost_s=p.cost_s,
                details=p.details,
            )
            outcome = ""
            if d.verdict == "raise":
                task = raise_into_queue(self.cp.db, self.cp.run.id, p, m.taken_s)
                outcome = f"raised: task {task}" if task else "raised within the hour: not again"
                if task:
                    raised[p.target] = task
            elif d.verdict == "apply" and self.config.mode == "advise":
                outcome = "proposed (advise: not applied)"
            elif d.verdict == "apply":
                self.pending = PendingMove(row, p, m.task_id, median_step(m))
                outcome = self._try_move(snap)
                self._tried_now = True
            if outcome:
                set_decision(self.cp.db, row, outcome=outcome)
            self._log(d, outcome, row)
        return raised

    def _log(self, d: Decision, outcome: str, row: int) -> None:
        p = d.proposal
        self.log.info(
            "control decision %d: %s %s %s (%s): %s%s",
            row,
            d.verdict,
            p.module,
            p.kind,
            p.target,
            d.reason,
            f" -> {outcome}" if outcome else "",
            extra={"decision": row, "verdict": d.verdict, "functional_module": p.module},
        )

    def _try_move(self, snap: Snapshot) -> str:
        """Apply the pending move if the task lock is free now (never waits for it); a resize
        while a task holds it is handed to that task, made before its next step."""
        pending = self.pending
        assert pending is not None
        p = pending.proposal
        if not self.cp.lock.acquire(blocking=False):
            task = None
            if p.kind == "resize-dp":
                task = hand_over(self.cp, p, lambda out: self._resized(pending.decision, out))
            if task is None:
                return "deferred: a task holds the deployment (tried again next tick)"
            self._moved(snap, pending)
            return f"handed to training task {task}: made before its next step"
        try:
            if p.kind == "resize-dp":
                done = resize_now(self.cp, p)
            else:
                done = apply_move(self.cp, snap.measured.traces, p)
        except StillServing as exc:
            return f"deferred: {exc} (tried again next tick)"
        except BadRequest as exc:
            self.pending = None
            return f"not applied: {exc}"
        except Exception as exc:
            self.pending = None
            self.log.exception("control loop: the move failed")
            return f"failed: {type(exc).__name__}: {exc}"
        finally:
            self.cp.lock.release()
        self._moved(snap, pending)
        return f"applied in {done['move_s']:.1f} s"

    def _moved(self, snap: Snapshot, pending: PendingMove) -> None:
        self.pending = None
        # a new placement: decide afresh, on measurements of it, the moved parts cooling down
        # (every task measured so far ran on the old placement: a deferred move's too)
        newest = max((t for t in (snap.measured.task_id, pending.task_before) if t), default=None)
        memory = after_move(self.state.memory, pending.proposal, snap.measured.taken_s, newest)
        self.state = LoopState(open=self.state.open, memory=memory)
        if pending.task_before is not None:
            self.effects.append((pending.decision, pending.task_before))
        before = {"task_before": pending.task_before, "step_before_s": pending.step_before_s}
        set_decision(self.cp.db, pending.decision, **before)

    def _resized(self, decision: int, outcome: str) -> None:
        """A task's outcome of a resize handed to it (from the training thread)."""
        with self._ticking:
            set_decision(self.cp.db, decision, outcome=outcome)
            self.log.info("control decision %d: %s", decision, outcome)

    def _retry_pending(self, snap: Snapshot) -> None:
        pending = self.pending
        if pending is None or self._tried_now:
            return
        p = pending.proposal
        if self.state.verdicts.get((p.module, p.kind, p.target)) != "apply":
            self.pending = None  # no longer accepted
            set_decision(self.cp.db, pending.decision, outcome="withdrawn: no longer accepted")
            return
        outcome = self._try_move(snap)
        if not outcome.startswith("deferred"):
            set_decision(self.cp.db, pending.decision, outcome=outcome)
            self.log.info("control decision %d: %s", pending.decision, outcome)

    def _effects(self, snap: Snapshot) -> None:
        left = []
        for decision, before in self.effects:
            found = effect_of(before, snap.measured)
            if found is None:
                left.append((decision, before))
                continue
            task, step_s = found
            set_decision(self.cp.db, decision, task_after=task, step_after_s=step_s)
            self.log.info(
                "control decision %d: measured effect: step %.3f s on task %d after the move",
                decision,
                step_s,
                task,
            )
        self.effects = left

    # -- alerts --------------------------------------------------------------------------------
    def _alerts(self, res: TickResult, raised: dict[str, int]) -> None:
        db, run = self.cp.db, self.cp.run.id
        for slo in res.resolved:
            alert = self.alert_ids.pop(slo, None)
            if alert is not None:
                set_alert(db, alert, resolved_at=_now())
                self.log.info("alert %d resolved: %s holds again", alert, slo)
        for b in res.raised:
            alert = add_alert(
                db,
                run,
                slo=b.slo,
                value=b.value,
                objective=b.objective,
                reason=f"{b.reason}, above the objective of {b.objective:g}",
                task_id=b.task,
                exception_task=raised.get(f"slo:{b.slo}"),
                action=b.action,
                webhook="pending" if self.webhook is not None else "",
            )  # written when the breach is seen: its action (a replica's start) takes seconds
            self.alert_ids[b.slo] = alert
            self.m_alerts.labels(b.slo).inc()
            self.log.warning(
                "alert %d: %s: %s, above the objective of %g",
                alert,
                b.slo,
                b.reason,
                b.objective,
                extra={"alert": alert, "slo": b.slo},
            )
            outcome = self._action(b)
            if outcome:
                set_alert(db, alert, action_outcome=outcome)
            self._post(alert)  # with the action's outcome

    def _action(self, b: Breach) -> str:
        """Carry out the policy's action for a new breach (``move`` is the tick's own)."""
        if b.action == "move":
            return "the best proposed move is applied even below the threshold"
        if b.action != "scale-out":
            return ""
        pool = getattr(self.cp.inference, "pool", None)
        if pool is None:
            return "not taken: no elastic serving pool (dmsc up --autoscale)"
        if self.config.mode == "advise":
            return "proposed (advise: not taken)"
        try:
            name = pool.scale_out(f"policy: {b.slo} {b.value:.3g} > {b.objective:g}")
        except Exception as exc:
            return f"failed: {type(exc).__name__}: {exc}"
        return f"added serving replica {name}" if name else "refused: no free device"

    def _post(self, alert: int) -> None:
        if self.webhook is not None:
            self.webhook.send(alert, {"alert": alert_json(get_alert(self.cp.db, alert))})

    def _webhook_done(self, alert: int, outcome: str) -> None:
        set_alert(self.cp.db, alert, webhook=outcome)
        self.log.info("alert %d: webhook %s", alert, outcome)
