"""Each parallel mode's communication, predicted against measured: the closed loop per mode.

The cost model prices an iteration's communication by mode (its breakdown's ``tp_comm``,
``dp_comm``, ``ep_comm`` and ``pp_comm``, :mod:`dmsc.netmodel.iteration`); each worker's step trace
keeps the seconds it waited in each mode's exchanges and the bytes it sent
(:attr:`~dmsc.data.traces.StepTrace.comm`). A step's measured time of a mode is its slowest
worker's (the prediction is the critical path's); over a task's steps the median, so that the
first step's warm-up and a stray slow step do not lead. Bytes are what every worker of the step
sent in that mode, summed, median over steps.

The pipeline's measured time is each stage's waiting for its neighbours' activations and
gradients, and at a pipeline's start and end a stage waits for the others' compute as much as for
a transfer: it is compared with the prediction's ``pp_comm`` plus its ``bubble``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dmsc.data.traces import StepTrace

MODES = ("tp", "dp", "ep", "pp")
# a mode neither measured nor predicted to take this long is left out (a pipeline of one stage
# has a bubble of a few float roundings)
UNUSED_S = 1e-6
# the cost model's breakdown keys each mode's measured time is compared with
PREDICTED_KEYS: dict[str, tuple[str, ...]] = {
    "tp": ("tp_comm",),
    "dp": ("dp_comm",),
    "ep": ("ep_comm",),
    "pp": ("pp_comm", "bubble"),
}


@dataclass(frozen=True)
class ModeRow:
    """One mode's communication per step: predicted, measured, and what the workers sent."""

    mode: str
    predicted_s: float | None  # None: the prediction has no figure for it
    measured_s: float | None  # None: no step measured it
    measured_bytes: float | None
    steps: int  # the steps that measured it

    @property
    def ratio(self) -> float | None:
        """Measured over predicted (None when either is missing or the prediction is 0)."""
        if self.measured_s is None or not self.predicted_s:
            return None
        return self.measured_s / self.predicted_s

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "measured_bytes": self.measured_bytes,
            "ratio": self.ratio,
            "steps": self.steps,
        }


def measured_by_step(traces: Sequence[StepTrace]) -> dict[str, dict[int, tuple[float, int]]]:
    """Each mode's (seconds of the slowest worker, bytes of all workers) in each step."""
    out: dict[str, dict[int, tuple[float, int]]] = {}
    for t in traces:
        for mode, fig in t.comm.items():
            s, n = float(fig.get("s", 0.0)), int(fig.get("bytes", 0))
            top, total = out.setdefault(mode, {}).get(t.step, (0.0, 0))
            out[mode][t.step] = (max(top, s), total + n)
    return out


def compare_modes(
    predicted_breakdown: Mapping[str, float] | None, traces: Sequence[StepTrace]
) -> list[ModeRow]:
    """The table of each mode the prediction prices or the traces measured (in the order tp,
    dp, ep, pp): per step, predicted seconds against the measured median (module docstring)."""
    measured = measured_by_step(traces)
    pred = predicted_breakdown or {}
    rows = []
    for mode in MODES:
        keys = PREDICTED_KEYS[mode]
        predicted = sum(pred[k] for k in keys if k in pred) if keys[0] in pred else None
        steps = measured.get(mode, {})
        if not steps and (predicted or 0.0) < UNUSED_S:
            continue  # a mode the job does not use
        seconds = [s for s, _ in steps.values()]
        nbytes = [float(n) for _, n in steps.values()]
        rows.append(
            ModeRow(
                mode,
                predicted,
                statistics.median(seconds) if seconds else None,
                statistics.median(nbytes) if nbytes else None,
                len(steps),
            )
        )
    return rows
