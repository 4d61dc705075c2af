"""``dmsc modules list``: the orchestrator's functional modules, what each reads and proposes; and
``dmsc replan --dry-run``: their proposals on the newest run's measurements, with the
orchestrator's decision on each and its reason (:mod:`dmsc.runtime.control.modules`).

Path optimisation re-plans on the run's cluster spec: ``--cluster PATH``, else the file named
after the plan's cluster (its file name or its ``name``) in ``examples/clusters`` (of the working
directory, then of this source tree) or in the data directory (where ``dmsc calibrate`` writes).
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.clusters import cluster_file
from dmsc.cli.options import JsonOpt
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.runtime.control.modules import Decision, Measurements
    from dmsc.spec import ClusterSpec

modules_app = typer.Typer(
    help="The orchestrator's functional modules: list (dmsc replan runs them).",
    no_args_is_help=True,
)


@modules_app.command("list")
def modules_list(as_json: JsonOpt = False) -> None:
    """Every functional module: what it does, what it reads, what it proposes."""
    from dmsc.cli.render import fit_table
    from dmsc.runtime.control.modules import MODULE_TYPES

    rows = [
        {"name": m.name, "description": m.description, "reads": m.reads, "proposes": m.proposes}
        for m in MODULE_TYPES
    ]
    if as_json:
        print(json.dumps({"modules": rows}))
        return
    t = fit_table("module", "what it does", "reads", "proposes", keep=(0,))
    for r in rows:
        t.add_row(r["name"], r["description"], r["reads"], r["proposes"])
    console.print(t)


def _cluster(path: str | None, plan_cluster: str) -> ClusterSpec:
    from dmsc.cli.options import load_cluster

    return load_cluster(cluster_file(path, plan_cluster))


def _fmt_s(value: float, unit: str = "s") -> str:
    if value == 0:
        return ""
    return f"{value * 1e3:.1f} ms" if unit == "ms" else f"{value:.1f} s"


def _print(m: Measurements, decisions: list[Decision], cluster: str | None) -> None:
    from dmsc.cli.render import fit_table

    predicted = m.plan.prediction.iteration_time_s
    steps = [p.step_s for p in m.metrics]
    median = sorted(steps)[len(steps) // 2] if steps else None
    head = f"run {m.run_id}"
    if m.task_id is not None:
        head += f", training task {m.task_id}: {len(m.metrics)} steps measured, step "
        head += f"{median:.3f} s (predicted {predicted:.3f} s)" if median else "time unknown"
    if m.remaining_steps is not None:
        head += f", {m.remaining_steps} steps left"
    console.print(
        head + f"; cluster {cluster or 'none'}. Dry run: nothing applied.", highlight=False
    )
    # the reasons are sentences: below the table, numbered, rather than squeezed into a column
    t = fit_table("#", "module", "kind", "target", "gain/step", "cost", "payback", "decision")
    for n, d in enumerate(decisions, 1):
        p = d.proposal
        payback = p.payback_steps
        t.add_row(
            str(n),
            p.module,
            p.kind,
            p.target,
            _fmt_s(p.predicted_gain_s_per_step, "ms"),
            _fmt_s(p.cost_s),
            "" if p.cost_s == 0 or math.isinf(payback) else f"{payback:.0f} steps",
            d.verdict,
        )
    console.print(t)
    for n, d in enumerate(decisions, 1):
        p = d.proposal
        why = p.reason if d.verdict == "note" else f"{p.reason} -> {d.reason}"
        console.print(f"{n}. {why}", highlight=False)


def replan(
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Show the proposals and decisions without applying them (offline: read from "
            "the database). Without it the running control plane decides and applies.",
        ),
    ] = False,
    cluster: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="The run's cluster spec (default: the file of the plan's cluster name in "
            "examples/clusters or the data directory).",
        ),
    ] = None,
    threshold: Annotated[
        float,
        typer.Option(min=0.0, help="A move's gain must exceed this share of the step time."),
    ] = 0.05,
    horizon_steps: Annotated[
        int,
        typer.Option(
            min=0, help="A move's cost must be paid back within this many steps (or the task's)."
        ),
    ] = 1000,
    run: Annotated[int | None, typer.Option("--run", help="The run (default: the newest).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """The functional modules' proposals on the newest run's measurements, and the orchestrator's
    decision on each with its reason."""
    if not dry_run:
        _apply(cluster, run, threshold, horizon_steps, as_json)
        return
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.modules import (
        DecisionRule,
        default_modules,
        newest_run,
        orchestrate,
        read_measurements,
    )
    from dmsc.runtime.control.modules.paths import cluster_mismatch

    db = open_database()
    run_id = run if run is not None else newest_run(db)
    if run_id is None:
        _nothing(as_json, None, "no run in this database yet: `dmsc up` starts one")
        return
    try:
        m = read_measurements(db, run_id, time.time())
    except KeyError:
        raise SpecError("command line", "--run", f"no run {run_id}") from None
    if m.empty:
        _nothing(
            as_json, run_id, f"run {run_id} has measured nothing yet: train on it (`dmsc train`)"
        )
        return
    spec = _cluster(cluster, m.plan.cluster)
    why = cluster_mismatch(m.plan, spec)
    if why is not None:
        raise SpecError(cluster or spec.name, "", why)
    rule = DecisionRule(threshold=threshold, horizon_steps=horizon_steps)
    decisions = orchestrate(default_modules(spec), m, rule)
    if as_json:
        out: dict[str, Any] = {
            "run": run_id,
            "task": m.task_id,
            "dry_run": True,
            "cluster": spec.name,
            "steps_measured": len(m.metrics),
            "remaining_steps": m.remaining_steps,
            "predicted_step_s": m.plan.prediction.iteration_time_s,
            "rule": {"threshold": threshold, "horizon_steps": horizon_steps},
            "decisions": [d.as_json() for d in decisions],
        }
        print(json.dumps(out, default=str))
        return
    _print(m, decisions, spec.name)


def _apply(
    cluster: str | None, run: int | None, threshold: float, horizon: int, as_json: bool
) -> None:
    """``dmsc replan`` without ``--dry-run``: the running control plane decides on its own
    run's measurements and applies (exceptions raised, a move made)."""
    from dmsc.cli.runtime import control_client

    for flag, value in (("--cluster", cluster), ("--run", run)):
        if value is not None:
            raise SpecError(
                "command line", flag, "the running deployment uses its own (with --dry-run only)"
            )
    body = {"dry_run": False, "threshold": threshold, "horizon_steps": horizon}
    out: dict[str, Any] = control_client().call("Replan", body)
    if as_json:
        print(json.dumps(out, default=str))
        return
    for n, d in enumerate(out["decisions"], 1):
        console.print(
            f"{n}. {d['module']} {d['kind']} {d['target']}: {d['decision']} ({d['why']})",
            highlight=False,
        )
    applied = out["applied"]
    where = ", ".join(out["datacenters"])
    console.print(
        f"decided in {out['decide_s']:.2f} s; "
        + (f"moved ({applied['target']}) in {applied['move_s']:.1f} s" if applied else "no move")
        + f"; stages now in {where}; exceptions raised: {len(out['exceptions_raised'])}",
        highlight=False,
    )


def _nothing(as_json: bool, run_id: int | None, message: str) -> None:
    """Nothing to propose on: said plainly (exit 0, as an empty ``dmsc tasks list``)."""
    if as_json:
        print(json.dumps({"run": run_id, "dry_run": True, "decisions": [], "message": message}))
    else:
        console.print(message, highlight=False)
