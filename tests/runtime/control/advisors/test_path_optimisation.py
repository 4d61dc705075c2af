"""Path optimisation: the measured figures against the planner's own, the measured cluster, and
the moves proposed when a boundary or a site is slowed (checked against the planner run
directly on the scaled cluster)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from modules_helpers import fill_run, make_plan, nominal, step_traces, two_sites

from dmsc.data.db import Database
from dmsc.data.forecast import forecast_ahead
from dmsc.data.traces import StepTrace
from dmsc.planner.placement.from_specs import build_problem
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.advisors import Measurements, read_measurements
from dmsc.runtime.control.advisors.base import FaultInfo
from dmsc.runtime.control.advisors.move_cost import (
    DISK_BYTES_S,
    STATE_BYTES_PER_PARAM,
    WORKER_START_S,
    move_cost_s,
)
from dmsc.runtime.control.advisors.paths import (
    BoundaryMeasure,
    PathOptimisation,
    cluster_mismatch,
    device_speeds,
    forecast_gbit_s,
    measure_boundaries,
    measure_stages,
    scaled_cluster,
)
from dmsc.spec import ClusterSpec, load_spec, resolve_model


@pytest.fixture(scope="module")
def cluster() -> ClusterSpec:
    return two_sites()


@pytest.fixture(scope="module")
def plan(cluster: ClusterSpec) -> Plan:
    return make_plan(cluster)


ROOT = Path(__file__).resolve().parents[4]


def three_sites() -> ClusterSpec:
    """examples/clusters/three-sites-cpu.yaml: two-sites-cpu with a detour through site-c."""
    return load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")


def measured(tmp_path: Path, cluster: ClusterSpec, plan: Plan, **slowed: object) -> Measurements:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, _ = fill_run(db, cluster, plan, steps=12, **slowed)  # type: ignore[arg-type]
    return read_measurements(db, run, time.time())


def test_traces_at_the_planners_figures_measure_as_nominal(
    tmp_path: Path, cluster: ClusterSpec, plan: Plan
) -> None:
    """Traces laid out from the planner's own figures measure speed 1 and link factor 1, the
    current placement scores the plan's own prediction, and nothing moves."""
    (p,) = PathOptimisation(cluster).propose(measured(tmp_path, cluster, plan))
    assert p.kind == "keep"
    assert p.details["speed_by_datacenter"] == pytest.approx({"site-a": 1, "site-b": 1}, rel=1e-4)
    assert p.details["link_scale"] == pytest.approx({"site-a-site-b": 1}, rel=1e-4)
    assert p.details["current_s"] == pytest.approx(plan.prediction.iteration_time_s, rel=1e-6)


def _spans(*ops: tuple[str, int, float, float]) -> list[tuple[str, int, float, float]]:
    return list(ops)


def test_the_boundary_gap_is_the_least_of_a_step_then_the_median() -> None:
    # stage 0 ends F0 at 1.0 and F1 at 2.0; stage 1 starts them at 1.3 and 2.9 (waited): 0.3.
    # Backward: stage 1 ends B0 at 5.0, stage 0 starts it at 5.5: 0.5. Least: 0.3.
    t0 = StepTrace(0, 0, 0, 0.0, _spans(("F", 0, 0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 5.5, 6)),
                   {(1, 0): 4000})  # fmt: skip
    t1 = StepTrace(0, 1, 0, 0.0, _spans(("F", 0, 1.3, 2.3), ("F", 1, 2.9, 3.9), ("B", 0, 4, 5.0)),
                   {(0, 0): 4000})  # fmt: skip
    (b,) = measure_boundaries([t0, t1], microbatches=2).items()
    assert b[0] == 0
    assert b[1].bytes_per_microbatch == 2000 and b[1].gap_s == pytest.approx(0.3)
    assert b[1].gbit_s == pytest.approx(2000 * 8 / 0.3 / 1e9)
    assert measure_stages([t0, t1], microbatches=2) == pytest.approx({0: 1.25, 1: 1.5})


