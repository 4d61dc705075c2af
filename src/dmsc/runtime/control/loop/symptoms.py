"""Alerts from the logs: a line of a worker or of the control plane that shows a failure (out of
memory, an NCCL or gloo error, a checkpoint error:
:func:`~dmsc.runtime.transport.log_search.symptom_of`) raises an alert as a broken objective
does: one row in ``alerts`` (``slo`` is ``log:NAME``), one warning in the control log, a post to
the policy's webhook.

Each tick reads what the logs gained since the tick before (with workers on Ray, the logs
their nodes hold on other machines too: their new lines that show a symptom,
:func:`~dmsc.runtime.control.launch.ray_logs.symptom_lines`)
(:class:`~dmsc.runtime.transport.log_search.LogTail`; the first tick, what they gained since the
control plane's process started: its start, which resumes from a checkpoint, comes before the
loop's first tick, and what an earlier control plane logged is not new). :func:`judge` is the
rule, pure: a symptom seen now and not open is raised, with how many lines showed it, on which
services, and the first of them; an open symptom seen again stays open (no second alert); one
not seen for the policy's window resolves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmsc.data.control_records import add_alert, set_alert
from dmsc.data.db import Database
from dmsc.data.records import _now
from dmsc.runtime.transport.log_search import Entry, LogTail, symptom_of

LINE_CHARS = 300  # of the first matching line, in the alert's reason


@dataclass(frozen=True)
class Seen:
    """A symptom the logs showed at one tick."""

    name: str
    what: str
    lines: int
    services: tuple[str, ...]
    first: str  # the first line that showed it, rendered


def seen(entries: Sequence[Entry]) -> list[Seen]:
    """The symptoms ``entries`` show, in the order they first appear."""
    found: dict[str, tuple[str, list[Entry]]] = {}
    for e in entries:
        s = symptom_of(e.line)
        if s is not None:
            found.setdefault(s.name, (s.what, []))[1].append(e)
    return [
        Seen(name, what, len(es), tuple(sorted({e.service for e in es})), es[0].rendered())
        for name, (what, es) in found.items()
    ]


def judge(
    now: Sequence[Seen], open_: Mapping[str, float], now_s: float, window_s: float
) -> tuple[list[Seen], list[str], dict[str, float]]:
    """The symptoms to raise (seen, not open), to resolve (open, not seen for ``window_s``),
    and the open ones after this tick with when each was last seen."""
    raised = [s for s in now if s.name not in open_]
    after = {**open_, **{s.name: now_s for s in now}}
    resolved = sorted(n for n, last in after.items() if now_s - last >= window_s)
    for n in resolved:
        del after[n]
    return raised, resolved, after


def remote_symptoms(cp: Any, since_s: float) -> Callable[[], list[Entry]] | None:
    """With the deployment's workers on Ray, what brings the symptom lines their nodes' logs
    gained on other machines (None: every log is on this machine)."""
    from dmsc.runtime.control.launch.ray_launcher import RayLauncher  # imports no Ray
    from dmsc.runtime.control.launch.ray_logs import symptom_lines

    if not isinstance(getattr(getattr(cp, "deployment", None), "launcher", None), RayLauncher):
        return None

    def remote() -> list[Entry]:
        dep = cp.deployment
        handles = [*dep.handles, *dep.tp.handles, *dep.spares.handles]
        return symptom_lines([h.process for h in handles], dep.home, since_s)

    return remote


class LogAlerts:
    """The symptom alerts of one run, from the logs in ``folder``."""

    def __init__(
        self,
        folder: Path,
        db: Database,
        run_id: int,
        log: logging.Logger,
        post: Callable[[int], None] | None = None,
        since_s: float | None = None,
        remote: Callable[[], Sequence[Entry]] | None = None,
    ) -> None:
        self.tail = LogTail(folder, since_s)
        self.remote = remote  # other machines' new symptom lines (workers on Ray)
        self.db, self.run_id, self.log, self.post = db, run_id, log, post
        self.open: dict[str, float] = {}  # symptom -> last seen (unix seconds)
        self.alert_ids: dict[str, int] = {}
        if since_s is None:
            self.tail.read()  # from here on: what the logs held before is not new

    def once(self, now_s: float, window_s: float) -> list[int]:
        """Read the logs' new lines, raise and resolve (module docstring); the alerts raised."""
        entries = self.tail.read()
        if self.remote is not None:
            entries = [*entries, *self.remote()]
        raised, resolved, self.open = judge(seen(entries), self.open, now_s, window_s)
        for name in resolved:
            alert = self.alert_ids.pop(name, None)
            if alert is not None:
                set_alert(self.db, alert, resolved_at=_now())
                self.log.info("alert %d resolved: no log line showed %s for %g s", alert, name,
                              window_s)  # fmt: skip
        out = []
        for s in raised:
            where = ", ".join(s.services)
            n = f"{s.lines} log line{'s' if s.lines > 1 else ''}"
            reason = f"{n} of {where} showed {s.what}: {s.first[:LINE_CHARS]}"
            alert = add_alert(
                self.db, self.run_id, slo=f"log:{s.name}", value=float(s.lines), objective=0.0,
                reason=reason, task_id=None, exception_task=None, action="alert",
                action_outcome="", webhook="pending" if self.post is not None else "",
            )  # fmt: skip
            self.alert_ids[s.name] = alert
            out.append(alert)
            self.log.warning("alert %d: log:%s: %s", alert, s.name, reason)
            if self.post is not None:
                self.post(alert)
        return out
