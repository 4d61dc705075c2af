"""The one interface of the functional modules: a snapshot of measurements in, proposals out.

A :class:`Measurements` snapshot is read from the database for one run (:func:`read_measurements`):
the run's plan, the training metrics and step traces of its measured training task, the times of
its tasks (training and inference) and its faults, and the time the snapshot was taken. Modules
are pure over it: a module never reads the database, the clock or the network itself, so the same
snapshot always gives the same proposals (and a test builds one by hand).

A :class:`Proposal` is what a module asks of the orchestrator: a move with its predicted gain per
step and its one-off cost, an exception to raise, or a forecast to note. The orchestrator
(:mod:`.orchestrator`) decides; modules never act.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sqlalchemy import func, select

from dmsc.data.db import Database, MetricRecord, RunRecord, TaskRecord
from dmsc.data.traces import StepTrace, step_traces
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.prediction import Prediction

# What a proposal asks for. Moves (``move-stage``: stages change datacenter; ``reroute``: same
# datacenters, other paths or capacity; ``recut``: the layers move between stages;
# ``resize-dp``: training's data-parallel degree grows or shrinks; ``move-node``: a stage
# replica goes from a busy node to an idle one of its datacenter, the control loop's) have a gain
# and a cost; an ``exception`` is raised into the exception queue; a ``forecast`` or a ``keep``
# (a module looked and proposes nothing, with its reason) is noted; an ``error`` is a module that
# failed on this snapshot.
ProposalKind = Literal[
    "move-stage",
    "reroute",
    "recut",
    "resize-dp",
    "move-node",
    "exception",
    "forecast",
    "keep",
    "error",
]
MOVE_KINDS: tuple[ProposalKind, ...] = ("move-stage", "reroute", "recut", "resize-dp", "move-node")

RECENT_STEPS = 200  # the step traces a snapshot keeps: the modules' window


@dataclass(frozen=True)
class MetricPoint:
    """One training step as the training task recorded it."""

    step: int
    loss: float
    step_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class TaskTimes:
    """A task and its times (unix seconds): when it was created, started and finished."""

    id: int
    kind: str
    state: str
    tenant: str
    lane: str
    created_s: float
    started_s: float | None
    finished_s: float | None
    params: dict[str, Any] = field(default_factory=dict)

    def queue_wait_s(self, now_s: float) -> float:
        """Seconds it waited in the queue: until it started, or until ``now_s`` if it waits."""
        return (self.started_s if self.started_s is not None else now_s) - self.created_s

    @property
    def run_s(self) -> float | None:
        """Seconds from start to finish (an inference task's latency); None until it ends."""
        if self.started_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.started_s


@dataclass(frozen=True)
class FaultInfo:
    """A failure the runtime detected, and whether and when it recovered (unix seconds)."""

    kind: str
    reason: str
    detected_s: float
    recovered_s: float | None
    steps_lost: int
    id: int = 0  # its row in ``faults``
    services: str = ""  # the SIDs replaced, comma-separated
    task_id: int | None = None  # the training task it struck, if one


@dataclass(frozen=True)
class Measurements:
    """What the modules read: one run's plan and what was measured while it ran."""

    run_id: int
    plan: Plan
    taken_s: float  # when the snapshot was read (unix seconds): queue waits run until then
    task_id: int | None = None  # the training task the metrics and traces are of
    metrics: tuple[MetricPoint, ...] = ()
    traces: tuple[StepTrace, ...] = ()  # its last RECENT_STEPS steps, by step, stage, replica
    tasks: tuple[TaskTimes, ...] = ()
    faults: tuple[FaultInfo, ...] = ()
    remaining_steps: int | None = None  # steps the measured task has left (None: unknown)
    # the prediction for the job the measured task ran (None: the plan's own; replanning.py
    # re-estimates it for another batch, dp or calibration)
    predicted: Prediction | None = None
    # datacenters whose stage workers' nodes the control loop found busy (node CPU %): their
    # measured slowness is the node's load, not their device type's (.paths)
    busy: dict[str, float] = field(default_factory=dict)
    # how long the deployment's workers took to start, measured when it started (a move's
    # restart, .move_cost; None: not measured)
    worker_start_s: float | None = None

    def prediction(self) -> Prediction:
        """The predicted step time the measured steps compare with, and what it is."""
        if self.predicted is not None:
            return self.predicted
        return Prediction(self.plan.prediction.iteration_time_s, "the plan's")

    @property
    def empty(self) -> bool:
        """Nothing measured yet: no training step and no task."""
        return not self.metrics and not self.traces and not self.tasks


@dataclass(frozen=True)
class Proposal:
    """What a module proposes to the orchestrator, with the figures its decision needs."""

    module: str
    kind: ProposalKind
    target: str  # what it is about: "stage 1", "boundary 0->1", "slo:step-time", ...
    reason: str  # one sentence a user reads, with the measured figures
    predicted_gain_s_per_step: float = 0.0
    current_s_per_step: float = 0.0  # the step time the gain is measured against
    cost_s: float = 0.0  # one-off: checkpoint, transfer, restart
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def payback_steps(self) -> float:
        """Steps until the gain has paid for the cost (inf without a gain)."""
        if self.predicted_gain_s_per_step <= 0:
            return math.inf if self.cost_s > 0 else 0.0
        return self.cost_s / self.predicted_gain_s_per_step

    def as_json(self) -> dict[str, Any]:
        payback = self.payback_steps
        return {
            "module": self.module,
            "kind": self.kind,
            "target": self.target,
            "reason": self.reason,
            "predicted_gain_s_per_step": self.predicted_gain_s_per_step,
            "current_s_per_step": self.current_s_per_step,
            "cost_s": self.cost_s,
            "payback_steps": None if math.isinf(payback) else payback,
            "details": self.details,
        }


class FunctionalModule(Protocol):
    """A module of the orchestrator: reads a snapshot, proposes (never acts)."""

    name: str
    description: str  # what it does, one line
    reads: str  # what of the snapshot it reads
    proposes: str  # the kinds of proposal it makes

    def propose(self, measurements: Measurements) -> list[Proposal]: ...


# -- reading a snapshot ---------------------------------------------------------------------------


def unix_s(t: dt.datetime | None) -> float | None:
    """A database time as unix seconds (None stays None)."""
    if t is None:
        return None
    if t.tzinfo is None:  # SQLite gives back naive datetimes of what was stored in UTC
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def newest_run(db: Database) -> int | None:
    """The newest run's id (None when the database holds none)."""
    with db.sessions() as s:
        return s.scalar(select(RunRecord.id).order_by(RunRecord.id.desc()).limit(1))


def _measured_task(db: Database, run_id: int) -> int | None:
    """The run's newest training task that recorded a step."""
    with db.sessions() as s:
        q = (
            select(MetricRecord.task_id)
            .join(TaskRecord, TaskRecord.id == MetricRecord.task_id)
            .where(TaskRecord.run_id == run_id, TaskRecord.kind == "train")
            .group_by(MetricRecord.task_id)
            .having(func.count() > 0)
            .order_by(MetricRecord.task_id.desc())
            .limit(1)
        )
        return s.scalar(q)


def task_times(t: TaskRecord) -> TaskTimes:
    created = unix_s(t.created_at)
    assert created is not None
    return TaskTimes(
        id=t.id,
        kind=t.kind,
        state=t.state,
        tenant=t.tenant,
        lane=t.lane,
        created_s=created,
        started_s=unix_s(t.started_at),
        finished_s=unix_s(t.finished_at),
        params=json.loads(t.params_json or "{}"),
    )


def read_measurements(
    db: Database, run_id: int, taken_s: float, last_steps: int = RECENT_STEPS
) -> Measurements:
    """The snapshot of run ``run_id`` at ``taken_s`` (the caller's clock); KeyError for an
    unknown run."""
    with db.sessions() as s:
        run = s.get(RunRecord, run_id)
        if run is None:
            raise KeyError(f"no run {run_id}")
        plan_json = run.plan_json
    plan = Plan.model_validate_json(plan_json)
    task_id = _measured_task(db, run_id)
    metrics: tuple[MetricPoint, ...] = ()
    traces: tuple[StepTrace, ...] = ()
    if task_id is not None:
        metrics = tuple(
            MetricPoint(m.step, m.loss, m.step_s, m.tokens_per_s) for m in db.metrics(task_id)
        )
        traces = tuple(step_traces(db, task_id, last=last_steps))
    tasks = tuple(task_times(t) for t in db.tasks(run_id))
    faults = tuple(
        FaultInfo(
            f.kind,
            f.reason,
            f.detected_at,
            f.recovered_at,
            f.steps_lost,
            f.id,
            f.services,
            f.task_id,
        )
        for f in db.faults(run_id)
    )
    measured = next((t for t in tasks if t.id == task_id), None)
    return Measurements(
        run_id=run_id,
        plan=plan,
        taken_s=taken_s,
        task_id=task_id,
        metrics=metrics,
        traces=traces,
        tasks=tasks,
        faults=faults,
        remaining_steps=_remaining_steps(measured, metrics),
    )


def _remaining_steps(task: TaskTimes | None, metrics: tuple[MetricPoint, ...]) -> int | None:
    """Steps a training task that still runs has left (its ``steps`` count from its
    ``first_step``); None when it is over or does not say."""
    if task is None or not metrics or task.state not in ("running", "queued"):
        return None
    steps = task.params.get("steps")
    if not isinstance(steps, int):
        return None
    first = int(task.params.get("first_step", 0) or 0)
    return max(0, first + steps - (metrics[-1].step + 1))
