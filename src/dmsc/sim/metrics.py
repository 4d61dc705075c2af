"""Figures over seeds: means with 95% confidence intervals, and changes against the baseline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.special import stdtrit

if TYPE_CHECKING:
    from dmsc.sim.engine import RunResult

METRICS = (
    "blocking_probability",
    "transfer_blocking_probability",
    "mean_iteration_time_s",
    "p95_iteration_time_s",
    "bubble_ratio",
    "spectrum_utilization",
    "gpu_utilization",
)


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student t; 0 for one value)."""
    xs = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return math.nan, math.nan
    if xs.size == 1:
        return float(xs[0]), 0.0
    # Student t's 97.5% quantile (scipy.special's: scipy.stats takes a second to import)
    half = stdtrit(xs.size - 1, 0.975) * xs.std(ddof=1) / math.sqrt(xs.size)
    return float(xs.mean()), float(half)


def summarize(runs: Sequence[RunResult]) -> dict[str, Any]:
    """One scheduler at one load, over its seeds."""
    out: dict[str, Any] = {}
    for name in METRICS:
        mean, half = mean_ci([getattr(r, name) for r in runs])
        out[name] = mean
        out[f"{name}_ci95"] = half
    out["slowdown"] = mean_ci(
        [float(np.mean(r.slowdowns)) if r.slowdowns else math.nan for r in runs]
    )[0]
    out["arrivals"] = sum(r.arrivals for r in runs)
    out["blocked"] = sum(r.blocked for r in runs)
    out["blocked_gpu"] = sum(r.blocked_gpu for r in runs)
    out["blocked_spectrum"] = sum(r.blocked_spectrum for r in runs)
    out["transfer_requests"] = sum(r.transfer_requests for r in runs)
    out["transfer_blocked"] = sum(r.transfer_blocked for r in runs)
    out["events"] = sum(r.events for r in runs)
    out["wall_s"] = sum(r.wall_s for r in runs)
    out["seeds"] = len(runs)
    return out


def relative_change(summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    """Percent change of each metric against the baseline's (negative: lower than baseline)."""
    out = {}
    for name in METRICS:
        b, s = baseline[name], summary[name]
        out[name] = (s - b) / b * 100 if b and not math.isnan(b) else math.nan
    return out
