"""Alerts for the workers the runtime replaced: a lost device or worker made visible to the loop.

The runtime brings a dead worker back by itself, whether the loop runs or not: the session's
recovery during a training task and the watchdog's heal of a serving replica
(:mod:`dmsc.runtime.control.launch.recovery`), or the shrink of dp when a lost Ray node leaves
no room for a replacement (:mod:`dmsc.runtime.control.training.shrink`). Each writes one
``worker`` row in ``faults``. The loop reads those rows with its snapshot, and each one new
since the control plane's process started (:func:`judge`, pure) becomes

- one row in ``alerts`` (``slo`` ``fault:worker``, ``value`` the seconds the runtime took to
  recover, ``objective`` 0) whose reason names the SIDs replaced, the cause and the time to
  recover; resolved at once when the runtime had recovered, else when a later tick sees the
  row recovered;
- one warning in the control log and a post to the policy's webhook, as for other alerts;
- one decision row (module ``recovery``, verdict ``note``) with what the loop did about it:
  "recovered by the runtime in X s" (nothing was left for it to do), or that the weights were
  not restored (no checkpoint verified), which no move of the loop restores either.

Devices that stay lost (a Ray node gone and no shrink made) are the tick's own alert, raised
while the devices online fall short of the replicas (:func:`.tick.device_breaches`), with the
forced resize (:mod:`.resizing`) as the loop's decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from dmsc.data.control_records import add_alert, add_decision, set_alert, set_decision
from dmsc.data.db import Database
from dmsc.data.records import _now
from dmsc.runtime.control.advisors.base import FaultInfo

MODULE = "recovery"  # the decision rows' module
KIND = "worker"  # the fault rows that are replacements of workers
CAUSE_CHARS = 300  # of the fault's cause, in the alert's reason


def judge(
    faults: Sequence[FaultInfo], alerted: Collection[int], open_: Collection[int], since_s: float
) -> tuple[list[FaultInfo], list[FaultInfo]]:
    """The worker faults to raise (detected at or after ``since_s``, not ``alerted`` yet), and
    those of the ``open_`` alerts that the runtime has recovered since."""
    new = [
        f
        for f in faults
        if f.kind == KIND and f.id and f.id not in alerted and f.detected_s >= since_s
    ]  # a fault of no row (id 0) is not one the runtime recorded
    back = [f for f in faults if f.id in open_ and f.recovered_s is not None]
    return new, back


def recover_s(f: FaultInfo) -> float | None:
    """The seconds the runtime took to bring ``f``'s workers back (None: not recovered)."""
    return None if f.recovered_s is None else max(0.0, f.recovered_s - f.detected_s)


def describe(f: FaultInfo) -> tuple[str, str]:
    """The alert's reason for ``f``, and the outcome its decision row records."""
    sids = f.services or "unnamed workers"
    took = recover_s(f)
    cause = f.reason[:CAUSE_CHARS]
    if took is None:
        outcome = "not recovered: no checkpoint verified, the weights are not restored"
    else:
        outcome = f"recovered by the runtime in {took:.2f} s"
    lost = f", {f.steps_lost} steps run again" if f.steps_lost else ""
    return f"worker(s) {sids} lost and replaced: {cause}; {outcome}{lost}", outcome


class FaultAlerts:
    """The replacement alerts of one run (module docstring)."""

    def __init__(
        self,
        db: Database,
        run_id: int,
        log: logging.Logger,
        mode: str,
        since_s: float,
        post: Callable[[int], None] | None = None,
    ) -> None:
        self.db, self.run_id, self.log, self.mode = db, run_id, log, mode
        self.since_s, self.post = since_s, post
        self.alerted: dict[int, int] = {}  # fault id -> its alert
        self.open: dict[int, tuple[int, int]] = {}  # not recovered: fault -> (alert, decision)

    def once(self, faults: Sequence[FaultInfo], tick: int) -> list[int]:
        """Raise an alert per new fault, resolve those recovered since; the alerts raised."""
        new, back = judge(faults, self.alerted, self.open, self.since_s)
        for f in back:
            alert, decision = self.open.pop(f.id)
            _, outcome = describe(f)
            set_alert(self.db, alert, resolved_at=_now(), action_outcome=outcome)
            set_decision(self.db, decision, outcome=outcome)
            self.log.info("alert %d resolved: fault %d %s", alert, f.id, outcome)
        raised = []
        for f in new:
            reason, outcome = describe(f)
            took = recover_s(f)
            alert = add_alert(
                self.db, self.run_id, slo=f"fault:{f.kind}", value=took or 0.0, objective=0.0,
                reason=reason, task_id=f.task_id, exception_task=None, action="alert",
                action_outcome=outcome, webhook="pending" if self.post is not None else "",
                resolved_at=None if took is None else _now(),
            )  # fmt: skip
            decision = add_decision(
                self.db, self.run_id, tick=tick, mode=self.mode, module=MODULE, kind="keep",
                target=(f.services or f"fault {f.id}")[:128], verdict="note",
                reason=f"{reason}\nthe runtime replaces lost workers by itself: noted",
                outcome=outcome, details={"fault": f.id, "recover_s": took},
            )  # fmt: skip
            self.alerted[f.id] = alert
            if took is None:
                self.open[f.id] = (alert, decision)
            self.log.warning(
                "alert %d: fault:%s: %s",
                alert,
                f.kind,
                reason,
                extra={"alert": alert, "slo": f"fault:{f.kind}", "decision": decision},
            )
            if self.post is not None:
                self.post(alert)
            raised.append(alert)
        return raised
