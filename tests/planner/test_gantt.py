"""The replay of one pipeline iteration, checked against the closed form of a uniform pipeline
and against the rules every schedule keeps (a stage runs one block at a time, a block waits for
its input)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.planner.gantt import Op, replay, replay_placement
from dmsc.planner.solve import PlanOutcome, plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_blocking_exchange_adds_two_per_microbatch_slot(schedule: str) -> None:
    # The planner's stage model: t = compute + 2 x per micro-batch, (m + p - 1) t in all.
    f, b, x, p, m = 1.0, 2.0, 0.25, 4, 6
    ops = replay([f] * p, [b] * p, [0.0] * (p - 1), m, schedule, [x] * p)
    assert _span(ops) == pytest.approx((m + p - 1) * (f + b + 2 * x))
    assert sum(op.kind == "comm" for op in ops) == 2 * p * m


def _local_plan(local_cpu: ClusterSpec, stage_layers: list[int] | None = None) -> PlanOutcome:
    job = JobSpec(global_batch=16, micro_batch=2, pp=3, stage_layers=stage_layers)
    return plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True)


@pytest.mark.parametrize("stage_layers", [None, [2, 1, 1]])
def test_the_chart_ends_at_the_plans_iteration_time(
    local_cpu: ClusterSpec, stage_layers: list[int] | None
) -> None:
    from dmsc.planner.gantt import with_tail

    outcome = _local_plan(local_cpu, stage_layers)
    plan, problem = outcome.plan, outcome.built.problem
    ops = replay_placement(problem, outcome.result.placement, plan.job.schedule)
    b = plan.prediction.breakdown_s
    whole = with_tail(ops, problem.n_stages, b["dp_comm"], b["optimizer"])
    assert _span(whole) == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)
    # The busiest stage is busy m x its micro-batch time; the rest of its span is bubble.
    m = problem.microbatches
    busiest = max(plan.stages, key=lambda s: s.microbatch_s)
    busy = sum(
        op.end - op.start for op in ops if op.stage == busiest.index and op.kind != "wait-dci"
    )
    assert busy == pytest.approx(m * busiest.microbatch_s, rel=1e-6)


def test_inter_dc_exchanges_and_waits_are_marked(local_cpu: ClusterSpec) -> None:
    outcome = _local_plan(local_cpu)
    dcs = outcome.result.placement.dcs
    assert len(set(dcs)) > 1, "the case should cross datacenters"
    ops = replay_placement(outcome.built.problem, outcome.result.placement, "1f1b")
    crossing = {b for b in range(len(dcs) - 1) if dcs[b] != dcs[b + 1]}
    next_to_dci = {s for b in crossing for s in (b, b + 1)}
    marked = {op.stage for op in ops if op.kind == "dci"}
    assert marked and marked <= next_to_dci
    assert any(op.kind == "wait-dci" for op in ops)
    # The same pipeline inside one datacenter: nothing marked.
    ops = replay([1.0] * 3, [2.0] * 3, [0.0] * 2, 4, "1f1b", [0.5] * 3, [False] * 2, [False] * 3)
    assert not any(op.kind in ("dci", "wait-dci") for op in ops)


@pytest.mark.parametrize(("stages", "microbatches", "chunks"), [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_a_uniform_interleaved_pipeline_has_the_bubble_over_v(
    stages: int, microbatches: int, chunks: int
) -> None:
    # Narayanan et al. SC'21 sec. 2.2 (the cost model's closed form): (m + (p - 1) / v) t.
    f, b, x, p, m, v = 1.0, 2.0, 0.25, stages, microbatches, chunks
    ops = replay([f] * p, [b] * p, [0.0] * (p - 1), m, "interleaved", [x] * p, chunks=v)
    assert _span(ops) == pytest.approx((m + (p - 1) / v) * (f + b + 2 * x))
    for kind in ("F", "B"):
        done = {(op.stage, op.chunk, op.microbatch) for op in ops if op.kind == kind}
        assert done == set(itertools.product(range(p), range(v), range(m)))


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(2, 5),
    m=st.integers(1, 12),
    v=st.integers(2, 4),
    seed=st.integers(0, 10_000),
)
def test_interleaved_blocks_never_overlap_and_wait_for_their_input(
    p: int, m: int, v: int, seed: int
) -> None:
    rng = random.Random(seed)
    fwd = [rng.uniform(0.5, 2.0) for _ in range(p)]
    bwd = [2 * t for t in fwd]
    xs = [rng.uniform(0.0, 0.5) for _ in range(p)]
    ops = replay(fwd, bwd, [0.0] * (p - 1), m, "interleaved", xs, chunks=v)
    end = {(op.kind, op.stage, op.chunk, op.microbatch): op.end for op in ops if op.kind in "FB"}
    for s in range(p):
        mine = sorted((o for o in ops if o.stage == s and not o.in_flight), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(mine))
        # Each stage is busy m x (compute + exchanges) in all, its chunks a v-th each.
        busy = sum(o.end - o.start for o in mine if o.kind != "wait-dci")
        assert busy == pytest.approx(m * (fwd[s] + bwd[s] + 2 * xs[s]))
    for op in ops:
        k = op.chunk * p + op.stage  # virtual stage
        if op.kind == "F" and k > 0:
            prev = ("F", (k - 1) % p, (k - 1) // p, op.microbatch)
            assert op.start >= end[prev] - 1e-9
        if op.kind == "B":
            nxt = ("B", (k + 1) % p, (k + 1) // p, op.microbatch) if k < p * v - 1 else None
            mine_f = ("F", op.stage, op.chunk, op.microbatch)
            assert op.start >= end[nxt if nxt else mine_f] - 1e-9


def _interleaved_plan(local_cpu: ClusterSpec) -> PlanOutcome:
    job = JobSpec(global_batch=16, micro_batch=2, pp=2, schedule="interleaved", interleave=2)
    return plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_drawn_chart_ends_at_the_plans_iteration_time(
    local_cpu: ClusterSpec, interleaved: bool
) -> None:
    """What ``dmsc plan --gantt`` draws (its blocks, its title) ends where the plan's iteration
    does, for a 1F1B and for an interleaved plan (which it draws interleaved)."""
    outcome = _interleaved_plan(local_cpu) if interleaved else _local_plan(local_cpu)
    plan = outcome.plan
    assert plan.job.chunks == (2 if interleaved else 1)
    ops = outcome.iteration_ops()
    assert _span(ops) == pytest.approx(plan.prediction.iteration_time_s, rel=1e-9)
    chunks = {op.chunk for op in ops if op.kind == "F"}
    assert chunks == set(range(plan.job.chunks))
    # The busiest stage is busy m x its micro-batch time, interleaved or not.
    m = outcome.built.problem.microbatches
    busiest = max(plan.stages, key=lambda s: s.microbatch_s)
    busy = sum(
        op.end - op.start
        for op in ops
        if op.stage == busiest.index and op.kind in ("F", "B", "comm", "dci") and not op.in_flight
    )
    assert busy == pytest.approx(m * busiest.microbatch_s, rel=1e-6)
