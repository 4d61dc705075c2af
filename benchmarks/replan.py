"""Replanning a deployment whose inter-stage link is slowed: detected, decided, moved.

gpt-mini in two stages on three CPU "sites" joined pairwise (two-sites-cpu with a third site;
every link 100 Mbit/s nominal, the direct site-a - site-b link 100 km, the detour through site-c
150 km each way). The planner puts stage 0 in site-a and stage 1 in site-b. The links are shaped
in the data plane (``StageLayout.link_mbps``: a worker's pipeline sends to a stage in another
datacenter wait for a link of that rate; not ``tc``, which needs privileges):

1. **before**: every link at its nominal 100 Mbit/s;
2. **during**: the site-a - site-b link slowed to ``--slow-mbps`` (10 by default);
3. **decide and move**: the running control plane's functional modules read the run's
   measurements from the database (metrics, step traces), the orchestrator decides, and the move
   it accepts is applied (:func:`dmsc.runtime.control.replanning.replan_now`, what ``dmsc
   replan`` calls): the deployment checkpoints, its workers start where the new plan puts them,
   and the checkpoint is loaded; the time to decide and the time to move;
4. **after**: the same deployment, moved, the link still slowed.

Each phase trains ``--steps`` steps (the first two left out of the median as warm-up). Prints a
table, or with --json one object: ``phases`` -> name -> ``median_step_s`` (and the placement),
``decide_s``, ``proposal`` (kind, target, predicted gain per step, cost, decision and reason).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.replanning import replan_now
from dmsc.runtime.transport.messages import ReplanRequest, TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = resolve_model("gpt-mini")
JOB = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)  # each stage fills a site
NOMINAL_MBPS = 100.0


def three_sites() -> ClusterSpec:
    """examples/clusters/three-sites-cpu.yaml: two-sites-cpu with a detour through site-c."""
    return load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")


def _median(cp: ControlPlane, task: int) -> float:
    """The task's median step time, its first step left out (warm-up)."""
    return statistics.median(m.step_s for m in cp.db.metrics(task)[1:])


def _plane(plan: Plan, cluster: ClusterSpec, home: Path, slow_mbps: float) -> ControlPlane:
    """A started control plane whose site-a - site-b link runs at ``slow_mbps`` (the others
    nominal), with the cluster spec it re-plans on."""
    home.mkdir(parents=True, exist_ok=True)
    cp = ControlPlane(
        plan, Database(f"sqlite:///{home / 'dmsc.sqlite'}"), home=home, cluster=cluster
    )
    cp.deployment.layout.link_mbps = {
        ("site-a", "site-b"): slow_mbps,
        ("site-a", "site-c"): NOMINAL_MBPS,
        ("site-c", "site-b"): NOMINAL_MBPS,
    }
    cp.start()
    return cp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slow-mbps", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    cluster = three_sites()
    plan = plan_job(cluster, MODEL, JOB, fixed=True).plan
    root = Path(tempfile.mkdtemp(prefix="dmsc-replan-"))
    phases: dict[str, Any] = {}
    where = [st.datacenter for st in plan.stages]
    cp = _plane(plan, cluster, root / "before", NOMINAL_MBPS)
    try:
        task = cp.train(TrainRequest(steps=args.steps))["task"]
        phases["before"] = {"median_step_s": _median(cp, task), "datacenters": where}
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()
    cp = _plane(plan, cluster, root / "slowed", args.slow_mbps)
    try:
        task = cp.train(TrainRequest(steps=args.steps))["task"]
        phases["during"] = {"median_step_s": _median(cp, task), "datacenters": where}
        out = replan_now(cp, ReplanRequest(dry_run=False))
        task = cp.train(TrainRequest(steps=args.steps))["task"]
        phases["after"] = {"median_step_s": _median(cp, task), "datacenters": out["datacenters"]}
    finally:
        cp.stopped.set()
        cp.deployment.shutdown()
    moves = [d for d in out["decisions"] if d["module"] == "paths"]
    doc: dict[str, Any] = {
        "steps": args.steps,
        "slow_mbps": args.slow_mbps,
        "nominal_mbps": NOMINAL_MBPS,
        "decide_s": out["decide_s"],
        "move_s": out["applied"]["move_s"] if out["applied"] else None,
        "proposal": None
        if not moves
        else {
            k: moves[0][k]
            for k in ("kind", "target", "predicted_gain_s_per_step", "cost_s", "decision", "why")
        },
        "phases": phases,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))
        return
    for name, p in phases.items():
        print(
            f"{name:<7} {p['median_step_s']:.3f} s a step   stages in {', '.join(p['datacenters'])}"
        )
    if doc["proposal"]:
        p = doc["proposal"]
        moved = f"; moved in {doc['move_s']:.1f} s" if doc["move_s"] is not None else ""
        print(
            f"decided in {doc['decide_s']:.2f} s{moved}: {p['kind']} {p['target']}, predicted gain "
            f"{p['predicted_gain_s_per_step'] * 1e3:.0f} ms a step, cost {p['cost_s']:.1f} s: "
            f"{p['decision']} ({p['why']})"
        )


if __name__ == "__main__":
    main()
