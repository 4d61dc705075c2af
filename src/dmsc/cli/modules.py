"""``dmsc modules list``: the orchestrator's functional modules, what each reads and proposes; and
``dmsc replan --dry-run``: their proposals on the newest run's measurements, with the
orchestrator's decision on each and its reason (:mod:`dmsc.runtime.control.advisors`).

Path optimisation re-plans on the run's cluster spec: ``--cluster PATH``, else the file named
after the plan's cluster (its file name or its ``name``) in ``examples/clusters`` (of the working
directory, then of this source tree) or in the data directory (where ``dmsc calibrate`` writes).
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dmsc.cli.app import console
from dmsc.cli.clusters import cluster_file
from dmsc.cli.options import JsonOpt
from dmsc.cli.runtime import control_client
from dmsc.runtime.transport.messages import ReplanRequest
from dmsc.runtime.transport.replies import ReplanReply
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.runtime.control.advisors import DecisionRule
    from dmsc.runtime.control.client import ControlClient
    from dmsc.spec import ClusterSpec

modules_app = typer.Typer(
    help="The orchestrator's functional modules: list (dmsc replan runs them).",
    no_args_is_help=True,
)


@modules_app.command("list")
def modules_list(as_json: JsonOpt = False) -> None:
    """Every functional module: what it does, what it reads, what it proposes."""
    from dmsc.cli.render import fit_table
    from dmsc.runtime.control.advisors import MODULE_TYPES

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


def _print(doc: dict[str, Any]) -> None:
    """A dry run's answer (offline or the control plane's): the measured step beside the
    prediction of the job that ran, a table of the decisions, their reasons below it."""
    from dmsc.cli.render import fit_table, prediction_words

    head = f"run {doc['run']}"
    median = doc.get("median_step_s")
    if doc.get("task") is not None:
        head += f", training task {doc['task']}: {doc['steps_measured']} steps measured, step "
        if median:
            words = prediction_words(median, doc["predicted_step_s"], doc["prediction"])
            head += f"{median:.3f} s ({words})"
        else:
            head += "time unknown"
    if doc.get("remaining_steps") is not None:
        head += f", {doc['remaining_steps']} steps left"
    where = "as the running control plane decides" if "decide_s" in doc else "decided offline"
    console.print(
        head + f"; cluster {doc.get('cluster') or 'none'}. Dry run: nothing applied ({where}).",
        highlight=False,
    )
    # the reasons are sentences: below the table, numbered, rather than squeezed into a column
    t = fit_table("#", "module", "kind", "target", "gain/step", "cost", "payback", "decision")
    for n, d in enumerate(doc["decisions"], 1):
        payback = d["payback_steps"]
        t.add_row(
            str(n),
            d["module"],
            d["kind"],
            d["target"],
            _fmt_s(d["predicted_gain_s_per_step"], "ms"),
            _fmt_s(d["cost_s"]),
            "" if d["cost_s"] == 0 or payback is None else f"{payback:.0f} steps",
            d["verdict"],
        )
    console.print(t)
    for n, d in enumerate(doc["decisions"], 1):
        why = d["reason"] if d["verdict"] == "note" else f"{d['reason']} -> {d['why']}"
        console.print(f"{n}. {why}", highlight=False)


def _running_plane() -> ControlClient | None:
    """A client of the control plane running on this data directory, or None."""
    try:
        return control_client()
    except SpecError:
        return None


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
    from dmsc.runtime.control.advisors import DecisionRule

    rule = {"threshold": threshold, "horizon_steps": horizon_steps}
    plane = _running_plane() if cluster is None and run is None else None
    if plane is not None:  # the deployment's current plan: the decision a real replan takes
        doc = plane.replan(ReplanRequest(dry_run=True, **rule)).wire()
    else:
        found = _offline(cluster, run, DecisionRule(threshold, horizon_steps), as_json)
        if found is None:
            return
        doc = found.wire()
    doc["rule"] = rule
    if as_json:
        print(json.dumps(doc, default=str))
        return
    _print(doc)


def _offline(
    cluster: str | None, run: int | None, rule: DecisionRule, as_json: bool
) -> ReplanReply | None:
    """The dry run with no control plane running: the database's run, its plan, the cluster spec
    found by name (or given), decided as the control plane decides
    (:func:`~dmsc.runtime.control.replanning.dry_run_offline`); None when there is nothing to
    decide on (said so)."""
    from dmsc.cli.database import open_database
    from dmsc.runtime.control.advisors import newest_run
    from dmsc.runtime.control.replanning import NothingMeasured, WrongCluster, dry_run_offline

    db = open_database()
    run_id = run if run is not None else newest_run(db)
    if run_id is None:
        _nothing(as_json, None, "no run in this database yet: `dmsc up` starts one")
        return None
    try:
        return dry_run_offline(db, run_id, partial(_cluster, cluster), rule, time.time())
    except KeyError:
        raise SpecError("command line", "--run", f"no run {run_id}") from None
    except NothingMeasured as exc:
        _nothing(as_json, run_id, str(exc))
        return None
    except WrongCluster as exc:
        raise SpecError(cluster or exc.cluster, "", str(exc)) from None


def _apply(
    cluster: str | None, run: int | None, threshold: float, horizon: int, as_json: bool
) -> None:
    """``dmsc replan`` without ``--dry-run``: the running control plane decides on its own
    run's measurements and applies (exceptions raised, a move made)."""
    for flag, value in (("--cluster", cluster), ("--run", run)):
        if value is not None:
            raise SpecError(
                "command line", flag, "the running deployment uses its own (with --dry-run only)"
            )
    req = ReplanRequest(dry_run=False, threshold=threshold, horizon_steps=horizon)
    out = control_client().replan(req)
    if as_json:
        print(json.dumps(out.wire(), default=str))
        return
    for n, d in enumerate(out.decisions, 1):
        console.print(
            f"{n}. {d.module} {d.kind} {d.target}: {d.decision} ({d.why})", highlight=False
        )
    applied, where = out.applied, ", ".join(out.datacenters)
    console.print(
        f"decided in {out.decide_s or 0:.2f} s; "
        + (f"moved ({applied.target}) in {applied.move_s:.1f} s" if applied else "no move")
        + f"; stages now in {where}; exceptions raised: {len(out.exceptions_raised)}",
        highlight=False,
    )


def _nothing(as_json: bool, run_id: int | None, message: str) -> None:
    """Nothing to propose on: said plainly (exit 0, as an empty ``dmsc tasks list``)."""
    if as_json:
        print(json.dumps({"run": run_id, "dry_run": True, "decisions": [], "message": message}))
    else:
        console.print(message, highlight=False)
