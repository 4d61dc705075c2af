"""How a plan reads on an 80-column terminal, on one machine, and as a Gantt chart."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from dmsc.cli import plan_render
from dmsc.planner.gantt import replay
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def _text(plan: Any) -> str:
    buf = io.StringIO()
    plan_render.print_plan(Console(file=buf, width=80, force_terminal=False), plan)
    return buf.getvalue()


def test_nothing_is_cut_at_80_columns(nsfnet: ClusterSpec) -> None:
    job = JobSpec(global_batch=64, micro_batch=1, tp=8, pp=4, dp=32)
    plan = plan_job(nsfnet, resolve_model("llama3-8b"), job, fixed=True, time_limit_s=5).plan
    assert plan.paths, "the case should cross datacenters"
    text = _text(plan)
    assert "…" not in text
    for st in plan.stages:
        assert st.sid in text
        assert st.datacenter in text
    for path in plan.paths:
        assert path.source in text and path.target in text
    for header in ("per micro-batch", "devices", "after stage", "reserved", "Gbit/s"):
        assert all(word in text for word in header.split())  # wrapped maybe, never cut


def test_an_island_plan_names_its_islands_and_the_exchange(local_cpu: ClusterSpec) -> None:
    job = JobSpec(global_batch=16, micro_batch=4, dp=2, sync="diloco:10")
    plan = plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True).plan
    text = _text(plan)
    assert "…" not in text and "2 DCs" in text
    dcs = [rep.datacenter for rep in plan.stages[0].replicas]
    words = " ".join(text.split())
    assert f"islands (whole pipelines): {dcs[0]} x1, {dcs[1]} x1; exchange once per 10" in words
    (row,) = [line for line in text.splitlines() if line.startswith("│ dp ")]
    assert dcs[0] in row and dcs[1] in row  # the exchange's reservation


def test_a_plan_on_one_machine_shows_figures_that_mean_something(local_cpu: ClusterSpec) -> None:
    from dmsc.runtime.compute.calibrate import calibrated_cluster

    measured = {
        "matmul_flops": 21e9,
        "memory_bytes_s": 40e9,
        "loopback_bytes_s": 1.2e9,
        "loopback_rtt_s": 90e-6,
        "op_overhead_s": 6e-6,
        "cores": 2.0,
    }
    cluster = ClusterSpec.model_validate(calibrated_cluster(local_cpu, measured))
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    assert plan.paths  # three "datacenters" joined by loopback
    text = _text(plan)
    assert "0.0 TFLOP/s" not in text and "GFLOP/s per device" in text
    assert "0.0 GiB" not in text and "MiB per device" in text
    assert " km " not in text and "km 0" not in text
    assert "units 0-63" not in text and "reserved" not in text


def test_the_gantt_legend_hides_no_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    save = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    # Bars fill every corner of the plot, where a legend inside it would sit.
    ops = replay([1.0, 1.5, 1.0, 1.2], [2.0, 3.0, 2.0, 2.4], [0.3, 0.6, 0.3], 8, "1f1b")
    plan_render.draw_gantt(ops, 4, tmp_path / "g.png", "one iteration")
    (fig,) = figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert legend is not None
    box, plot = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert not box.overlaps(plot)
