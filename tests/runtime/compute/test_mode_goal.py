"""benchmarks/parallel_modes.py's summary of the per-mode goal (measured within 15% of the
prediction): which measure each mode is read by, the star runs counted against the leader's star
(priced since the cost model's ``sync.via``: they were left out while it priced the all-reduce
only), and the runs with more workers than cores counted apart."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    from parallel_modes import goal_15pct, over_rounds, own_compute
finally:
    sys.path.remove(str(BENCH))


def _run(tp: int, stages: int, dp: int, *modes: tuple[str, float, float, float]) -> dict[str, Any]:
    return {
        "tp": tp,
        "stages": stages,
        "dp": dp,
        "modes": [
            {"mode": m, "predicted_s": p, "measured_s": measured, "measured_least_s": least}
            for m, p, measured, least in modes
        ],
    }


def test_the_goal_reads_each_mode_by_its_measure_and_counts_oversubscribed_runs_apart() -> None:
    """Each mode by its measured seconds (comm_modes: the slowest worker's for tp and pp, the
    exposed time for dp and ep), never the least-waiting replica's beside it: the star's first
    replica served leaves its exchange before the others."""
    rows = {
        "dp2-star": _run(1, 1, 2, ("dp", 1.0, 6.0, 5.0)),  # exposed 6.0, least 5.0
        "dp2-ring": _run(1, 1, 2, ("dp", 1.0, 1.1, 1.1)),
        "tp2": _run(2, 1, 1, ("tp", 1.0, 1.2, 0.5)),
        "pp2": _run(1, 2, 1, ("pp", 1.0, 0.9, 0.1)),
        "tp2-ep2": _run(2, 1, 2, ("ep", 1.0, 2.0, 2.0)),  # 4 workers on 2 cores
    }
    goal = goal_15pct(rows, cores=2)
    assert set(goal["modes"]) == {"dp2-star/dp", "dp2-ring/dp", "tp2/tp", "pp2/pp", "tp2-ep2/ep"}
    assert {k: round(g["ratio"], 3) for k, g in goal["modes"].items()} == {
        "dp2-star/dp": 6.0,
        "dp2-ring/dp": 1.1,
        "tp2/tp": 1.2,
        "pp2/pp": 0.9,
        "tp2-ep2/ep": 2.0,
    }
    assert [k for k, g in goal["modes"].items() if not g["fits_cores"]] == ["tp2-ep2/ep"]
    assert (goal["within"], goal["counted"]) == (2, 5)
    assert (goal["within_on_cores"], goal["counted_on_cores"]) == (2, 4)


def test_a_modes_ratio_is_the_median_of_its_rounds_each_against_its_own_calibration() -> None:
    """Each round is predicted from the calibration made just before it: the mode's ratio is
    the median of the rounds' ratios, not its median measured over its median predicted."""

    def round_(predicted: float, measured: float) -> dict[str, Any]:
        return _run(1, 1, 2, ("dp", predicted, measured, measured)) | {
            "step_s": measured,
            "predicted_step_s": predicted,
        }

    row = over_rounds([round_(1.0, 1.1), round_(2.0, 1.8), round_(4.0, 1.2)])
    mode = row["modes"][0]
    assert (mode["measured_s"], mode["predicted_s"]) == (1.2, 2.0)  # 0.6 by the medians
    assert (row["step_s"], row["predicted_step_s"]) == (1.2, 2.0)  # the steps' medians too
    assert mode["ratio_by_round"] == [1.1, 0.9, 0.3] and mode["ratio"] == 0.9
    goal = goal_15pct({"dp2-ring": row}, cores=2)
    assert goal["modes"]["dp2-ring/dp"]["ratio"] == 0.9 and goal["within"] == 1


def test_a_runs_predicted_step_is_its_plans_iteration() -> None:
    """``predicted_step_s`` beside each measured step is the plan's own iteration time, the
    sum of the breakdown the modes are read from."""
    from parallel_modes import _spec, predicted

    from dmsc.planner.solve import plan_job
    from dmsc.spec import ClusterSpec, JobSpec, SyncSpec

    cluster = ClusterSpec.model_validate(
        {
            "device_types": {"cpu": {"peak_tflops": {"fp32": 0.05}, "memory_gib": 4,
                                     "memory_bw_gbyte_s": 10}},
            "node_types": {"host": {"device": "cpu", "devices": 4,
                                    "link": {"bandwidth_gbit_s": 40}}},
            "datacenters": [{"name": "dc", "nodes": [{"type": "host", "count": 1}],
                             "network": {"gbit_s_per_node": 10}}],
        }
    )  # fmt: skip
    spec = _spec()
    got = predicted(cluster, spec, 1, 2, 1, 2)
    job = JobSpec(
        global_batch=8, micro_batch=4, pp=2, allreduce="ring", sync=SyncSpec(via="collective")
    )
    plan = plan_job(cluster, spec, job, fixed=True).plan
    assert got["iteration_s"] == plan.prediction.iteration_time_s
    assert sum(got["breakdown"].values()) == pytest.approx(got["iteration_s"])


def test_a_steps_compute_is_its_slowest_workers_less_its_own_waits_in_the_calls_inside_it() -> None:
    """A worker's compute seconds hold its forward and backward, and the tensor- and
    expert-parallel calls it waits in inside them: those waits (its own, ``wait_s``, where the
    group's exposed time stands in ``s``; else ``s``) come off, the data-parallel exchange
    after the backward is not in them; the step's figure is its slowest worker's."""
    compute = {"0/0": 0.100, "0/1": 0.090}
    comm = {
        (0, 0): {"ep": {"s": 0.010, "wait_s": 0.030}, "dp": {"s": 0.005}},
        (0, 1): {"ep": {"s": 0.010}, "tp": {"s": 0.002}},
    }
    assert own_compute(compute, comm) == pytest.approx(max(0.100 - 0.030, 0.090 - 0.012))
    assert own_compute({"0/0": 0.05}, {}) == 0.05  # no calls inside: all of it
