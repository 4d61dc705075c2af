"""Step traces: what each worker did in a training step, as the operator's view reads it.

Each worker answers a training step with the spans of its forward and backward ops (micro-batch,
start and end on the wall clock) and the bytes it pushed to each peer; the control plane keeps
them, a row per worker and step (:class:`~dmsc.data.db.StepTraceRecord`), with what the worker's
process used meanwhile: its CPU % over the step, its resident memory at the end and, on a GPU, the
memory torch allocated at the step's peak (:mod:`dmsc.runtime.compute.telemetry`). From them come
the measured pipeline Gantt of recent steps, the traffic per stage boundary and per data-parallel
exchange, the measurements the functional modules forecast from, and each worker's use of its
machine over a task (:func:`worker_usage`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from dmsc.data.db import Database, StepTraceRecord, TaskRecord

Key = tuple[int, int]  # (stage, replica)


@dataclass(frozen=True)
class StepTrace:
    """One worker's part of one step."""

    step: int
    stage: int
    replica: int
    compute_s: float
    spans: list[tuple[str, int, float, float]]  # (op "F"/"B", micro-batch, start, end)
    sent: dict[Key, int]  # bytes to each peer (stage, replica)
    cpu_percent: float | None = None  # the worker process's, over its part of the step
    rss_bytes: int | None = None  # its resident memory at the end of the step
    gpu_peak_bytes: int | None = None  # the GPU memory torch allocated at the step's peak
    # each mode's communication: {"tp": {"s": .., "bytes": .., "calls": ..}, "pp": {.., "links":
    # {"STAGE/REPLICA": bytes}}, ..} (dmsc.runtime.compute.comm_meter); empty in older traces
    comm: dict[str, dict[str, Any]] = field(default_factory=dict)
    node_cpu_percent: float | None = None  # its node's cores (a cpuset's if pinned; 100: all busy)

    @classmethod
    def of(cls, rec: StepTraceRecord) -> StepTrace:
        sent = {}
        for key, n in json.loads(rec.sent_json).items():
            s, _, r = key.partition("/")
            sent[(int(s), int(r))] = int(n)
        spans = [
            (str(op), int(mb), float(a), float(b)) for op, mb, a, b in json.loads(rec.spans_json)
        ]
        use = (rec.cpu_percent, rec.rss_bytes, rec.gpu_peak_bytes)
        comm = json.loads(rec.comm_json) if rec.comm_json else {}
        node = rec.node_cpu_percent
        return cls(rec.step, rec.stage, rec.replica, rec.compute_s, spans, sent, *use, comm, node)


def add_step_traces(
    db: Database,
    task_id: int,
    step: int,
    traces: Mapping[Key, tuple[Sequence[Any], Mapping[str, int]]],
    compute_s: Mapping[str, float],
    telemetry: Mapping[Key, Mapping[str, Any]] | None = None,
    comm: Mapping[Key, Mapping[str, Any]] | None = None,
) -> None:
    """Keep one step's traces (``Deployment.train_step``'s ``traces``, ``compute_s``,
    ``telemetry``: each worker's ``cpu_percent``, ``rss_bytes``, ``gpu_peak_bytes`` and
    ``node_cpu_percent``, and ``comm``: each worker's communication by mode)."""
    use, modes = telemetry or {}, comm or {}
    rows = [
        StepTraceRecord(
            task_id=task_id,
            step=step,
            stage=stage,
            replica=replica,
            compute_s=float(compute_s.get(f"{stage}/{replica}", 0.0)),
            spans_json=json.dumps([list(s) for s in spans]),
            sent_json=json.dumps(dict(sent)),
            cpu_percent=use.get((stage, replica), {}).get("cpu_percent"),
            rss_bytes=use.get((stage, replica), {}).get("rss_bytes"),
            gpu_peak_bytes=use.get((stage, replica), {}).get("gpu_peak_bytes"),
            node_cpu_percent=use.get((stage, replica), {}).get("node_cpu_percent"),
            comm_json=json.dumps(dict(modes[(stage, replica)]))
            if (stage, replica) in modes
            else None,
        )
        for (stage, replica), (spans, sent) in traces.items()
    ]
    with db.sessions() as s, s.begin():
        s.add_all(rows)


