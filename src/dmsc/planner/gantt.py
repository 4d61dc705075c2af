"""One iteration of a planned pipeline replayed in time: the blocks of a Gantt chart.

Pure: it returns the blocks (stage, kind, start, end); the CLI draws them (``dmsc plan --gantt``,
see :mod:`dmsc.cli.plan_render`). The schedule is replayed from the plan's per-stage times: each
stage runs its micro-batches forward and backward in 1F1B order (GPipe: all forwards, then all
backwards), an operation starts when its stage is free and its input has crossed the boundary.
Interleaved plans are replayed with one chunk per device (the chart then shows the 1F1B bubble,
larger than the interleaved one).
"""

from __future__ import annotations

from dataclasses import dataclass

from dmsc.netmodel.schedule import schedule_ops
from dmsc.planner.placement.problem import Placement, PlacementProblem, boundary_us


@dataclass(frozen=True)
class Op:
    """One block on the chart."""

    stage: int
    kind: str  # "F", "B" or "comm"
    microbatch: int
    start: float
    end: float


def replay(
    fwd_s: list[float], bwd_s: list[float], comm_s: list[float], microbatches: int, schedule: str
) -> list[Op]:
    """Start and end of every forward, backward and boundary transfer of one iteration."""
    p, m = len(fwd_s), microbatches
    name = "gpipe" if schedule == "gpipe" else "1f1b"
    orders = [schedule_ops(name, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            if pos[s] >= len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "F":
                dep = done.get(("F", s - 1, i)) if s > 0 else 0.0
                lag = comm_s[s - 1] if s > 0 else 0.0
            else:
                dep = done.get(("B", s + 1, i)) if s < p - 1 else done.get(("F", s, i))
                lag = comm_s[s] if s < p - 1 else 0.0
            if dep is None:
                continue
            ready = dep + lag
            if lag:
                ops.append(Op(s, "comm", i, dep, ready))
            start = max(free[s], ready)
            end = start + (fwd_s[s] if kind == "F" else bwd_s[s])
            ops.append(Op(s, kind, i, start, end))
            done[(kind, s, i)] = end
            free[s] = end
            pos[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline replay deadlocked")
    return ops


def replay_placement(problem: PlacementProblem, placement: Placement, schedule: str) -> list[Op]:
    """:func:`replay` of a placed pipeline: each stage's compute time in its datacenter (a third
    forward, two thirds backward) and the transfer time of each boundary on its route."""
    dcs = placement.dcs
    comm = [c * 1e-6 for c in boundary_us(problem, dcs, placement.routes)]
    per_mb = [(problem.compute_us[s][dcs[s]] or 0) * 1e-6 for s in range(problem.n_stages)]
    return replay(
        [t / 3 for t in per_mb],
        [2 * t / 3 for t in per_mb],
        comm,
        problem.microbatches,
        schedule,
    )
