"""The figures of ``benchmarks/control_loop.py``, pure: computed from the rows a run left in the
database (decisions, alerts, scale events) and from its measurements (step times, request
latencies), with the time the fault was injected. No clock, no I/O:
tests/runtime/control/loop/test_benchmark_figures.py checks them
on rows written by hand.

A row is a plain dict (:func:`decision_row`, :func:`alert_row`, :func:`scale_row` make them from
the database's records):

- a decision of the control loop: ``{"source": "decision", "t", "module", "kind", "target",
  "verdict", "outcome"}``;
- an alert: ``{"source": "alert", "t", "slo", "action", "outcome"}``;
- a scale event (a serving replica added by the autoscaler or by a policy's ``scale-out``, or
  the deployment moved): ``{"source": "scale", "t", "action", "reason"}``.

``t`` is unix seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]

# a decision that names something to do: a move to apply, an exception raised into the queue
ACTING_VERDICTS = ("apply", "raise")
# an alert whose policy's action changes the deployment itself (``move`` only lets path
# optimisation's move through below the threshold: the move's own decision row is the decision)
ACTING_ALERTS = ("scale-out",)
P99_WINDOW_S = 5.0  # the inference objective is judged per window of arrivals (forecast_ramp.py)


def decision_row(t: float, rec: Any) -> dict[str, Any]:
    return {
        "source": "decision",
        "t": t,
        "module": rec.module,
        "kind": rec.kind,
        "target": rec.target,
        "verdict": rec.verdict,
        "outcome": rec.outcome,
    }


def alert_row(t: float, rec: Any) -> dict[str, Any]:
    return {
        "source": "alert",
        "t": t,
        "slo": rec.slo,
        "action": rec.action,
        "outcome": rec.action_outcome,
    }


def scale_row(t: float, rec: Any) -> dict[str, Any]:
    return {"source": "scale", "t": t, "action": rec.action, "reason": rec.reason}


def label(row: Row) -> str:
    """What a row was, in a few words: ``paths/move-stage: apply``, ``alert step_time_s``,
    ``scale out (autoscaler)``, ``scale refused (policy)``, ``scale move``."""
    if row["source"] == "decision":
        return f"{row['module']}/{row['kind']}: {row['verdict']}"
    if row["source"] == "alert":
        return f"alert {row['slo']}"
    if row["action"] == "move":
        return "scale move"  # the deployment moved (the loop's move)
    who = "policy" if str(row["reason"]).startswith("policy:") else "autoscaler"
    return f"scale {row['action']} ({who})"  # a serving replica added, removed or refused


def _remedies(row: Row) -> bool:
    """Whether ``row`` decides to change the deployment: a move accepted, an alert whose policy
    names ``scale-out``."""
    if row["source"] == "decision":
        return bool(row["verdict"] == "apply")
    if row["source"] == "alert":
        return row["action"] in ACTING_ALERTS
    return False


def _acts(row: Row) -> bool:
    """Whether ``row`` decides anything: a remedy, or an exception raised into the queue."""
    return _remedies(row) or (row["source"] == "decision" and row["verdict"] in ACTING_VERDICTS)


def _applied(act: Row, later: Sequence[Row]) -> Row | None:
    """The scale event that carried ``act`` out: the move a decision applied (its outcome says
    so), or the replica a policy's ``scale-out`` added; None when nothing was applied."""
    if act["source"] == "decision":
        if act["verdict"] != "apply" or not str(act["outcome"]).startswith("applied"):
            return None
        wanted = ("move",)
    else:
        wanted = ("out",)
    for r in later:
        if r["source"] != "scale" or r["action"] not in wanted:
            continue
        if wanted == ("out",) and not str(r["reason"]).startswith("policy:"):
            continue  # the autoscaler's own replica, not the alert's
        return r
    return None