def record_step(db: Database, task_id: int, step: int, reply: Mapping[str, Any]) -> None:
    """Keep the traces of ``reply``, what ``Deployment.train_step`` returned for ``step``."""
    traces, compute_s = reply.get("traces", {}), reply.get("compute_s", {})
    use, comm = reply.get("telemetry", {}), reply.get("comm", {})
    add_step_traces(db, task_id, step, traces, compute_s, use, comm)


def step_traces(db: Database, task_id: int, last: int | None = None) -> list[StepTrace]:
    """The task's traces, by step then stage and replica; only its ``last`` steps when given."""
    with db.sessions() as s:
        q = select(StepTraceRecord).where(StepTraceRecord.task_id == task_id)
        if last is not None:
            steps = select(StepTraceRecord.step).where(StepTraceRecord.task_id == task_id)
            top = s.scalars(steps.distinct().order_by(StepTraceRecord.step.desc()).limit(last))
            q = q.where(StepTraceRecord.step.in_(list(top)))
        q = q.order_by(StepTraceRecord.step, StepTraceRecord.stage, StepTraceRecord.replica)
        return [StepTrace.of(r) for r in s.scalars(q)]


def traced_tasks(db: Database, run_id: int) -> list[int]:
    """The run's tasks that have traces, oldest first."""
    with db.sessions() as s:
        q = (
            select(StepTraceRecord.task_id)
            .join(TaskRecord, TaskRecord.id == StepTraceRecord.task_id)
            .where(TaskRecord.run_id == run_id)
            .distinct()
        )
        return sorted(s.scalars(q))


def link_bytes(traces: Sequence[StepTrace]) -> dict[tuple[Key, Key], float]:
    """Mean bytes per step from each worker to each peer over ``traces``' steps."""
    steps = {t.step for t in traces}
    total: dict[tuple[Key, Key], int] = {}
    for t in traces:
        for peer, n in t.sent.items():
            edge = ((t.stage, t.replica), peer)
            total[edge] = total.get(edge, 0) + n
    return {edge: n / max(1, len(steps)) for edge, n in total.items()}


def latest_worker_cpu(db: Database, run_id: int) -> dict[tuple[int, int], float]:
    """Each worker's mean CPU % by (stage, replica) over the newest training task of run
    ``run_id`` that measured any (empty: none did)."""
    for task in reversed([t for t in db.tasks(run_id) if t.kind == "train"]):
        cpu = {
            (int(k.split("/")[0]), int(k.split("/")[1])): u["cpu_percent_mean"]
            for k, u in worker_usage(db, task.id).items()
            if u["cpu_percent_mean"] is not None
        }
        if cpu:
            return cpu
    return {}


def worker_usage(db: Database, task_id: int) -> dict[str, dict[str, Any]]:
    """Each worker's use of its machine over the task's steps, by ``"STAGE/REPLICA"``: the
    steps measured, its mean and highest CPU %, its highest RSS and GPU peak (None where no step
    was measured, as in traces kept before workers reported it)."""
    r = StepTraceRecord
    q = (
        select(
            r.stage,
            r.replica,
            func.count(r.cpu_percent),
            func.avg(r.cpu_percent),
            func.max(r.cpu_percent),
            func.max(r.rss_bytes),
            func.max(r.gpu_peak_bytes),
        )
        .where(r.task_id == task_id)
        .group_by(r.stage, r.replica)
        .order_by(r.stage, r.replica)
    )
    with db.sessions() as s:
        rows = s.execute(q).all()
    return {
        f"{stage}/{replica}": {
            "steps": n,
            "cpu_percent_mean": None if mean is None else float(mean),
            "cpu_percent_max": None if top is None else float(top),
            "rss_bytes_max": rss,
            "gpu_peak_bytes_max": gpu,
        }
        for stage, replica, n, mean, top, rss, gpu in rows
    }
