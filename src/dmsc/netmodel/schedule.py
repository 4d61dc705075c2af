"""Pipeline schedules as the order of a stage's operations: ("F", i) forward, ("B", i) backward.

Shared by the runtime (the order a stage worker runs) and the planner's Gantt replay."""

from __future__ import annotations


def schedule_ops(
    schedule: str, stage: int, stages: int, microbatches: int
) -> list[tuple[str, int]]:
    """GPipe: every forward, then every backward. 1F1B: ``stages - stage - 1`` warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards (PipeDream-Flush)."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}")
    warm = min(m, stages - stage - 1)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
        b += 1
    return ops