def loop_figures(fault_s: float, rows: Iterable[Row]) -> dict[str, Any]:
    """Time to detect, to decide and to apply, and the decisions made, from the rows at or after
    the fault (``fault_s``, unix seconds):

    - ``detect_s``: the fault to the loop's first row about it: an alert, or a decision other
      than a note (a forecast, a "keep", which the modules write whatever they measured);
    - ``decide_s``: that first row to the decision on the fault: the first that changed the
      deployment (a move accepted and applied, an alert whose policy names ``scale-out`` and
      the replica it added; one accepted and then withdrawn by a later tick's refusal did
      not), else the first accepted, or, where none is, the first exception raised into the
      queue;
    - ``apply_s``: that decision to the scale event that carried it out (the move done, the
      replica serving); None when it was not applied;
    - ``decisions``: how many rows of each kind (:func:`label`), autoscaler events included;
    - ``autoscaler_out_s``: the fault to each replica the autoscaler added by itself;
    - ``timeline``: every row after the fault, its time since the fault.

    A figure is None when its event did not happen."""
    after = sorted((r for r in rows if r["t"] >= fault_s), key=lambda r: r["t"])
    loop = [r for r in after if r["source"] in ("decision", "alert")]
    # notes (a forecast, "keep" the placement) are written whatever was measured: not a sign
    seen = [r for r in loop if not (r["source"] == "decision" and r["verdict"] == "note")]
    detect = seen[0]["t"] if seen else None
    # the decision that changed the deployment (a move accepted, then withdrawn when a later
    # tick refused it, did not), else the first accepted, else the first that escalates
    remedies = [r for r in loop if _remedies(r)]
    done = [r for r in remedies if _applied(r, [a for a in after if a["t"] >= r["t"]])]
    act = next(iter(done + remedies), None) or next((r for r in loop if _acts(r)), None)
    applied = None
    if act is not None:
        applied = _applied(act, [r for r in after if r["t"] >= act["t"]])
    own = [
        r["t"] - fault_s
        for r in after
        if r["source"] == "scale"
        and r["action"] == "out"
        and not str(r["reason"]).startswith("policy:")
    ]
    return {
        "detect_s": None if detect is None else detect - fault_s,
        "decide_s": None if act is None or detect is None else act["t"] - detect,
        "apply_s": None if applied is None or act is None else applied["t"] - act["t"],
        "fault_to_applied_s": None if applied is None else applied["t"] - fault_s,
        "decision": None if act is None else label(act),
        "outcome": None if act is None else act.get("outcome"),
        "decisions": dict(sorted(Counter(label(r) for r in after).items())),
        "decisions_total": len(after),
        "autoscaler_out_s": own,
        # every row after the fault: seconds after it, what it was, its outcome or reason
        "timeline": [
            [
                round(r["t"] - fault_s, 2),
                label(r),
                str(r.get("outcome") or r.get("reason") or "")[:160],
            ]
            for r in after
        ],
    }


def step_seconds_over(step_s: Iterable[float], objective_s: float) -> float:
    """The seconds a training task spent in steps slower than ``objective_s`` (the time it ran
    out of its step-time objective)."""
    return float(sum(s for s in step_s if s > objective_s))


def nearest_rank(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile by nearest rank (as the loop judges ``infer_p99_s``)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def p99_seconds_over(
    requests: Iterable[tuple[float, float]],
    objective_s: float,
    start_s: float,
    end_s: float,
    window_s: float = P99_WINDOW_S,
) -> float:
    """The seconds of ``[start_s, end_s)`` whose window of ``window_s`` (by arrival) has its
    requests' p99 latency above ``objective_s``; ``requests`` are (arrival, latency) pairs. A
    window with no answered request counts as over (nothing was served in it)."""
    reqs = list(requests)
    over = 0.0
    for w in range(math.ceil((end_s - start_s) / window_s - 1e-9)):
        lo = start_s + w * window_s
        hi = min(lo + window_s, end_s)
        inside = [lat for t, lat in reqs if lo <= t < hi]
        if not inside or nearest_rank(inside, 99) > objective_s:
            over += hi - lo
    return over
