"""Each parallel mode's communication, predicted against measured: the closed loop per mode.

The cost model prices an iteration's communication by mode (its breakdown's ``tp_comm``,
``dp_comm``, ``ep_comm`` and ``pp_comm``, :mod:`dmsc.netmodel.iteration`); each worker's step trace
keeps the seconds it waited in each mode's exchanges and the bytes it sent
(:attr:`~dmsc.data.traces.StepTrace.comm`). A step's measured time of tensor parallelism and of
the pipeline is its slowest worker's (the prediction is the critical path's). Data and expert
parallelism exchange among a stage's replicas, and a replica that ended its backward (or its
experts' forward) first waits in the exchange for the others' compute as well, which the cost
model prices as compute, not as the exchange: their measured time is, in each stage, the wait of
the replica that waited least (the one the others waited for: its wait is the exchange's exposed
time alone), and the step's the slowest stage's. The slowest worker's wait is kept beside it
(``slowest_s``). Over a task's steps the median, so that the first step's warm-up and a stray
slow step do not lead; but a mode exchanged in some steps only (DiLoCo's and FedAvg's rounds,
once every ``H`` steps) the sum over the steps' count, as the cost model spreads a round over its
``H`` iterations. Bytes are what every worker of the step sent in that mode, summed, per step
the same way.

The least-waiting replica stands for the exchange only where every replica leaves it together,
as from an all-reduce. Through a leader (the star), the replicas leave one by one as the leader
sends each its average, and the first served waited least while the others and the step still
waited: at dp = 4 the least wait was 16 ms where the last replica's was 27
(``benchmarks/parallel_modes.py``, 2026-12-05). So a data-parallel exchange that each replica
of a stage made once in the step, timed with its wall-clock entry and exit (the meter's ``t0``
and ``t1``, :mod:`dmsc.runtime.compute.comm_meter`), is measured from the last replica's entry
to the last one's exit: what the step waited for it after the last backward, whatever the
exchange's shape. It is kept between the least and the most any replica waited, so that
clocks of different machines apart by a little cannot carry it outside what was measured. The
expert-parallel all-to-alls come put together call by call over each group by the deployment
(each call from the last replica's entry to the last one's exit), and their measured time is the
slowest group's.

The pipeline's measured time is each stage's waiting for its neighbours' activations and
gradients, and at a pipeline's start and end a stage waits for the others' compute as much as for
a transfer: it is compared with the prediction's ``pp_comm`` plus its ``bubble``, the step's
time beyond the slowest stage's own micro-batches. A faster stage also waits for the slower one's
extra compute at every micro-batch, which the cost model prices as compute (the slowest stage's,
``compute``), not as the pipeline's: so where the workers' traces carry their operations'
spans, a worker's pipeline wait is counted less the compute its replica's slowest stage did
beyond its own (:func:`pipeline_wait`), and the step's is the most of those. Counted whole, a
gpt-mini pp = 2 run's first stage (20.7 ms of compute a micro-batch against the second's 22.3)
waited 25.2 ms a step, its 3.2 ms of imbalance included, where 22.0 is the pipeline's and the
prediction 22.8 (2026-12-05): the runs measured 1.08-1.19 times their prediction that way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from dmsc.data.traces import StepTrace

MODES = ("tp", "dp", "ep", "pp")
# the modes whose groups are a stage's replicas: measured by the replica that waited least
AMONG_REPLICAS = ("dp", "ep")
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
    slowest_s: float | None = None  # the slowest worker's wait (dp, ep: with the others' compute)

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
            "slowest_s": self.slowest_s,
        }


def measured_by_step(
    traces: Sequence[StepTrace],
) -> dict[str, dict[int, tuple[float, int, float]]]:
    """Each mode's (measured seconds, bytes of all workers, seconds of the slowest worker) in
    each step; the measured seconds the slowest worker's, but for :data:`AMONG_REPLICAS` the
    slowest stage's exposed wait (:func:`exposed_wait`: its least-waiting replica's, or for a
    data-parallel exchange timed on the wall clock, from the last entry to the last exit)."""
    figs: dict[str, dict[int, dict[int, list[Mapping[str, Any]]]]] = {}  # mode, step, stage
    sent: dict[str, dict[int, int]] = {}
    for t in traces:
        for mode, fig in t.comm.items():
            by_stage = figs.setdefault(mode, {}).setdefault(t.step, {})
            by_stage.setdefault(t.stage, []).append(fig)
            steps = sent.setdefault(mode, {})
            steps[t.step] = steps.get(t.step, 0) + int(fig.get("bytes", 0))
    out: dict[str, dict[int, tuple[float, int, float]]] = {}
    pipeline = pipeline_wait(traces)
    for mode, by_step in figs.items():
        for step, by_stage in by_step.items():
            slowest = max(_wait(f) for ws in by_stage.values() for f in ws)
            exposed = max(exposed_wait(mode, ws) for ws in by_stage.values())
            measured = exposed if mode in AMONG_REPLICAS else slowest
            if mode == "pp" and step in pipeline:
                measured = pipeline[step]
            out.setdefault(mode, {})[step] = (measured, sent[mode][step], slowest)
    return out


def pipeline_wait(traces: Sequence[StepTrace]) -> dict[int, float]:
    """Each step's pipeline wait without the wait for a slower stage's compute (module
    docstring): over each replica's stages, the most any waited less the compute (its
    operations' spans) its slowest stage did beyond its own, kept between 0 and the most any
    worker waited. Only the steps whose every worker with a pipeline wait has spans."""
    by_step: dict[int, dict[int, list[tuple[float, float]]]] = {}  # step, replica: (wait, busy)
    whole: set[int] = set()
    for t in traces:
        if "pp" not in t.comm:
            continue
        if not t.spans:
            whole.add(t.step)
            continue
        busy = sum(end - start for _, _, start, end in t.spans)
        by_step.setdefault(t.step, {}).setdefault(t.replica, []).append((_wait(t.comm["pp"]), busy))
    out = {}
    for step, replicas in by_step.items():
        if step in whole:
            continue
        most = max(w for stages in replicas.values() for w, _ in stages)
        waits = [
            w - (max(b for _, b in stages) - busy)
            for stages in replicas.values()
            for w, busy in stages
        ]
        out[step] = min(max(max(waits), 0.0), most)
    return out


def _wait(fig: Mapping[str, Any]) -> float:
    return float(fig.get("s", 0.0))


def exposed_wait(mode: str, replicas: Sequence[Mapping[str, Any]]) -> float:
    """The exposed time of one stage's exchange of ``mode`` in a step, from its replicas'
    figures: for a data-parallel exchange each made once with its wall-clock entry and exit,
    from the last entry to the last exit, kept between the least and the most wait; for the
    expert-parallel all-to-alls put together call by call over each group
    (:func:`dmsc.runtime.compute.comm_meter.replicas_exposed`, which keeps each replica's own
    wait as ``wait_s``), the slowest group's; else the least-waiting replica's wait (module
    docstring)."""
    waits = [_wait(f) for f in replicas]
    least, most = min(waits), max(waits)
    if mode == "ep" and all("wait_s" in f for f in replicas):
        return most  # each replica's its group's exposed time already: the slowest group's
    timed = all(f.get("calls") == 1 and "t0" in f and "t1" in f for f in replicas)
    if mode != "dp" or len(replicas) < 2 or not timed:
        return least
    span = max(float(f["t1"]) for f in replicas) - max(float(f["t0"]) for f in replicas)
    return min(max(span, least), most)


def compare_modes(
    predicted_breakdown: Mapping[str, float] | None, traces: Sequence[StepTrace]
) -> list[ModeRow]:
    """The table of each mode the prediction prices or the traces measured (in the order tp,
    dp, ep, pp): per step, predicted seconds against the measured median (module docstring)."""
    measured = measured_by_step(traces)
    window = {t.step for t in traces}  # every step traced, whichever modes it measured
    pred = predicted_breakdown or {}
    rows = []
    for mode in MODES:
        keys = PREDICTED_KEYS[mode]
        predicted = sum(pred[k] for k in keys if k in pred) if keys[0] in pred else None
        steps = measured.get(mode, {})
        if not steps and (predicted or 0.0) < UNUSED_S:
            continue  # a mode the job does not use
        seconds = [s for s, _, _ in steps.values()]
        nbytes = [float(n) for _, n, _ in steps.values()]
        slowest = [w for _, _, w in steps.values()]
        per_step: Callable[[Sequence[float]], float] = statistics.median
        if steps and len(steps) < len(window):  # exchanged once a round of several steps
            per_step = partial(spread, steps=len(window))
        rows.append(
            ModeRow(
                mode,
                predicted,
                per_step(seconds) if seconds else None,
                per_step(nbytes) if nbytes else None,
                len(steps),
                per_step(slowest) if slowest else None,
            )
        )
    return rows


def spread(figures: Sequence[float], steps: int) -> float:
    """A mode exchanged in some of ``steps`` only, per step: what its exchanges took in all,
    over the steps (0 in those without one), as the cost model spreads a round of local steps
    over its iterations (:mod:`dmsc.netmodel.sync`)."""
    return sum(figures) / steps


def expert_imbalance(traces: Sequence[StepTrace]) -> float | None:
    """The routing's measured imbalance (``JobSpec.expert_imbalance``): in each step and stage,
    the tokens the busiest ranks received, mixture forward by mixture forward (each waits in its
    all-to-alls for the rank that received most: the deployment's ``busiest``,
    :func:`dmsc.runtime.compute.comm_meter.group_routing`), over the replicas' mean routed (each
    replica's mixtures route as many: their batches are equal); where a trace has no
    ``busiest``, the most a replica received in all. The step's busiest stage; the median over
    the steps. None where no trace counted a mixture's tokens (no expert parallelism)."""
    by_step: dict[int, dict[int, list[Mapping[str, Any]]]] = {}
    for t in traces:
        fig = t.comm.get("ep", {})
        if fig.get("routed"):
            by_step.setdefault(t.step, {}).setdefault(t.stage, []).append(fig)
    steps = [
        max(
            max(float(f.get("busiest", f["received"])) for f in figs)
            / statistics.mean(float(f["routed"]) for f in figs)
            for figs in st.values()
        )
        for st in by_step.values()
    ]
    return statistics.median(steps) if steps else None
