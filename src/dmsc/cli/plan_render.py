"""How a plan reads: on the terminal, as the --json summary, and as a Gantt chart (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dmsc.cli.render import fit_table, human_bytes, human_flops, human_gib, human_seconds
from dmsc.planner.plan import Plan, strategy_of

if TYPE_CHECKING:
    from dmsc.planner.gantt import Op


def plan_json(plan: Plan) -> dict[str, Any]:
    full = plan.model_dump(mode="json")
    return (
        {
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
        | ({"sync": full["job"]["sync"]} if plan.job.sync.local_steps else {})
        | ({"expert_imbalance": plan.job.expert_imbalance} if plan.job.ep > 1 else {})
    )


def print_plan(console: Console, plan: Plan) -> None:
    j = plan.job
    console.print(
        f"{plan.model} on {plan.cluster}: tp={j.tp} pp={j.pp} dp={j.dp} ep={j.ep}, "
        f"micro-batch {j.micro_batch}, {j.schedule}"
        f"{f' v={j.interleave}' if j.chunks > 1 else ''}, recompute {j.recompute}, "
        f"{j.attention} attention{', sequence parallel' if j.sequence_parallel else ''}"
        + (f", sync {j.sync.label}" if j.sync != type(j.sync)() else "")
        + (f", routing {j.expert_imbalance:.2f} of even" if j.expert_imbalance != 1 else ""),
        style="bold",
        highlight=False,
    )
    p = plan.prediction
    s = plan.search
    gap = "optimal" if s.optimal else (f"gap {s.gap_pct:.1f}%" if s.gap_pct is not None else "")
    console.print(
        f"iteration {human_seconds(p.iteration_time_s)}, "
        f"{human_flops(p.tflops_per_gpu * 1e12)} per device, "
        f"{human_gib(p.memory_gib_per_device)} per device; solver {s.solver} ({gap}), "
        f"searched {s.strategies_considered} strategies and placed in "
        f"{human_seconds(s.search_seconds)}",
        highlight=False,
    )
    # Devices as "all (replicas x per replica)": one column, so that the table fits 80 columns.
    t = fit_table("stage", "SID", "layers", "DC", "devices", "per micro-batch", keep=(1,))
    for st in plan.stages[:32]:
        devices = [len(r.devices) for r in st.replicas]
        dcs = set(r.datacenter for r in st.replicas) | {st.datacenter}  # islands: several
        t.add_row(
            str(st.index),
            st.sid,
            f"{chunks_label(st.chunks)} ({st.layers})",
            st.datacenter if len(dcs) == 1 else f"{len(dcs)} DCs",
            f"{sum(devices)} ({len(devices)} x {max(devices, default=0)})",
            human_seconds(st.microbatch_s),
        )
    if len(plan.stages) > 32:
        t.add_row("...", f"{len(plan.stages) - 32} more", "", "", "", "")
    console.print(t)
    if j.sync.local_steps and j.dp > j.ep:
        console.print(islands_line(plan), highlight=False)
    if plan.paths:
        console.print(paths_table(plan))
    b = fit_table("iteration", "time", "share")
    for key, value in p.breakdown_s.items():
        if value == 0:  # no such term here (no tensor parallelism, one replica, ...)
            continue
        b.add_row(key, human_seconds(value), f"{value / p.iteration_time_s * 100:.1f}%")
    console.print(b)
    traffic = ", ".join(f"{k.upper()} {human_bytes(v)}" for k, v in p.traffic_bytes.items())
    console.print(f"traffic per iteration: {traffic}", highlight=False)
    if s.alternatives:
        # Like with like: the runners-up are not placed, so they are measured against the
        # chosen strategy's estimate, not against this (placed) plan's iteration.
        chosen = f" {human_seconds(s.estimate_s)}" if s.estimate_s is not None else ""
        a = fit_table(
            "runner-up strategy",
            "iteration estimated before placement",
            f"vs the chosen strategy's estimate{chosen}, why it lost",
        )
        for alt in s.alternatives:
            k = alt.strategy
            a.add_row(
                f"tp={k['tp']} pp={k['pp']} dp={k['dp']} mb={k['micro_batch']} "
                f"{k['schedule']} v={k['interleave']} {k['recompute']}",
                human_seconds(alt.iteration_time_s),
                alt.why_lost,
            )
        console.print(a)


def chunks_label(chunks: list[tuple[str, str]]) -> str:
    """A stage's layers: its one range, or each chunk's of an interleaved stage (which holds
    runs of layers apart from one another, not everything from its first to its last)."""
    return ", ".join(first if first == last else f"{first} .. {last}" for first, last in chunks)


def islands_line(plan: Plan) -> str:
    """Where a round mode's islands run (each a replica's whole pipeline, or an expert-parallel
    group's) and how often they exchange."""
    j = plan.job
    first = [r.datacenter for r in plan.stages[0].replicas[:: j.ep]]
    where = ", ".join(f"{dc} x{first.count(dc)}" for dc in dict.fromkeys(first))
    return (
        f"{j.dp // j.ep} islands (whole pipelines): {where}; "
        f"exchange once per {j.sync.inner_steps} iterations"
    )


