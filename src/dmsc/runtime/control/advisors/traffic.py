"""Traffic prediction: bytes per stage boundary and per data-parallel exchange, and the step time,
forecast one step ahead from the measured series, with the forecaster's error on held-out steps.

The forecaster is Holt's linear exponential smoothing (a level and a trend, each smoothed;
Hyndman and Athanasopoulos, *Forecasting: Principles and Practice*, 3rd ed., section 8.2):

    forecast  f[t]  = l[t-1] + b[t-1]
    level     l[t]  = alpha * y[t] + (1 - alpha) * (l[t-1] + b[t-1])
    trend     b[t]  = beta * (l[t] - l[t-1]) + (1 - beta) * b[t-1]

started from l[0] = y[0], b[0] = y[1] - y[0]. ``alpha`` and ``beta`` are fitted on the first 80%
of the series (least squares of the one-step-ahead forecasts over a 0.1 grid; the recursion runs
on the whole grid at once) and then held fixed; the last 20% are held out: each held-out step is
forecast from the steps before it only, and the mean absolute error (MAE) and mean absolute
percentage error (MAPE) are reported beside the naive forecaster's (the last value) on the same
steps. A constant series (bytes per boundary when nothing changes) is forecast exactly by both;
Holt earns its place on a trending one (a step time that drifts, a boundary whose traffic grows).

The smoothing itself is :mod:`dmsc.data.forecast` (the serving autoscaler forecasts the request
rate with it too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dmsc.data.forecast import MIN_POINTS, Series, fit_holt, holt_forecasts
from dmsc.data.traces import StepTrace
from dmsc.runtime.control.advisors.base import RECENT_STEPS, Measurements, Proposal

HELD_OUT = 0.2  # the share of a series held out to measure the forecaster's error


def mae(actual: Series, forecast: Series) -> float:
    return float(np.mean(np.abs(actual - forecast)))


def mape_pct(actual: Series, forecast: Series) -> float | None:
    """Mean absolute percentage error over the non-zero actuals (None when all are zero)."""
    keep = actual != 0
    if not keep.any():
        return None
    return float(np.mean(np.abs((actual[keep] - forecast[keep]) / actual[keep])) * 100)


@dataclass(frozen=True)
class Forecast:
    """A series' next value and how well its forecaster did on the held-out steps."""

    next_value: float
    forecaster: str  # "holt" or "last value" (too few points to fit)
    alpha: float | None
    beta: float | None
    held_out: int  # steps held out (0: too few points to measure an error)
    mae: float | None
    mape_pct: float | None
    naive_mae: float | None
    naive_mape_pct: float | None

    def as_json(self) -> dict[str, float | int | str | None]:
        return dict(self.__dict__)


def forecast_series(values: Series | list[float]) -> Forecast:
    """Fit Holt on the first 80% of ``values``, measure it and the naive forecaster on the last
    20%, and forecast the next value from all of them."""
    y = np.asarray(values, dtype=float)
    n = len(y)
    if n == 0:
        raise ValueError("no measurements to forecast from")
    if n < MIN_POINTS:
        return Forecast(float(y[-1]), "last value", None, None, 0, None, None, None, None)
    held = max(1, math.floor(n * HELD_OUT))
    alpha, beta = fit_holt(y[: n - held])
    f = holt_forecasts(y, alpha, beta)[0]
    actual, holt, naive = y[n - held :], f[n - held : n], y[n - held - 1 : n - 1]
    return Forecast(
        next_value=float(f[n]),
        forecaster="holt",
        alpha=alpha,
        beta=beta,
        held_out=held,
        mae=mae(actual, holt),
        mape_pct=mape_pct(actual, holt),
        naive_mae=mae(actual, naive),
        naive_mape_pct=mape_pct(actual, naive),
    )


# -- the series, from the traces -------------------------------------------------------------------


