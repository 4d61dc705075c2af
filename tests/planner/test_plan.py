"""The plan document's figures: runners-up measured against the chosen strategy like with like,
both as the cost model estimates them before placement."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def test_why_lost_is_the_difference_of_the_two_figures() -> None:
    from dmsc.planner.strategy import why_lost

    best = {"compute": 10.0, "bubble": 2.0, "dp_comm": 1.0}
    other = {"compute": 10.2, "bubble": 2.5, "dp_comm": 0.9}
    assert why_lost(best, 20.957, other, 21.584) == "+0.627 s, mostly bubble (+0.5 s)"


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (0.0, "equal"),
        (7.12e-07, "equal"),
        (-7.12e-07, "equal"),
        (3e-3, "+3 ms"),
        (4.5e-5, "+45 us"),
        (1.38, "+1.38 s"),
    ],
)
def test_small_differences_read_sensibly(extra: float, text: str) -> None:
    from dmsc.planner.strategy import why_lost

    best = {"compute": 4.0, "bubble": 0.98}
    other = {"compute": 4.0, "bubble": 0.98 + extra}
    said = why_lost(best, 4.98, other, 4.98 + extra)
    assert said.split(",")[0] == text
    assert "e-0" not in said


def test_runner_ups_are_measured_against_the_chosen_strategys_estimate(
    local_cpu: ClusterSpec,
) -> None:
    outcome = plan_job(local_cpu, resolve_model("gpt-mini"), JobSpec(global_batch=16))
    plan = outcome.plan
    assert outcome.strategy is not None and plan.search.alternatives
    # Placement and the re-cut move the chosen strategy away from its search estimate: the
    # runners-up (not placed) are compared with that estimate, not with the placed plan.
    searched = outcome.strategy.best.time_s
    assert plan.search.estimate_s == searched
    assert abs(plan.prediction.iteration_time_s - searched) > 0.01 * searched
    for alt in plan.search.alternatives:
        assert alt.iteration_time_s >= searched
        match = re.match(r"([+-][0-9.]+) (s|ms|us)\b|equal", alt.why_lost)
        assert match, alt.why_lost
        expected = alt.iteration_time_s - searched
        if match.group(0) == "equal":
            assert expected == pytest.approx(0.0, abs=1e-6)
            continue
        scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]
        assert float(match.group(1)) * scale == pytest.approx(expected, rel=6e-3)

    # The table says what each figure is and shows the figure the deltas are from.
    from dmsc.cli.plan_render import print_plan
    from dmsc.cli.render import human_seconds

    buf = io.StringIO()
    print_plan(Console(file=buf, width=200, force_terminal=False), plan)
    text = buf.getvalue()
    assert "before placement" in text
    assert f"chosen strategy's estimate {human_seconds(searched)}" in text
    for alt in plan.search.alternatives:
        assert alt.why_lost in text


def test_each_stage_records_the_all_reduce_its_replicas_run() -> None:
    """The job's algorithm, ``auto`` resolved to the fastest the cost model prices for the
    stage's gradient over its replicas' devices; none for a stage without replicas."""
    from conftest import EXAMPLES

    from dmsc.netmodel import DEFAULT_CALIBRATION, CommModel, Topology
    from dmsc.planner.plan import dp_allreduce
    from dmsc.spec import load_spec

    cluster = load_spec(ClusterSpec, EXAMPLES / "two-sites-cpu.yaml")  # two devices a site

    model = resolve_model("gpt-mini")
    fixed = {"global_batch": 8, "tp": 1, "pp": 2, "dp": 2}
    for algorithm in ("auto", "ring", "tree"):
        job = JobSpec(**fixed, allreduce=algorithm)  # type: ignore[arg-type]
        plan = plan_job(cluster, model, job, fixed=True).plan
        comm = CommModel(Topology(cluster), DEFAULT_CALIBRATION)
        for st in plan.stages:
            want = algorithm if algorithm != "auto" else dp_allreduce(comm, job, st.replicas, 1e6)
            assert st.allreduce == want
            groups = [tuple(r.devices[0] for r in st.replicas)]
            if algorithm == "auto":  # the resolved one is the one the estimate priced
                best = comm.collective("all_reduce", groups, 1e6, "auto").time_s
                assert comm.collective("all_reduce", groups, 1e6, want).time_s == best
    one = plan_job(cluster, model, JobSpec(global_batch=8, tp=1, pp=2, dp=1), fixed=True).plan
    assert {st.allreduce for st in one.stages} == {None}