def paths_table(plan: Plan) -> Table:
    """The reserved inter-datacenter paths. On one machine (the "datacenters" joined by
    loopback, no fibre: every path under a kilometre) length and reserved units mean nothing
    and are left out."""
    fibre = any(path.km >= 1 for path in plan.paths)
    headers = ["after stage", "from", "to", "links"]
    headers += ["km", "reserved"] if fibre else []
    pt = fit_table(*headers, "Gbit/s", keep=(1, 2))
    for path in plan.paths:
        unit = "slots" if path.slot_ghz else "units"
        # After the last stage: the exchange between a round mode's islands.
        after = "dp" if path.after_stage == len(plan.stages) - 1 else str(path.after_stage)
        row = [after, path.source, path.target, " ".join(path.links)]
        if fibre:
            last = path.first_unit + path.units - 1
            row += [f"{path.km:.0f}", f"{unit} {path.first_unit}-{last}"]
        row.append(f"{path.gbit_s:.0f}" if path.gbit_s >= 10 else f"{path.gbit_s:.2f}")
        pt.add_row(*row)
    return pt


# Kind of block: colour, hatch, legend label (in this order on the legend).
_GANTT_STYLE: dict[str, tuple[str, str | None, str]] = {
    "F": ("#4C72B0", None, "forward"),
    "B": ("#55A868", None, "backward"),
    "comm": ("#DD8452", None, "boundary exchange (inside a datacenter)"),
    "dci": ("#C44E52", None, "exchange over an inter-DC link"),
    "wait-dci": ("none", "////", "idle: input on an inter-DC link"),
    "dp": ("#8172B3", None, "gradient all-reduce"),
    "optimizer": ("#937860", None, "optimizer step"),
}


def gantt_figure(ops: list[Op], stages: int, title: str) -> Any:
    """The chart of :func:`dmsc.planner.gantt.replay` blocks as a matplotlib figure: a row per
    stage, the x axis ending where the iteration ends, the legend outside the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from dmsc.planner.gantt import span

    fig, ax = plt.subplots(figsize=(12, 0.5 * stages + 2.0))
    seen: set[str] = set()
    for op in ops:
        color, hatch, _ = _GANTT_STYLE.get(op.kind, ("#999999", None, op.kind))
        seen.add(op.kind)
        # A message in flight is a thin bar under the row; what the stage does fills the row.
        y, h = (op.stage + 0.32, 0.14) if op.in_flight else (op.stage - 0.3, 0.6)
        ax.broken_barh(
            [(op.start, op.end - op.start)],
            (y, h),
            facecolor=color,
            edgecolor="#C44E52" if hatch else "none",
            hatch=hatch,
            linewidth=0,
        )
    total = span(ops)
    ax.set_xlim(0, total * 1.005 if total > 0 else 1)
    ax.axvline(total, color="black", linewidth=0.8)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.set_ylim(stages - 0.5, -0.5)
    ax.set_xlabel(f"seconds (the iteration ends at {human_seconds(total)})")
    ax.set_title(title)
    kinds = [k for k in _GANTT_STYLE if k in seen]
    handles = [
        Patch(
            facecolor=_GANTT_STYLE[k][0],
            hatch=_GANTT_STYLE[k][1],
            edgecolor="#C44E52" if _GANTT_STYLE[k][1] else "none",
        )
        for k in kinds
    ]
    # Below the axes, never over the bars.
    ax.legend(
        handles,
        [_GANTT_STYLE[k][2] for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.5 / (stages + 4)),
        ncol=min(4, max(1, len(kinds))),
        frameon=False,
    )
    fig.tight_layout()
    return fig


def draw_gantt(ops: list[Op], stages: int, path: str | Path, title: str) -> None:
    """Write the blocks of :func:`dmsc.planner.gantt.replay` to ``path`` as a PNG chart."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(ops, stages, title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
