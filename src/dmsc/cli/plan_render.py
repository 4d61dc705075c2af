"""How a plan reads: on the terminal, as the --json summary, and as a Gantt chart (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dmsc.cli.render import human_bytes, human_seconds
from dmsc.planner.plan import Plan, strategy_of

if TYPE_CHECKING:
    from dmsc.planner.gantt import Op


def plan_json(plan: Plan) -> dict[str, Any]:
    full = plan.model_dump(mode="json")
    return {
        "iteration_time_s": plan.prediction.iteration_time_s,
        "strategy": strategy_of(plan.job),
        "stages": full["stages"],
        "paths": full["paths"],
        "solver": plan.search.solver,
        "search_seconds": plan.search.search_seconds,
        "optimal": plan.search.optimal,
        "gap_pct": plan.search.gap_pct,
        "breakdown_s": plan.prediction.breakdown_s,
        "memory_gib_per_device": plan.prediction.memory_gib_per_device,
        "traffic_bytes": plan.prediction.traffic_bytes,
        "tflops_per_gpu": plan.prediction.tflops_per_gpu,
        "alternatives": full["search"]["alternatives"],
    }


def print_plan(console: Console, plan: Plan) -> None:
    j = plan.job
    console.print(
        f"{plan.model} on {plan.cluster}: tp={j.tp} pp={j.pp} dp={j.dp} ep={j.ep}, "
        f"micro-batch {j.micro_batch}, {j.schedule}"
        f"{f' v={j.interleave}' if j.chunks > 1 else ''}, recompute {j.recompute}"
        f"{', sequence parallel' if j.sequence_parallel else ''}",
        style="bold",
        highlight=False,
    )
    p = plan.prediction
    s = plan.search
    gap = "optimal" if s.optimal else (f"gap {s.gap_pct:.1f}%" if s.gap_pct is not None else "")
    console.print(
        f"iteration {human_seconds(p.iteration_time_s)}, {p.tflops_per_gpu:.1f} TFLOP/s per "
        f"device, {p.memory_gib_per_device:.1f} GiB per device; solver {s.solver} ({gap}), "
        f"searched {s.strategies_considered} strategies and placed in "
        f"{human_seconds(s.search_seconds)}",
        highlight=False,
    )
    t = Table("stage", "SID", "layers", "datacenter", "replicas", "devices", "per micro-batch")
    for st in plan.stages[:32]:
        t.add_row(
            str(st.index),
            st.sid,
            f"{st.chunks[0][0]} .. {st.chunks[-1][1]} ({st.layers})",
            st.datacenter,
            str(len(st.replicas)),
            str(sum(len(r.devices) for r in st.replicas)),
            human_seconds(st.microbatch_s),
        )
    if len(plan.stages) > 32:
        t.add_row("...", f"{len(plan.stages) - 32} more", "", "", "", "", "")
    console.print(t)
    if plan.paths:
        pt = Table("after stage", "from", "to", "links", "km", "reserved", "Gbit/s")
        for path in plan.paths:
            unit = "slots" if path.slot_ghz else "units"
            pt.add_row(
                str(path.after_stage),
                path.source,
                path.target,
                " ".join(path.links),
                f"{path.km:.0f}",
                f"{unit} {path.first_unit}-{path.first_unit + path.units - 1}",
                f"{path.gbit_s:.0f}",
            )
        console.print(pt)
    b = Table("iteration", "time", "share")
    for key, value in p.breakdown_s.items():
        b.add_row(key, human_seconds(value), f"{value / p.iteration_time_s * 100:.1f}%")
    console.print(b)
    traffic = ", ".join(f"{k.upper()} {human_bytes(v)}" for k, v in p.traffic_bytes.items())
    console.print(f"traffic per iteration: {traffic}", highlight=False)
    if s.alternatives:
        a = Table("runner-up strategy", "estimated iteration", "why it lost")
        for alt in s.alternatives:
            k = alt.strategy
            a.add_row(
                f"tp={k['tp']} pp={k['pp']} dp={k['dp']} mb={k['micro_batch']} "
                f"{k['schedule']} v={k['interleave']} {k['recompute']}",
                human_seconds(alt.iteration_time_s),
                alt.why_lost,
            )
        console.print(a)


def draw_gantt(ops: list[Op], stages: int, path: str | Path, title: str) -> None:
    """Write the blocks of :func:`dmsc.planner.gantt.replay` to ``path`` as a PNG chart."""
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
