"""The control loop as ``dmsc up`` starts it and as ``dmsc status`` and the dashboard show it:
:func:`start_control_loop` (none with ``--control-interval 0``), :func:`with_loop` the
dashboard's document with the loop's settings, cost, newest decisions and alerts, and
:func:`with_loop_status` the ``Status`` answer with the loop's part."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dmsc.data.control_records import alert_json, alerts, decision_json, decisions
from dmsc.runtime.control.loop.objectives import policy_from
from dmsc.runtime.control.loop.runner import ControlLoop
from dmsc.runtime.control.loop.tick import LoopConfig
from dmsc.runtime.transport.messages import ControlSettings

DECISIONS_SHOWN = 30
ALERTS_SHOWN = 30


def with_loop(
    dashboard: Callable[[str | None], dict[str, Any]], loop: ControlLoop
) -> Callable[[str | None], dict[str, Any]]:
    """The dashboard's document with the loop's part (``control``): its settings and cost, the
    newest decisions with their reasons and measured effects, and the alerts (a tenant's reader
    sees an alert's task only when it is its own)."""

    def doc(tenant: str | None = None) -> dict[str, Any]:
        out = dashboard(tenant)
        db, run = loop.cp.db, loop.cp.run.id
        own = {t["id"] for t in out.get("tasks", [])}
        shown = []
        for a in alerts(db, run, limit=ALERTS_SHOWN):
            row = alert_json(a)
            if tenant is not None and row["task"] not in own:
                row = {**row, "task": None, "exception_task": None}
            shown.append(row)
        out["control"] = {
            **loop.as_json(),
            "decisions": [decision_json(d) for d in decisions(db, run, DECISIONS_SHOWN)],
            "alerts": shown,
            "open_alerts": sum(a["resolved_at"] is None for a in shown),
        }
        return out

    return doc


def with_loop_status(
    status: Callable[[Any], dict[str, Any]], loop: ControlLoop
) -> Callable[[Any], dict[str, Any]]:
    """The ``Status`` answer with the loop's part (``control``: :meth:`ControlLoop.status_json`)."""

    def answer(req: Any) -> dict[str, Any]:
        return {**status(req), "control": loop.status_json()}

    return answer


def start_control_loop(
    cp: Any, settings: ControlSettings, log: logging.Logger
) -> ControlLoop | None:
    """The control loop of ``dmsc up`` started on ``cp`` (None with ``--control-interval 0``)."""
    if settings.control_interval_s <= 0:
        return None
    config = LoopConfig(policy_from(settings.policy), settings.control)
    loop = ControlLoop(cp, config, settings.control_interval_s, log)
    loop.start(cp.stopped)
    slos = ", ".join(f"{k} <= {v.max:g}" for k, v in config.policy.slos.set().items())
    log.info(
        "control loop: every %g s, %s mode, objectives: %s",
        settings.control_interval_s,
        settings.control,
        slos or "none",
    )
    return loop
