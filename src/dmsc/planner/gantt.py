"""One iteration of a planned pipeline as a Gantt chart: stages x time.

The schedule is replayed from the plan's per-stage times: each stage runs its micro-batches
forward and backward in 1F1B order (GPipe: all forwards, then all backwards), an operation starts
when its stage is free and its input has crossed the boundary. Interleaved plans are drawn with
one chunk per device (the chart then shows the 1F1B bubble, larger than the interleaved one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dmsc.netmodel.schedule import schedule_ops


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


def draw_gantt(ops: list[Op], stages: int, path: str | Path, title: str) -> None:
    """Write the chart to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = {"F": "#4C72B0", "B": "#55A868", "comm": "#DD8452"}
    fig, ax = plt.subplots(figsize=(12, 0.5 * stages + 1.5))
    for op in ops:
        y = op.stage + (0.35 if op.kind == "comm" else 0.0)
        h = 0.25 if op.kind == "comm" else 0.6
        ax.broken_barh([(op.start, op.end - op.start)], (y - 0.3, h), color=colors[op.kind])
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["forward", "backward", "boundary transfer"], loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
