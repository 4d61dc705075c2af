"""The figures of benchmarks/control_loop.py (benchmarks/_loop_figures.py), on rows written by
hand: time to detect, decide and apply, the decisions counted, and the seconds over an
objective (the inference windows checked against numpy's percentile by nearest rank)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[4] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    import _loop_figures as lf
finally:
    sys.path.remove(str(BENCH))

T = 1_800_000_000.0  # the fault


def _decision(t: float, module: str, kind: str, verdict: str, outcome: str = "") -> Any:
    rec = SimpleNamespace(module=module, kind=kind, target="x", verdict=verdict, outcome=outcome)
    return lf.decision_row(T + t, rec)


def _alert(t: float, slo: str, action: str = "alert", outcome: str = "") -> Any:
    return lf.alert_row(T + t, SimpleNamespace(slo=slo, action=action, action_outcome=outcome))


def _scale(t: float, action: str, reason: str) -> Any:
    return lf.scale_row(T + t, SimpleNamespace(action=action, reason=reason))


def test_a_move_detected_decided_deferred_and_applied() -> None:
    rows = [
        _decision(-5.0, "traffic", "forecast", "note"),  # before the fault: not counted
        _alert(1.0, "step_time_s", "move"),
        _decision(1.0, "control-loop", "exception", "raise", "raised: task 3"),
        _decision(11.0, "paths", "move-stage", "refuse"),
        _decision(21.0, "paths", "move-stage", "apply", "applied in 4.0 s"),
        _scale(30.0, "move", "stage 0: site-a -> site-c"),
    ]
    got = lf.loop_figures(T, rows)
    # detected by the alert; decided when the move was accepted (deferred while the task ran),
    # applied when the move was done
    assert (got["detect_s"], got["decide_s"], got["apply_s"]) == (1.0, 20.0, 9.0)
    assert got["decision"] == "paths/move-stage: apply"
    assert got["decisions"] == {
        "alert step_time_s": 1,
        "control-loop/exception: raise": 1,
        "paths/move-stage: apply": 1,
        "paths/move-stage: refuse": 1,
        "scale move": 1,
    }
    assert got["decisions_total"] == 5


def test_an_accepted_move_counts_from_its_row_to_the_move() -> None:
    rows = [
        _decision(0.5, "traffic", "forecast", "note"),  # written whatever happens: no sign
        _decision(2.0, "paths", "move-stage", "refuse"),
        _decision(12.0, "paths", "move-stage", "apply", "applied in 4.0 s"),
        _scale(20.0, "move", "stage 0"),
    ]
    got = lf.loop_figures(T, rows)
    assert (got["detect_s"], got["decide_s"], got["apply_s"]) == (2.0, 10.0, 8.0)
    assert got["fault_to_applied_s"] == 20.0 and got["outcome"] == "applied in 4.0 s"


def test_a_move_withdrawn_then_accepted_again_counts_the_one_applied() -> None:
    """control_loop.py's busy node: accepted at 6.0 s, withdrawn by the next tick's refusal,
    accepted again at 10.1 s and applied at 10.4 s; the first acceptance had read as the
    decision, and its withdrawal as nothing applied."""
    rows = [
        _decision(4.0, "busy-node", "move-node", "refuse"),
        _decision(6.0, "busy-node", "move-node", "apply", "withdrawn: no longer accepted"),
        _decision(7.0, "busy-node", "move-node", "refuse"),
        _decision(10.1, "busy-node", "move-node", "apply", "applied in 0.3 s"),
        _scale(10.4, "move", "stage 0 replica 0: node 0 -> node 1 in dc"),
    ]
    f = lf.loop_figures(T, rows)
    assert f["detect_s"] == pytest.approx(4.0)
    assert f["decide_s"] == pytest.approx(6.1)
    assert f["apply_s"] == pytest.approx(0.3)
    assert f["outcome"] == "applied in 0.3 s"
    assert f["decisions"]["busy-node/move-node: apply"] == 2


def test_an_exception_alone_is_decided_and_never_applied() -> None:
    rows = [_alert(3.0, "step_time_s"), _decision(3.5, "control-loop", "exception", "raise")]
    got = lf.loop_figures(T, rows)
    assert (got["detect_s"], got["decide_s"], got["apply_s"]) == (3.0, 0.5, None)
    assert got["decision"] == "control-loop/exception: raise"


def test_a_scale_out_is_the_policys_replica_not_the_autoscalers() -> None:
    rows = [
        _scale(2.0, "out", "load 4.0 in flight > 2 x 1 replicas"),  # the autoscaler's own
        _alert(4.0, "infer_p99_s", "scale-out"),
        _scale(9.0, "refused", "policy: infer_p99_s 1.6 > 1; no free devices left"),
        _scale(15.0, "out", "policy: infer_p99_s 1.6 > 1"),
    ]
    got = lf.loop_figures(T, rows)
    assert (got["detect_s"], got["decide_s"], got["apply_s"]) == (4.0, 0.0, 11.0)
    assert got["autoscaler_out_s"] == [2.0]
    assert got["decisions"]["scale out (autoscaler)"] == 1
    assert got["decisions"]["scale out (policy)"] == 1
    assert got["decisions"]["scale refused (policy)"] == 1


def test_nothing_after_the_fault_is_no_figure() -> None:
    got = lf.loop_figures(T, [_decision(-1.0, "paths", "keep", "note")])
    assert got["detect_s"] is None and got["decide_s"] is None and got["apply_s"] is None
    assert got["decisions"] == {} and got["decisions_total"] == 0


def test_the_seconds_in_steps_over_the_objective() -> None:
    assert lf.step_seconds_over([0.2, 0.7, 0.5, 0.9], 0.5) == pytest.approx(1.6)
    assert lf.step_seconds_over([], 0.5) == 0.0


def test_the_seconds_whose_p99_is_over_the_objective() -> None:
    rng = np.random.default_rng(0)
    start, end = 100.0, 122.0  # four whole windows of 5 s and one of 2 s
    arrivals = np.sort(rng.uniform(start, end, 400))
    latency = np.where(arrivals < 110, 0.2, rng.uniform(0.5, 2.0, 400))
    requests = list(zip(arrivals.tolist(), latency.tolist(), strict=True))
    over = 0.0  # the reference: numpy's nearest-rank percentile (the "inverted_cdf" method)
    for lo in (100.0, 105.0, 110.0, 115.0, 120.0):
        hi = min(lo + 5, end)
        inside = latency[(arrivals >= lo) & (arrivals < hi)]
        if not len(inside) or np.percentile(inside, 99, method="inverted_cdf") > 1.0:
            over += hi - lo
    assert lf.p99_seconds_over(requests, 1.0, start, end) == pytest.approx(over)
    assert over == pytest.approx(12.0)  # the three windows after 110 s
    # a window with no answer counts as over: nothing was served in it
    assert lf.p99_seconds_over([(101.0, 0.1)], 1.0, 100.0, 110.0) == pytest.approx(5.0)