def boundary_bytes(traces: list[StepTrace] | tuple[StepTrace, ...]) -> dict[int, list[float]]:
    """Bytes per step across each stage boundary (``b``: stage b <-> b+1, both directions: the
    activations forward, the gradients back), by step, over the steps in ``traces``."""
    steps = sorted({t.step for t in traces})
    index = {s: i for i, s in enumerate(steps)}
    out: dict[int, list[float]] = {}
    stages = {t.stage for t in traces}
    for b in range(max(stages, default=0)):
        out[b] = [0.0] * len(steps)
    for t in traces:
        for (peer_stage, _), n in t.sent.items():
            if abs(peer_stage - t.stage) == 1:
                out.setdefault(min(peer_stage, t.stage), [0.0] * len(steps))
                out[min(peer_stage, t.stage)][index[t.step]] += n
    return out


def exchange_bytes(traces: list[StepTrace] | tuple[StepTrace, ...]) -> dict[int, list[float]]:
    """Bytes per step of each stage's data-parallel exchange (between the replicas of one
    stage), by step; only stages whose replicas exchanged."""
    steps = sorted({t.step for t in traces})
    index = {s: i for i, s in enumerate(steps)}
    out: dict[int, list[float]] = {}
    for t in traces:
        for (peer_stage, peer_replica), n in t.sent.items():
            if peer_stage == t.stage and peer_replica != t.replica:
                out.setdefault(t.stage, [0.0] * len(steps))[index[t.step]] += n
    return out


def _fmt(value: float, unit: str) -> str:
    """Bytes in B, kB, MB or GB; seconds in ms below one."""
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    return f"{value:.3f} s" if abs(value) >= 1 else f"{value * 1e3:.1f} ms"


def _errors(f: Forecast, unit: str) -> str:
    if f.held_out == 0:
        return "too few steps to fit and measure a forecaster: the last value"

    def err(m: float | None, p: float | None) -> str:
        return _fmt(m or 0.0, unit) + (f" ({p:.1f}%)" if p is not None else "")

    return (
        f"Holt's held-out MAE {err(f.mae, f.mape_pct)}, the last value's "
        f"{err(f.naive_mae, f.naive_mape_pct)}, over {f.held_out} steps"
    )


class TrafficPrediction:
    """Forecasts each boundary's and exchange's bytes per step, and the step time."""

    name = "traffic"
    description = (
        "forecasts bytes per step of every stage boundary (per path) and data-parallel exchange, "
        "and the step time (Holt's linear smoothing; held-out error vs the last value)"
    )
    reads = "step traces (bytes sent to each peer), training metrics (step time), the plan's paths"
    proposes = "forecast"

    def propose(self, measurements: Measurements) -> list[Proposal]:
        out: list[Proposal] = []
        plan = measurements.plan
        paths = {p.after_stage: p for p in plan.paths}
        traces = measurements.traces
        for b, series in sorted(boundary_bytes(traces).items()):
            if not series:
                continue
            path = paths.get(b)
            if path is not None:
                where = f" ({path.source} -> {path.target} via {', '.join(path.links)})"
            else:
                where = f" (inside {plan.stages[b].datacenter})" if b < len(plan.stages) else ""
            out.append(self._proposal(f"boundary {b}->{b + 1}", series, "B", where))
        for stage, series in sorted(exchange_bytes(traces).items()):
            out.append(self._proposal(f"exchange stage {stage}", series, "B", ""))
        if measurements.metrics:  # the window the traces cover
            series = [m.step_s for m in measurements.metrics[-RECENT_STEPS:]]
            out.append(self._proposal("step time", series, "s", ""))
        return out

    def _proposal(self, target: str, series: list[float], unit: str, where: str) -> Proposal:
        f = forecast_series(series)
        per = "bytes/step" if unit == "B" else "s/step"
        return Proposal(
            module=self.name,
            kind="forecast",
            target=target,
            reason=f"next step {_fmt(f.next_value, unit)}{where}; {_errors(f, unit)}",
            details={"series": per, "points": len(series), **f.as_json()},
        )
