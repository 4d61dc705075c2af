"""Pipeline schedules as the order of a stage's operations: ("F", i) forward, ("B", i) backward;
with model chunks (the interleaved schedule) ("F", i, chunk) and ("B", i, chunk).

Shared by the runtime (the order a stage worker runs, :mod:`dmsc.runtime.compute.executor`) and
the planner's Gantt replay (:mod:`dmsc.planner.gantt`): one order, priced and run."""

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


def microbatch_group(stages: int, microbatches: int) -> int:
    """Micro-batches each chunk runs in a row in the interleaved schedule (Megatron-Core's
    ``microbatch_group_size_per_vp_stage``): ``stages``, or when ``stages`` does not divide the
    micro-batches the smallest group from ``stages`` up whose last group is empty or holds at
    least ``stages`` (Megatron-Core refuses a last group of fewer: dependency bubbles); all of
    them when there are fewer micro-batches than stages (which Megatron-Core refuses)."""
    for n in range(stages, microbatches + 1):
        if microbatches % n == 0 or microbatches % n >= stages:
            return n
    return microbatches


def chunk_table(stages: int, microbatches: int, chunks: int) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) forwards of the interleaved schedule in order, the same at every
    stage: group by group (:func:`microbatch_group`), each group through chunk 0, 1, ..."""
    m, n = microbatches, microbatch_group(stages, microbatches)
    table: list[tuple[int, int]] = []
    for first in range(0, m, n):
        group = range(first, min(m, first + n))
        table += [(i, c) for c in range(chunks) for i in group]
    return table


def stage_order(
    schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[tuple[str, int, int]]:
    """The operations of ``stage`` in the order it runs them: (``F`` or ``B``, micro-batch,
    chunk). One chunk: :func:`schedule_ops`. Several: Megatron-Core's
    interleaved 1F1B (``get_schedule_table`` and ``get_pp_rank_microbatches``): forwards group
    by group (:func:`microbatch_group`), each group through chunk 0, 1, ..., backwards in the
    same order through the chunks reversed; ``2 (stages - stage - 1) + (chunks - 1) group``
    warm-up forwards (all of them if that is as many), then one forward and one backward in
    turn, then the remaining backwards."""
    if chunks == 1:
        name = "gpipe" if schedule == "gpipe" else "1f1b"
        return [(kind, i, 0) for kind, i in schedule_ops(name, stage, stages, microbatches)]
    m, p, v = microbatches, stages, chunks
    n = microbatch_group(p, m)
    table = chunk_table(p, m, v)
    total = m * v
    warm = min(total, 2 * (p - stage - 1) + (v - 1) * n)
    ops = [("F", *table[k]) for k in range(warm)]
    for k in range(total - warm):
        ops.append(("F", *table[k + warm]))
        i, c = table[k]
        ops.append(("B", i, v - 1 - c))
    for k in range(total - warm, total):
        i, c = table[k]
        ops.append(("B", i, v - 1 - c))
    return ops
