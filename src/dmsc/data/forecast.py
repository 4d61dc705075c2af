"""Forecasting a measured series: Holt's linear exponential smoothing (a level and a trend, each
smoothed; Hyndman and Athanasopoulos, *Forecasting: Principles and Practice*, 3rd ed., 8.2):

    forecast  f[t+h] = l[t] + h * b[t]
    level     l[t]   = alpha * y[t] + (1 - alpha) * (l[t-1] + b[t-1])
    trend     b[t]   = beta * (l[t] - l[t-1]) + (1 - beta) * b[t-1]

started from l[0] = y[0], b[0] = y[1] - y[0]; ``alpha`` and ``beta`` fitted by least squares of
the one-step-ahead forecasts over a 0.1 grid (the recursion runs on the whole grid at once).

Here, below the runtime, because two layers read it: the traffic prediction module
(:mod:`dmsc.runtime.control.advisors.traffic`, bytes per boundary, step time, link rates) and
the serving autoscaler (:mod:`dmsc.runtime.control.serving.autoscale`, the request rate over the
time a new replica takes to start). Written in numpy rather than taken from statsmodels (its
``ExponentialSmoothing`` fits the same model): statsmodels is not a dependency, and the model is
the few lines above.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

GRID = np.round(np.arange(0.0, 1.0001, 0.1), 10)  # alpha (from 0.1) and beta (from 0) candidates
MIN_POINTS = 5  # fewer: the last value is the forecast

Series = npt.NDArray[np.float64]


def _smooth(y: Series, a: Series, b: Series) -> tuple[Series, Series, Series]:
    """The one-step-ahead forecasts (as :func:`holt_forecasts`), the last level and trend."""
    n = len(y)
    if n < 2:
        raise ValueError("Holt's smoothing needs at least two points")
    out = np.full((len(a), n + 1), np.nan)
    level = np.full(len(a), y[0])
    trend = np.full(len(a), y[1] - y[0])
    for t in range(1, n):
        forecast = level + trend
        if t >= 2:
            out[:, t] = forecast
        new_level = a * y[t] + (1 - a) * forecast
        trend = b * (new_level - level) + (1 - b) * trend
        level = new_level
    out[:, n] = level + trend
    return out, level, trend


def holt_forecasts(y: Series, alpha: Series | float, beta: Series | float) -> Series:
    """One-step-ahead forecasts of Holt's linear smoothing: row ``k`` of the result holds, for
    parameter pair ``k``, ``f[t]`` of ``y[t]`` from ``y[:t]`` at column ``t`` (``t`` = 2 .. n-1)
    and the forecast of the next, unseen value at column ``n``; columns 0 and 1 are NaN (they
    start the level and the trend). ``alpha`` and ``beta``: scalars or equal-length arrays (a
    grid, run at once)."""
    a = np.atleast_1d(np.asarray(alpha, dtype=float))
    b = np.atleast_1d(np.asarray(beta, dtype=float))
    return _smooth(y, a, b)[0]


def fit_holt(y: Series) -> tuple[float, float]:
    """The (alpha, beta) of the grid whose one-step-ahead forecasts of ``y`` have the least
    squared error (ties: the smallest alpha, then beta)."""
    aa, bb = np.meshgrid(GRID[1:], GRID, indexing="ij")
    alphas, betas = aa.ravel(), bb.ravel()
    f = holt_forecasts(y, alphas, betas)[:, 2 : len(y)]
    sse = ((f - y[2:]) ** 2).sum(axis=1)
    best = int(np.argmin(sse))  # argmin returns the first of equal minima
    return float(alphas[best]), float(betas[best])


def forecast_ahead(values: Series | list[float], steps: float) -> float:
    """The value ``steps`` samples after the last of ``values`` (``steps`` may be fractional):
    Holt fitted on all of them, ``l + steps * b``; the last value when there are fewer than
    :data:`MIN_POINTS`. ValueError when ``values`` is empty."""
    y = np.asarray(values, dtype=float)
    if len(y) == 0:
        raise ValueError("no measurements to forecast from")
    if len(y) < MIN_POINTS:
        return float(y[-1])
    alpha, beta = fit_holt(y)
    _, level, trend = _smooth(y, np.array([alpha]), np.array([beta]))
    return float(level[0] + steps * trend[0])