def test_the_scaled_cluster_runs_each_site_at_its_speed(cluster: ClusterSpec, plan: Plan) -> None:
    model = resolve_model("gpt-mini")
    base = build_problem(cluster, model, plan.job).problem
    fast_a = scaled_cluster(cluster, {"site-a": 2.0}, {"site-a-site-b": 0.25})
    scaled = build_problem(fast_a, model, plan.job).problem
    for s in range(2):
        a, b = base.compute_us[s]
        sa, sb = scaled.compute_us[s]
        assert sa == pytest.approx(a / 2, rel=0.01) and sb == b  # per-op overheads: under 1%
    assert fast_a.links[0].bandwidth_gbit_s == pytest.approx(0.025)
    assert fast_a.device_types["cpu"] == cluster.device_types["cpu"]  # site-b's, untouched


def test_a_site_that_ran_nothing_takes_its_device_types_speed() -> None:
    speeds = device_speeds(three_sites(), {"site-a": [0.5], "site-b": [0.125]})
    assert speeds["site-c"] == pytest.approx(0.25)  # the geometric mean of a and b


def test_a_slowed_boundary_on_one_link_keeps_the_placement(
    tmp_path: Path, cluster: ClusterSpec, plan: Plan
) -> None:
    """Two sites, one link, one stage per site (each site holds two devices, a stage needs two):
    every placement crosses the same link and the cut moves no bytes off it (every boundary
    carries one activation), so a link ten times slower moves nothing; it is measured so."""
    (p,) = PathOptimisation(cluster).propose(measured(tmp_path, cluster, plan, gap_scale={0: 10.0}))
    assert p.kind == "keep"
    assert p.details["link_scale"]["site-a-site-b"] == pytest.approx(0.1, rel=1e-4)
    nom = nominal(cluster, plan)
    gbit_s = nom.bytes_per_microbatch[0] * 8 / (nom.transfer_s[0] * 10) / 1e9
    assert p.details["boundary_gbit_s"][0] == pytest.approx(gbit_s, rel=1e-4)
    assert p.details["current_s"] > 5 * plan.prediction.iteration_time_s


def test_a_slowed_boundary_moves_a_stage_off_its_link(tmp_path: Path) -> None:
    """Three sites: with the direct link ten times slower, a stage goes to site-c, whose links
    to the other two are as planned; the gain is the planner's prediction on the measured
    cluster. The detour is symmetric, so moving either stage is as good: the planner keeps the
    earliest datacenters of the spec, stage 0 in site-a."""
    three = three_sites()
    plan = make_plan(three)
    assert [st.datacenter for st in plan.stages] == ["site-a", "site-b"]
    (p,) = PathOptimisation(three).propose(measured(tmp_path, three, plan, gap_scale={0: 10.0}))
    assert p.kind == "move-stage" and p.target == "stage 1: site-b -> site-c"
    slow = scaled_cluster(three, {}, {"site-a-site-b": p.details["link_scale"]["site-a-site-b"]})
    best = plan_job(slow, resolve_model("gpt-mini"), plan.job, fixed=True).plan
    assert p.details["proposed_s"] == pytest.approx(best.prediction.iteration_time_s)
    assert p.predicted_gain_s_per_step == pytest.approx(
        p.details["current_s"] - p.details["proposed_s"]
    )
    assert p.predicted_gain_s_per_step > 0.5 * p.current_s_per_step
    assert p.cost_s > WORKER_START_S


def test_a_slowed_site_moves_the_heavier_stage_away(
    tmp_path: Path, cluster: ClusterSpec, plan: Plan
) -> None:
    (p,) = PathOptimisation(cluster).propose(
        measured(tmp_path, cluster, plan, compute_scale={1: 3.0})
    )
    assert p.kind == "move-stage"
    assert p.details["speed_by_datacenter"]["site-b"] == pytest.approx(1 / 3, rel=1e-4)
    assert p.details["datacenters"]["proposed"] == ["site-b", "site-a"]
    layers = p.details["layers_per_stage"]["proposed"]
    assert layers[0] < layers[1]  # fewer layers on the slow site
    assert 0 < p.predicted_gain_s_per_step < p.current_s_per_step


