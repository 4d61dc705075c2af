"""One tick of the control loop, as a pure function over one snapshot of measurements.

:func:`tick` takes a :class:`Snapshot` (what :mod:`.snapshot` read from the database and the
control plane at one instant), the loop's settings (:class:`LoopConfig`: the policy, the mode)
and what it remembers from the tick before (:class:`LoopState`), and returns what to do
(:class:`TickResult`); it reads no clock, database or network, so a test builds a snapshot by
hand. The runner (:mod:`.runner`) acts on the result and writes it down.

Each tick:

- the objectives of the policy are checked (:func:`check_slos`), and whether devices were lost
  (:func:`device_breaches`); a breach not open before is a new alert, an open one that holds
  again is resolved. A breach with a task at fault (the training task whose steps are slow,
  the task that waited too long) is also proposed as an exception, for the exception queue;
- the functional modules run when enough new was measured since they last ran
  (:func:`modules_due`: a training task that came, started or ended, or ``MODULE_STEPS`` new
  steps and the policy's ``replan_interval_s`` since the last run), or when an event asks for
  them (a newly broken objective, a node become busy); their proposals and the exceptions of
  the breaches go through the decision rule
  (:func:`~dmsc.runtime.control.advisors.decide`). A breach whose policy names ``move`` lets
  the best move with a gain through even below the rule's threshold (its cost must still be
  paid back within the horizon). Then the hysteresis (:mod:`.hysteresis`): a move is applied
  only when it holds on ``confirm_ticks`` consecutive ticks, on a task measured after the last
  move, and not for a stage moved within the cool-down;
- a stage's node busy over the policy's threshold for ``busy.ticks`` ticks (:mod:`.busy`) runs
  the modules at once, and path optimisation re-plans with that datacenter's slowness as its
  node's, not its device type's: a move away is its proposal; a move to an idle node of the
  same datacenter is the loop's own (:func:`.busy.node_moves`, with the snapshot's cluster
  spec);
- a resize of training's data-parallel degree is proposed by :mod:`.resizing` when devices go
  or come back, or the policy's ``elastic`` asks for it on a broken step-time objective; one
  forced by lost devices is proposed and applied at every tick until it is done;
- a decision is recorded when it is new: the first of its proposal (module, kind, target) or
  one whose verdict changed. The same verdict on the same proposal tick after tick is one row.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dmsc.runtime.control.advisors.base import MOVE_KINDS, FunctionalModule, Measurements, Proposal
from dmsc.runtime.control.advisors.orchestrator import Decision, DecisionRule, collect, decide
from dmsc.runtime.control.advisors.policy import nearest_rank
from dmsc.runtime.control.loop.busy import Baseline, datacenter_cpu, idle_compute, node_moves, watch
from dmsc.runtime.control.loop.hysteresis import Memory, steady
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.resizing import DeviceView, force, propose
from dmsc.spec import ClusterSpec

MODULE = "control-loop"  # the name the loop's own proposals carry (its SLO exceptions)
RECENT_STEPS = 20  # the steps the step-time median is over
MIN_STEPS = 3  # the step time is judged once this many are measured (the first warms up)
MODULE_STEPS = 10  # new steps of the measured task after which the modules run again
EFFECT_STEPS = 3  # steps of the next training task that measure a move's effect
FINISHED = ("done", "failed")  # task states that count for the error rate


@dataclass(frozen=True)
class Snapshot:
    """What one tick reads, all taken at ``measured.taken_s``."""

    measured: Measurements  # the run's plan, metrics, step traces, tasks and faults
    queue_depth: int = 0  # training tasks queued
    in_flight: int = 0  # inference requests in flight
    serving_replicas: int = 0  # elastic serving replicas (0: no pool)
    # bytes/s measured across each stage boundary (after stage b), and the capacity of the
    # reserved path there (bytes/s) when the plan reserved one
    link_rates: Mapping[int, float] = field(default_factory=dict)
    link_capacity: Mapping[int, float] = field(default_factory=dict)
    # each worker's CPU % and memory over its last traced steps ("STAGE/REPLICA": {...})
    telemetry: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)
    moved_s: float | None = None  # when the deployment last moved (unix seconds), if it did
    devices: DeviceView | None = None  # replicas against the devices online (.resizing)
    # the latencies of the inference requests answered within the policy's window, through any
    # door (the gateway's are no task rows); None: not known, the inference tasks' times count
    served: tuple[float, ...] | None = None
    cluster: ClusterSpec | None = None  # the plan's cluster spec (None: not known)

    def key(self) -> tuple[Any, ...]:
        """What the modules last ran on: the measured task, its last step, the training tasks
        and their states (:func:`modules_due`)."""
        m = self.measured
        last = m.metrics[-1].step if m.metrics else -1
        return (m.task_id, last, tuple((t.id, t.state) for t in m.tasks if t.kind == "train"))

    def summary(self) -> dict[str, Any]:
        """The snapshot in a few figures (the dashboard's "control loop" line)."""
        m = self.measured
        recent = [p.step_s for p in m.metrics[-RECENT_STEPS:]]
        return {
            "task": m.task_id,
            "steps": len(m.metrics),
            "median_step_s": statistics.median(recent) if recent else None,
            "queue_depth": self.queue_depth,
            "in_flight": self.in_flight,
            "serving_replicas": self.serving_replicas,
            "link_mbit_s": {str(b): r * 8 / 1e6 for b, r in sorted(self.link_rates.items())},
            "workers": dict(self.telemetry),
        }


@dataclass(frozen=True)
class LoopConfig:
    """The loop's settings: the policy, and whether accepted moves are applied (``act``) or
    only proposed (``advise``)."""

    policy: Policy = field(default_factory=Policy)
    mode: str = "act"

    @property
    def rule(self) -> DecisionRule:
        return DecisionRule(self.policy.threshold, self.policy.horizon_steps)


@dataclass(frozen=True)
class Breach:
    """An objective the snapshot breaks."""

    slo: str
    value: float
    objective: float
    action: str
    reason: str
    task: int | None = None  # the task at fault, when one is


@dataclass(frozen=True)
class LoopState:
    """What a tick remembers of those before it."""

    key: tuple[Any, ...] | None = None  # the snapshot key the modules last ran on
    ran_s: float | None = None  # when they last ran (the snapshot's time, unix seconds)
    verdicts: Mapping[tuple[str, str, str], str] = field(default_factory=dict)  # last recorded
    open: frozenset[str] = frozenset()  # objectives broken at the last tick
    memory: Memory = field(default_factory=Memory)  # the moves' hysteresis (.hysteresis)
    busy: Mapping[str, int] = field(default_factory=dict)  # ticks in a row a DC was busy (.busy)
    idle_compute: Mapping[Baseline, float] = field(default_factory=dict)  # .busy.idle_compute


@dataclass(frozen=True)
class TickResult:
    state: LoopState
    decisions: tuple[Decision, ...]  # every decision of this tick
    recorded: tuple[Decision, ...]  # the new ones: one row each
    breaches: tuple[Breach, ...]  # every objective broken now
    raised: tuple[Breach, ...]  # newly broken: an alert each
    resolved: tuple[str, ...]  # objectives that hold again
    modules_ran: bool


def modules_due(
    key: tuple[Any, ...],
    last: tuple[Any, ...] | None,
    now_s: float = 0.0,
    last_s: float | None = None,
    interval_s: float = 0.0,
    asked: bool = False,
) -> bool:
    """Whether the modules run on a snapshot of ``key`` taken at ``now_s``, having last run on
    ``last`` at ``last_s``: a new measured task or a training task that came, started or ended;
    an event that ``asked`` for them (a newly broken objective, a node become busy); or
    ``MODULE_STEPS`` new steps once ``interval_s`` passed since they last ran (each step alone
    changes little, and path optimisation's re-plan costs tens of ms of CPU: at 0.12 s steps,
    10 steps alone re-planned at nearly every tick)."""
    if last is None or key[0] != last[0] or key[2] != last[2] or key[1] < last[1] or asked:
        return True
    waited = last_s is None or now_s - last_s >= interval_s
    return bool(key[1] - last[1] >= MODULE_STEPS and waited)


def _median_step(m: Measurements) -> float | None:
    recent = [p.step_s for p in m.metrics[-RECENT_STEPS:]]
    return statistics.median(recent) if recent else None


def check_slos(snap: Snapshot, policy: Policy) -> list[Breach]:
    """The objectives of ``policy`` that ``snap`` breaks (module docstring)."""
    m, now, window = snap.measured, snap.measured.taken_s, policy.window_s
    out: list[Breach] = []
    for name, obj in policy.slos.set().items():
        limit = obj.max
        if name == "step_time_s":
            task = next((t for t in m.tasks if t.id == m.task_id), None)
            live = task is not None and (
                task.state == "running" or (task.finished_s or 0) >= now - window
            )
            median = _median_step(m) if len(m.metrics) >= MIN_STEPS else None
            if live and median is not None and median > limit:
                n = min(len(m.metrics), RECENT_STEPS)
                why = f"median step {median:.3f} s over the last {n} steps of task {m.task_id}"
                out.append(Breach(name, median, limit, obj.action, why, m.task_id))
        elif name == "infer_p99_s":
            if snap.served is not None:
                lat = list(snap.served)
            else:
                runs = [
                    t.run_s
                    for t in m.tasks
                    if t.kind == "infer"
                    and t.state == "done"
                    and (t.finished_s or 0) >= now - window
                ]
                lat = [r for r in runs if r is not None]
            if lat and (p99 := nearest_rank(lat, 99)) > limit:
                why = f"inference p99 {p99:.3f} s over {len(lat)} requests in {window:g} s"
                out.append(Breach(name, p99, limit, obj.action, why))
        elif name == "queue_wait_s":
            waits = [
                (t.queue_wait_s(now), t.id)
                for t in m.tasks
                if t.kind == "train" and (t.state == "queued" or (t.started_s or 0) >= now - window)
            ]
            late = [w for w in waits if w[0] > limit]
            if late:
                wait, late_task = max(late)
                why = f"training task {late_task} waited {wait:.1f} s in the queue"
                out.append(Breach(name, wait, limit, obj.action, why, late_task))
        elif name == "error_rate":
            ended = [
                t
                for t in m.tasks
                if t.kind in ("train", "infer")
                and t.state in FINISHED
                and (t.finished_s or 0) >= now - window
            ]
            failed = sum(t.state == "failed" for t in ended)
            if ended and (rate := failed / len(ended)) > limit:
                why = f"{failed} of {len(ended)} tasks finished in {window:g} s failed"
                out.append(Breach(name, rate, limit, obj.action, why))
        elif name == "link_utilisation":
            use = {
                b: snap.link_rates.get(b, 0.0) / cap
                for b, cap in snap.link_capacity.items()
                if cap > 0
            }
            if use and (top := max(use.values())) > limit:
                b = max(use, key=lambda k: use[k])
                why = f"boundary {b}->{b + 1} carries {top:.0%} of its reserved path"
                out.append(Breach(name, top, limit, obj.action, why))
    return out


def device_breaches(view: DeviceView | None) -> list[Breach]:
    """Devices lost (a Ray node gone): an alert while the devices online fall short of what the
    replicas hold (the forced resize of :mod:`.resizing` is the decision)."""
    short = view.short() if view is not None else {}
    if view is None or not short:
        return []
    lost = ", ".join(f"{dc} short of {n}" for dc, n in sorted(short.items()))
    why = f"devices lost ({lost}, as {view.source} says): {view.dp} replicas hold more"
    return [Breach("devices", float(sum(short.values())), 0.0, "alert", why)]


def _exception(b: Breach) -> Proposal:
    reason = f"{b.reason}, above the objective of {b.objective:g}"
    return Proposal(
        MODULE,
        "exception",
        f"slo:{b.slo}",
        reason,
        details={"value": b.value, "objective": b.objective, "task": b.task or 0},
    )


def _forced_move(decisions: list[Decision], rule: DecisionRule, why: str) -> list[Decision]:
    """A policy's ``move``: the best move refused only for the threshold is applied."""
    if any(d.verdict == "apply" for d in decisions):
        return decisions
    moves = [
        d
        for d in decisions
        if d.proposal.kind in MOVE_KINDS
        and d.proposal.predicted_gain_s_per_step > 0
        and d.proposal.payback_steps <= rule.horizon_steps
    ]
    if not moves:
        return decisions
    best = max(moves, key=lambda d: d.proposal.predicted_gain_s_per_step)
    return [
        Decision(d.proposal, "apply", f"{d.reason}; applied anyway: the policy's action ({why})")
        if d is best
        else d
        for d in decisions
    ]


def tick(
    snap: Snapshot,
    config: LoopConfig,
    state: LoopState,
    modules: Sequence[FunctionalModule],
) -> TickResult:
    """One tick over ``snap`` (module docstring)."""
    breaches = check_slos(snap, config.policy) + device_breaches(snap.devices)
    broken = frozenset(b.slo for b in breaches)
    raised = tuple(b for b in breaches if b.slo not in state.open)
    resolved = tuple(sorted(state.open - broken))
    key = snap.key()
    cpu = datacenter_cpu(snap.telemetry, snap.measured.plan)
    streaks: dict[str, int] = {}
    busy: dict[str, float] = {}
    baseline = state.idle_compute
    if config.policy.busy is not None:
        streaks, busy, _ = watch(cpu, state.busy, config.policy.busy)
        if snap.cluster is not None:
            m = snap.measured
            baseline = idle_compute(
                baseline, m.plan, snap.cluster, snap.telemetry, m.traces, config.policy.busy
            )
    now, every = snap.measured.taken_s, config.policy.replan_interval_s
    # a busy datacenter runs them every tick it stays busy: its moves confirm tick to tick
    due = modules_due(key, state.key, now, state.ran_s, every, asked=bool(raised) or bool(busy))
    slow = next((b.reason for b in breaches if b.slo == "step_time_s"), None)
    resizes = propose(snap.devices, config.policy, _median_step(snap.measured), slow)
    forced = any(p.details.get("forced") for p in resizes)  # devices lost: every tick
    ran = due or bool(raised) or forced
    decisions: list[Decision] = []
    if ran:
        measured = replace(snap.measured, busy=busy)  # path optimisation reads them (.busy)
        proposals = collect(modules, measured) if due else []
        if due and busy and snap.cluster is not None and config.policy.busy is not None:
            m, policy = snap.measured, config.policy.busy
            step_s = _median_step(m)
            proposals += node_moves(
                m.plan, snap.cluster, snap.telemetry, busy, policy, m.traces, step_s, m.faults,
                baseline, m.worker_start_s,
            )  # fmt: skip
        proposals += resizes if due or forced else []
        proposals += [_exception(b) for b in breaches if b.task is not None]
        decisions = decide(proposals, config.rule, snap.measured.remaining_steps)
        movers = [b for b in breaches if b.action == "move"]
        if movers:
            decisions = _forced_move(decisions, config.rule, movers[0].slo)
        decisions = force(decisions)
    memory = state.memory
    if due:
        remaining = snap.measured.remaining_steps
        horizon = config.rule.horizon_steps
        if remaining is not None:
            horizon = min(horizon, remaining)
        m = snap.measured
        task = next((t for t in m.tasks if t.id == m.task_id), None)
        decisions, memory = steady(
            decisions,
            memory,
            task_id=m.task_id,
            started_s=task.started_s if task is not None else None,
            moved_s=snap.moved_s,
            now_s=snap.measured.taken_s,
            confirm_ticks=config.policy.confirm_ticks,
            cooldown_s=config.policy.cooldown_s,
            horizon=horizon,
        )
    verdicts = dict(state.verdicts)
    if snap.measured.task_id is not None and state.key and state.key[0] != key[0]:
        verdicts = {}  # a new training task: its decisions are new
    recorded = []
    for d in decisions:
        sig = (d.proposal.module, d.proposal.kind, d.proposal.target)
        if verdicts.get(sig) != d.verdict:
            recorded.append(d)
            verdicts[sig] = d.verdict
    new_state = replace(
        state,
        key=key if due else state.key,
        ran_s=now if due else state.ran_s,
        verdicts=verdicts,
        open=broken,
        memory=memory,
        busy=streaks,
        idle_compute=baseline,
    )
    return TickResult(
        new_state, tuple(decisions), tuple(recorded), tuple(breaches), raised, resolved, ran
    )


def effect_of(task_before: int, m: Measurements) -> tuple[int, float] | None:
    """The measured effect of a move made after training task ``task_before``: the next
    training task's id and its median step time over its first ``EFFECT_STEPS`` steps (None
    until that task has run them)."""
    if m.task_id is None or m.task_id <= task_before or len(m.metrics) < EFFECT_STEPS:
        return None
    first = [p.step_s for p in m.metrics[:EFFECT_STEPS]]
    return m.task_id, statistics.median(first)


def median_step(m: Measurements) -> float | None:
    """The median step time of the measured task's last steps (a move's "before")."""
    value = _median_step(m)
    return None if value is None or math.isnan(value) else value
