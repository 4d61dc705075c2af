"""The reads and writes of the control loop's two tables (:mod:`dmsc.data.records`): every
decision the loop made, applied or not (``control_decisions``), and every alert a broken
objective raised (``alerts``).

The loop (:mod:`dmsc.runtime.control.loop`) writes them; the dashboard and ``GET /v1/alerts``
read them. Both tables are made with the database, as the others are
(:class:`dmsc.data.db.Database` creates every table of :class:`~dmsc.data.records.Base` and
adds the columns an older file lacks).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import select

from dmsc.data.db import AlertRecord, Database, DecisionRecord


def add_decision(db: Database, run_id: int, **fields: Any) -> int:
    """Write one decision row; returns its id."""
    details = fields.pop("details", None)
    rec = DecisionRecord(run_id=run_id, details_json=json.dumps(details or {}), **fields)
    return db.add(rec).id


def set_decision(db: Database, decision_id: int, **fields: Any) -> None:
    """Update a decision (its outcome, or its measured effect)."""
    with db.sessions() as s, s.begin():
        rec = s.get(DecisionRecord, decision_id)
        if rec is None:
            raise KeyError(f"no decision {decision_id}")
        for name, value in fields.items():
            setattr(rec, name, value)


def decisions(db: Database, run_id: int, limit: int = 100) -> list[DecisionRecord]:
    """The run's newest ``limit`` decisions, newest first."""
    with db.sessions() as s:
        q = select(DecisionRecord).where(DecisionRecord.run_id == run_id)
        return list(s.scalars(q.order_by(DecisionRecord.id.desc()).limit(limit)))


def add_alert(db: Database, run_id: int, **fields: Any) -> int:
    """Write one alert; returns its id."""
    return db.add(AlertRecord(run_id=run_id, **fields)).id


def set_alert(db: Database, alert_id: int, **fields: Any) -> None:
    """Update an alert (its webhook's state, its action's outcome, when it resolved)."""
    with db.sessions() as s, s.begin():
        rec = s.get(AlertRecord, alert_id)
        if rec is None:
            raise KeyError(f"no alert {alert_id}")
        for name, value in fields.items():
            setattr(rec, name, value)


def get_alert(db: Database, alert_id: int) -> AlertRecord:
    """One alert (KeyError when there is none of that id)."""
    with db.sessions() as s:
        rec = s.get(AlertRecord, alert_id)
    if rec is None:
        raise KeyError(f"no alert {alert_id}")
    return rec


def alerts(
    db: Database, run_id: int | None = None, open_only: bool = False, limit: int = 100
) -> list[AlertRecord]:
    """The newest ``limit`` alerts (of one run, only the unresolved ones), newest first."""
    q = select(AlertRecord)
    if run_id is not None:
        q = q.where(AlertRecord.run_id == run_id)
    if open_only:
        q = q.where(AlertRecord.resolved_at.is_(None))
    with db.sessions() as s:
        return list(s.scalars(q.order_by(AlertRecord.id.desc()).limit(limit)))


def iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    return (t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)).isoformat()


def decision_json(d: DecisionRecord) -> dict[str, Any]:
    """A decision as the dashboard and the API show it."""
    return {
        "id": d.id,
        "at": iso(d.at),
        "tick": d.tick,
        "mode": d.mode,
        "module": d.module,
        "kind": d.kind,
        "target": d.target,
        "verdict": d.verdict,
        "reason": d.reason,
        "outcome": d.outcome,
        "gain_s_per_step": d.gain_s_per_step,
        "cost_s": d.cost_s,
        "step_before_s": d.step_before_s,
        "step_after_s": d.step_after_s,
        "task_before": d.task_before,
        "task_after": d.task_after,
    }


def alert_json(a: AlertRecord) -> dict[str, Any]:
    """An alert as ``GET /v1/alerts`` and the dashboard show it."""
    return {
        "id": a.id,
        "run": a.run_id,
        "at": iso(a.at),
        "slo": a.slo,
        "value": a.value,
        "objective": a.objective,
        "reason": a.reason,
        "task": a.task_id,
        "exception_task": a.exception_task,
        "action": a.action,
        "action_outcome": a.action_outcome,
        "webhook": a.webhook,
        "resolved_at": iso(a.resolved_at),
    }