def test_the_cost_of_a_move_is_checkpoint_transfer_and_restart(plan: Plan) -> None:
    state = plan.params * STATE_BYTES_PER_PARAM
    total, parts = move_cost_s(plan, 3, 1e6, ())
    assert parts == pytest.approx(
        {
            "checkpoint_s": state / DISK_BYTES_S,
            "transfer_s": state / 2 / 1e6,  # 3 of 6 layers
            "load_s": state / DISK_BYTES_S,
            "restart_s": WORKER_START_S,
        }
    )
    assert total == pytest.approx(sum(parts.values()))
    recoveries = tuple(FaultInfo("worker", "", 100.0, 100.0 + d, 0) for d in (4.0, 6.0, 30.0))
    assert move_cost_s(plan, 0, None, recoveries)[1]["restart_s"] == 6.0  # their median
    # no recovery yet: the deployment's own start, measured (forked workers: under a second
    # here), not the 20 s of a cold interpreter (the busy node's move was refused for it)
    assert move_cost_s(plan, 0, None, (), start_s=0.6)[1]["restart_s"] == 0.6
    assert move_cost_s(plan, 0, None, recoveries, start_s=0.6)[1]["restart_s"] == 6.0


def test_a_cluster_without_the_plans_sites_is_refused(cluster: ClusterSpec, plan: Plan) -> None:
    assert cluster_mismatch(plan, cluster) is None
    other = ClusterSpec.model_validate(
        {**cluster.model_dump(), "datacenters": [cluster.datacenters[0].model_dump()], "links": []}
    )
    assert "no datacenter site-b" in (cluster_mismatch(plan, other) or "")


def test_no_traces_no_move(cluster: ClusterSpec, plan: Plan) -> None:
    m = Measurements(run_id=1, plan=plan, taken_s=0.0)
    (p,) = PathOptimisation(cluster).propose(m)
    assert p.kind == "keep" and "no step traces" in p.reason


def test_synthetic_traces_keep_the_planners_gap(cluster: ClusterSpec, plan: Plan) -> None:
    """The helper's timeline: the first micro-batch's forward crosses the boundary in exactly
    the planner's transfer time (what the measurement reads)."""
    nom = nominal(cluster, plan)
    traces, _ = step_traces(nom.compute_s, nom.transfer_s, nom.bytes_per_microbatch, 2, 2, 0.0)
    f0 = traces[(0, 0)][0][0]
    f1 = traces[(1, 0)][0][0]
    assert f1[2] - f0[3] == pytest.approx(nom.transfer_s[0])


def test_a_link_whose_load_grows_is_replanned_on_its_forecast_rate(
    tmp_path: Path, cluster: ClusterSpec, plan: Plan
) -> None:
    """The boundary's transfer takes 1x to 4x the planner's over 12 steps (a link ever more
    loaded): the link's factor is taken on the rate Holt forecasts for the next step from the
    per-step rates (recomputed here from the planner's figures), below even the last step's,
    not on the median, which lags half a window behind."""
    growth = [1 + 3 * k / 11 for k in range(12)]
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, _ = fill_run(db, cluster, plan, steps=12, gap_by_step=lambda k: growth[k])
    (p,) = PathOptimisation(cluster).propose(read_measurements(db, run, time.time()))
    nom = nominal(cluster, plan)
    planned = nom.bytes_per_microbatch[0] * 8 / nom.transfer_s[0] / 1e9
    rates = [planned / g for g in growth]
    expected = forecast_ahead(rates, 1)
    assert p.details["boundary_forecast_gbit_s"][0] == pytest.approx(expected, rel=1e-4)
    assert p.details["link_scale"]["site-a-site-b"] == pytest.approx(expected / planned, rel=1e-4)
    assert p.details["link_scale"]["site-a-site-b"] < 1 / growth[-1]  # the trend, one step on
    median = p.details["boundary_gbit_s"][0] / planned
    assert median == pytest.approx(2 / (1 + 4), rel=0.05)  # the median gap: 2.5x the plan's


def test_a_boundary_forecast_needs_enough_steps_and_stays_positive() -> None:
    assert forecast_gbit_s([1.0, 0.9, 0.8, 0.7]) is None  # too few steps: the median stands
    assert forecast_gbit_s([1.0, 1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)
    falling = [5.0, 4.0, 3.0, 2.0, 1.0, 0.2]  # extrapolated past zero: the last measure
    assert forecast_gbit_s(falling) == 0.2
    m = BoundaryMeasure(1000.0, 1e-6)
    assert m.expected_gbit_s == m.gbit_s  # no forecast: the median
    assert BoundaryMeasure(1000.0, 1e-6, 0.5).expected_gbit_s == 0.5
