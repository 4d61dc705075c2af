"""Each mode's communication: kept in the step traces, and predicted against measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.data.comm_modes import compare_modes, exposed_wait, measured_by_step, pipeline_wait
from dmsc.data.db import Database
from dmsc.data.traces import StepTrace, record_step, step_traces


def _trace(step: int, stage: int, replica: int, comm: dict) -> StepTrace:
    return StepTrace(step, stage, replica, 0.0, [], {}, comm=comm)


def test_the_comm_of_each_worker_round_trips_and_older_rows_read_empty(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    task = db.new_task(db.new_run("gpt-mini", "local", {}).id, "train", {}).id
    comm = {"dp": {"s": 0.5, "bytes": 10, "calls": 1, "links": {"0/1": 10}}}
    reply = {
        "traces": {(0, 0): ([], {"0/1": 10}), (0, 1): ([], {"0/0": 10})},
        "compute_s": {"0/0": 1.0, "0/1": 1.0},
        "comm": {(0, 0): comm},  # replica 1 as a worker from before the meter
    }
    record_step(db, task, 3, reply)
    got = step_traces(db, task)
    assert got[0].comm == comm and got[1].comm == {}


def test_a_step_is_its_slowest_worker_and_its_bytes_add_up() -> None:
    traces = [
        _trace(0, 0, 0, {"tp": {"s": 0.1, "bytes": 100}}),
        _trace(0, 0, 1, {"tp": {"s": 0.3, "bytes": 100}}),
        _trace(1, 0, 0, {"tp": {"s": 0.2, "bytes": 50}}),
    ]
    assert measured_by_step(traces) == {"tp": {0: (0.3, 200, 0.3), 1: (0.2, 50, 0.2)}}


def test_data_and_expert_parallel_waits_are_the_least_waiting_replicas_of_the_slowest_stage() -> (
    None
):
    """A replica that ended its backward first waits in the all-reduce for the others' compute
    too: the slowest worker's wait is not the exchange's exposed time. On the CPU demo at dp 2
    the status table showed 50.9 ms measured against 4.3 ms predicted (11.9 times)."""
    traces = [  # one step, two stages of two replicas
        _trace(0, 0, 0, {"dp": {"s": 0.30, "bytes": 10}, "tp": {"s": 0.05}}),
        _trace(0, 0, 1, {"dp": {"s": 0.02, "bytes": 10}, "tp": {"s": 0.01}}),
        _trace(0, 1, 0, {"dp": {"s": 0.04, "bytes": 10}, "ep": {"s": 0.2}}),
        _trace(0, 1, 1, {"dp": {"s": 0.25, "bytes": 10}, "ep": {"s": 0.1}}),
    ]
    got = measured_by_step(traces)
    assert got["dp"] == {0: (0.04, 40, 0.30)}  # stage 1's least-waiting replica, the slower
    assert got["ep"] == {0: (0.1, 0, 0.2)}
    assert got["tp"] == {0: (0.05, 0, 0.05)}  # a replica's own ranks: the slowest
    rows = {r.mode: r for r in compare_modes({"dp_comm": 0.04}, traces)}
    assert rows["dp"].measured_s == 0.04 and rows["dp"].ratio == 1.0
    assert rows["dp"].slowest_s == 0.30 and rows["dp"].as_json()["slowest_s"] == 0.30


def test_the_stars_exposure_runs_to_its_last_replica_served_not_its_first() -> None:
    """Through the leader, the replicas leave the exchange one by one. Figures shaped as a dp = 4
    star measured on this machine (2026-12-05): the last backward ends at 10.000 s, the leader
    sends the average to replicas 1, 2, 3 in turn; replica 1 waited least (16 ms) while the step
    waited 27 ms for the exchange. The least-waiting replica stood for it before: 0.016."""
    stage = [  # (replica, entry, exit): the leader and replica 3 entered first
        (0, 9.990, 10.027),
        (1, 10.000, 10.016),
        (2, 9.995, 10.021),
        (3, 9.985, 10.027),
    ]
    traces = [
        _trace(0, 0, r, {"dp": {"s": t1 - t0, "bytes": 10, "calls": 1, "t0": t0, "t1": t1}})
        for r, t0, t1 in stage
    ]
    exposed, _, slowest = measured_by_step(traces)["dp"][0]
    assert exposed == pytest.approx(0.027) and slowest == pytest.approx(0.042)
    assert exposed_wait("dp", [t.comm["dp"] for t in traces]) == pytest.approx(0.027)


def test_a_ring_whose_replicas_leave_together_measures_as_its_least_waiting_replica() -> None:
    ring = [
        {"s": 0.030, "calls": 1, "t0": 5.0, "t1": 5.030},
        {"s": 0.010, "calls": 1, "t0": 5.020, "t1": 5.030},
    ]
    assert exposed_wait("dp", ring) == pytest.approx(0.010)


def test_the_wall_clock_span_is_kept_within_the_waits_and_used_only_where_it_applies() -> None:
    """Clocks of two machines apart by 50 ms cannot carry the figure outside the waits; an
    exchange made twice in a step, one without its wall clock (an older worker), and the
    expert-parallel all-to-alls (many a step) measure as the least-waiting replica."""
    skewed = [
        {"s": 0.02, "calls": 1, "t0": 1.0, "t1": 1.02},
        {"s": 0.01, "calls": 1, "t0": 1.05, "t1": 1.06},
    ]
    assert exposed_wait("dp", skewed) == pytest.approx(0.01)  # the span 10 ms, at least the least
    late = [
        {"s": 0.02, "calls": 1, "t0": 1.05, "t1": 1.07},
        {"s": 0.01, "calls": 1, "t0": 1.0, "t1": 1.01},
    ]
    assert exposed_wait("dp", late) == pytest.approx(0.02)  # the span 20 ms: at most the most
    star = [
        {"s": 0.04, "calls": 1, "t0": 0.0, "t1": 0.04},
        {"s": 0.01, "calls": 1, "t0": 0.02, "t1": 0.03},
    ]
    assert exposed_wait("dp", star) == pytest.approx(0.02)
    twice = [dict(star[0], calls=2), star[1]]
    untimed = [{"s": 0.04, "calls": 1}, star[1]]
    assert exposed_wait("dp", twice) == exposed_wait("dp", untimed) == pytest.approx(0.01)
    assert exposed_wait("ep", star) == pytest.approx(0.01)
    assert exposed_wait("dp", star[:1]) == pytest.approx(0.04)  # one replica: its own wait


def test_predicted_against_measured_per_mode() -> None:
    # three steps: the median over steps of each step's slowest worker; bytes likewise
    traces = []
    for step, (tp, dp, pp) in enumerate([(0.4, 0.1, 0.2), (0.2, 0.3, 0.2), (0.3, 0.2, 9.0)]):
        traces.append(_trace(step, 0, 0, {"tp": {"s": tp, "bytes": 8}, "pp": {"s": pp}}))
        traces.append(_trace(step, 0, 1, {"tp": {"s": tp / 2, "bytes": 8}, "dp": {"s": dp}}))
    breakdown = {
        "compute": 5.0,
        "tp_comm": 0.15,
        "dp_comm": 0.4,
        "ep_comm": 0.0,
        "pp_comm": 0.05,
        "bubble": 0.15,
    }
    rows = {r.mode: r for r in compare_modes(breakdown, traces)}
    assert set(rows) == {"tp", "dp", "pp"}  # ep: neither priced nor measured
    assert rows["tp"].measured_s == pytest.approx(0.3) and rows["tp"].measured_bytes == 16
    assert rows["tp"].ratio == pytest.approx(2.0)
    assert rows["dp"].measured_s == pytest.approx(0.2) and rows["dp"].ratio == pytest.approx(0.5)
    assert rows["pp"].predicted_s == pytest.approx(0.2)  # pp_comm with the bubble
    assert rows["pp"].measured_s == pytest.approx(0.2) and rows["pp"].steps == 3
    assert rows["tp"].as_json()["ratio"] == pytest.approx(2.0)


def test_a_mode_measured_without_a_prediction_and_one_predicted_unmeasured() -> None:
    rows = compare_modes({"ep_comm": 0.5}, [_trace(0, 0, 0, {"dp": {"s": 0.1, "bytes": 4}})])
    by = {r.mode: r for r in rows}
    assert by["dp"].predicted_s is None and by["dp"].ratio is None
    assert by["ep"].measured_s is None and by["ep"].predicted_s == 0.5 and by["ep"].steps == 0
    assert compare_modes(None, []) == []


def test_a_mode_neither_measured_nor_predicted_to_take_time_is_left_out() -> None:
    # one stage: the cost model's bubble is a rounding (5.6e-8 s seen), nothing is measured
    assert compare_modes({"pp_comm": 0.0, "bubble": 5.6e-8}, []) == []


def test_a_round_exchanged_once_in_several_steps_is_spread_over_them() -> None:
    """DiLoCo at 4 inner steps exchanges in one step of four; the cost model prices a quarter
    of the round per iteration, and the median over steps measured the rounds only."""
    traces = []
    for step in range(8):
        traces.append(_trace(step, 0, 0, {"pp": {"s": 0.01 * (step + 1), "bytes": 5}}))
        if step % 4 == 3:
            traces.append(_trace(step, 0, 1, {"dp": {"s": 0.4, "bytes": 100}}))
    rows = {r.mode: r for r in compare_modes({"dp_comm": 0.1, "pp_comm": 0.0}, traces)}
    assert rows["dp"].measured_s == pytest.approx(0.1) and rows["dp"].steps == 2
    assert rows["dp"].measured_bytes == pytest.approx(25.0) and rows["dp"].ratio == 1.0
    assert rows["pp"].measured_s == pytest.approx(0.045)  # every step: the median, as before


def test_expert_parallel_figures_put_together_per_group_measure_as_the_slowest_group() -> None:
    """Merged by the deployment (comm_meter.replicas_exposed: each replica's ``s`` its group's
    exposed time, its own wait as ``wait_s``): the step waited for the slowest group."""
    merged = [{"s": 0.02, "wait_s": 0.05}, {"s": 0.02, "wait_s": 0.03}, {"s": 0.04, "wait_s": 0.04}]
    assert exposed_wait("ep", merged) == pytest.approx(0.04)
    assert exposed_wait("ep", [{"s": 0.02, "wait_s": 0.05}, {"s": 0.03}]) == pytest.approx(0.02)


def _staged(step: int, stage: int, replica: int, wait: float, busy: list[float]) -> StepTrace:
    """A worker's trace with a pipeline wait and its operations' spans of ``busy`` seconds."""
    spans, at = [], 100.0
    for i, b in enumerate(busy):
        spans.append(("F" if i % 2 == 0 else "B", i // 2, at, at + b))
        at += b + 1.0
    return StepTrace(step, stage, replica, 0.0, spans, {}, comm={"pp": {"s": wait}})


def test_the_pipeline_is_measured_without_a_faster_stages_wait_for_the_slower_ones_compute() -> (
    None
):
    """gpt-mini at pp = 2, two micro-batches, as measured (2026-12-05): the first stage computes
    20.7 ms a micro-batch, the second 22.3, and the first waited 25.2 ms a step, of which 3.2
    were the second's extra compute (priced as compute). The pipeline's is 22.0 (prediction
    22.8); counted whole it measured 1.08-1.19 of its prediction run after run."""
    first = _staged(0, 0, 0, 0.0252, [0.0070, 0.0137, 0.0070, 0.0137])
    second = _staged(0, 1, 0, 0.0078, [0.0082, 0.0141, 0.0082, 0.0141])
    assert pipeline_wait([first, second])[0] == pytest.approx(0.0252 - 2 * (0.0223 - 0.0207))
    assert measured_by_step([first, second])["pp"][0][0] == pytest.approx(0.0220)
    assert measured_by_step([first, second])["pp"][0][2] == pytest.approx(0.0252)  # slowest
    rows = compare_modes({"pp_comm": 0.0011, "bubble": 0.0217}, [first, second])
    assert rows[0].ratio == pytest.approx(0.0220 / 0.0228)
    # each replica's pipeline apart: a slow replica's stages do not count against another's
    fast = _staged(0, 0, 1, 0.0252, [0.0070, 0.0137, 0.0070, 0.0137])
    slow = _staged(0, 1, 1, 0.0078, [0.0300, 0.0300])
    assert pipeline_wait([first, second, fast, slow])[0] == pytest.approx(0.0220)
    # a worker without spans (a trace from before them) leaves the step counted whole
    bare = StepTrace(0, 1, 0, 0.0, [], {}, comm={"pp": {"s": 0.0078}})
    assert pipeline_wait([first, bare]) == {}
    assert measured_by_step([first, bare])["pp"][0][0] == pytest.approx(0.0252)
    # never below nothing, never above the most any worker waited
    idle = _staged(0, 0, 0, 0.001, [0.001])
    busy = _staged(0, 1, 0, 0.001, [0.050])
    assert pipeline_wait([idle, busy])[0] == pytest.approx(0.001)  # busy's own wait
    assert pipeline_wait([_staged(0, 0, 0, 0.002, [0.010])])[0] == pytest.approx(0.002)


def test_the_routings_imbalance_is_its_busiest_replicas_received_over_the_mean_routed() -> None:
    """Per step and stage: the most tokens a replica's experts received over the replicas'
    mean routed; the step's busiest stage; the median over the steps (by hand below)."""
    from dmsc.data.comm_modes import expert_imbalance

    def ep(routed: int, received: int) -> dict:
        return {"ep": {"s": 0.01, "routed": routed, "received": received}}

    traces = [
        _trace(0, 0, 0, ep(100, 140)),
        _trace(0, 0, 1, ep(100, 60)),  # step 0: 140 / 100
        _trace(0, 1, 0, ep(100, 110)),
        _trace(0, 1, 1, ep(100, 90)),
        _trace(1, 0, 0, ep(100, 120)),
        _trace(1, 0, 1, ep(100, 80)),  # step 1: 120 / 100
        _trace(2, 0, 0, ep(100, 100)),
        _trace(2, 0, 1, ep(100, 100)),  # step 2: even
        _trace(2, 0, 2, {"tp": {"s": 0.1}}),  # a worker without mixtures' counts
    ]
    assert expert_imbalance(traces) == pytest.approx(1.2)
    assert expert_imbalance([_trace(0, 0, 0, {"ep": {"s": 0.01}})]) is None
    # call by call (the deployment's busiest, comm_meter.group_routing): each mixture waits
    # for its busiest rank; these replicas' totals are even, their calls are not
    a = {"ep": {"s": 0.01, "routed": 200, "received": 200, "busiest": 290}}
    b = {"ep": {"s": 0.01, "routed": 200, "received": 210, "busiest": 290}}
    assert expert_imbalance([_trace(0, 0, 0, a), _trace(0, 0, 1, b)]) == pytest.approx(1.45)
