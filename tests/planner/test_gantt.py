"""The replay of one pipeline iteration, checked against the closed form of a uniform pipeline
and against the rules every schedule keeps (a stage runs one block at a time, a block waits for
its input)."""

from __future__ import annotations

import itertools

import pytest

from dmsc.planner.gantt import Op, replay


def _span(ops: list[Op]) -> float:
    return max(op.end for op in ops)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (3, 1), (4, 8)])
def test_a_uniform_pipeline_takes_m_plus_p_minus_1_slots(
    schedule: str, stages: int, microbatches: int
) -> None:
    f, b = 1.0, 2.0
    ops = replay([f] * stages, [b] * stages, [0.0] * (stages - 1), microbatches, schedule)
    assert _span(ops) == pytest.approx((microbatches + stages - 1) * (f + b))
    assert sum(op.kind == "F" for op in ops) == stages * microbatches
    assert sum(op.kind == "B" for op in ops) == stages * microbatches


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_blocks_never_overlap_and_wait_for_their_input(schedule: str) -> None:
    fwd, bwd, comm = [1.0, 3.0, 2.0], [2.0, 5.0, 4.0], [0.5, 1.5]
    ops = replay(fwd, bwd, comm, 5, schedule)
    end = {(op.kind, op.stage, op.microbatch): op.end for op in ops if op.kind != "comm"}
    for s in range(3):
        mine = sorted((o for o in ops if o.stage == s and o.kind != "comm"), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(mine))
    for op in ops:
        if op.kind == "F" and op.stage > 0:
            assert op.start >= end[("F", op.stage - 1, op.microbatch)] + comm[op.stage - 1]
        if op.kind == "B" and op.stage < 2:
            assert op.start >= end[("B", op.stage + 1, op.microbatch)] + comm[op.stage]
    assert any(op.kind == "comm" for op in ops)
