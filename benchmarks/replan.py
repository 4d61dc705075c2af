"""Replanning a deployment whose inter-stage link is slowed: detected, decided, moved.

gpt-mini in two stages on three CPU "sites" joined pairwise (two-sites-cpu with a third site;
every link 100 Mbit/s nominal, the direct site-a - site-b link 100 km, the detour through site-c
150 km each way). The planner puts stage 0 in site-a and stage 1 in site-b. The links are shaped
in the data plane (``StageLayout.link_mbps``: a worker's pipeline sends to a stage in another
datacenter wait for a link of that rate; not ``tc``, which needs privileges):

1. **before**: every link at its nominal 100 Mbit/s;
2. **during**: the site-a - site-b link slowed to ``--slow-mbps`` (10 by default);
3. **decide**: the functional modules read the run's measurements from the database (metrics,
   step traces) and the orchestrator decides (:func:`dmsc.runtime.control.modules.orchestrate`);
   the time that takes, and the proposal: the planner re-run on the measured bandwidth and
   compute;
4. **after**: the proposed plan deployed with the same slowed link (a fresh deployment: the move
   is applied here by redeploying; the running deployment is not migrated in place).

Each phase trains ``--steps`` steps (the first two left out of the median as warm-up). Prints a
table, or with --json one object: ``phases`` -> name -> ``median_step_s`` (and the placement),
``decide_s``, ``proposal`` (kind, target, predicted gain per step, cost, decision and reason).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.deployment import Deployment
from dmsc.runtime.control.modules import default_modules, orchestrate, read_measurements
from dmsc.runtime.control.modules.orchestrator import DecisionRule
from dmsc.runtime.control.modules.paths import replan
from dmsc.runtime.control.training import layout_from_plan, train
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = resolve_model("gpt-mini")
JOB = JobSpec(global_batch=8, micro_batch=2, pp=2, dp=1)
NOMINAL_MBPS = 100.0


def three_sites() -> ClusterSpec:
    data = yaml.safe_load((ROOT / "examples/clusters/two-sites-cpu.yaml").read_text())
    data["name"] = "three-sites-cpu"
    data["datacenters"].append({**data["datacenters"][0], "name": "site-c"})
    data["links"] = [
        {"a": "site-a", "b": "site-b", "km": 100, "bandwidth_gbit_s": 0.1},
        {"a": "site-a", "b": "site-c", "km": 150, "bandwidth_gbit_s": 0.1},
        {"a": "site-c", "b": "site-b", "km": 150, "bandwidth_gbit_s": 0.1},
    ]
    return ClusterSpec.model_validate(data)


def phase(
    plan: Plan,
    slow_mbps: float,
    steps: int,
    db: Database,
    corpus: Corpus,
    home: Path,
) -> tuple[float, int]:
    """Train ``steps`` steps of ``plan`` with the site-a - site-b link at ``slow_mbps`` (the
    others nominal), recorded in ``db``; (median step time, run id)."""
    assert isinstance(MODEL, TransformerSpec)
    layout = layout_from_plan(plan, MODEL)
    layout.link_mbps = {
        ("site-a", "site-b"): slow_mbps,
        ("site-a", "site-c"): NOMINAL_MBPS,
        ("site-c", "site-b"): NOMINAL_MBPS,
    }
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    task = db.new_task(run.id, "train", {"steps": steps}, state="running")
    with Deployment(layout, workdir=home / "workers", home=home) as dep:
        report = train(
            dep, corpus, corpus, steps, JOB.global_batch, plan.job.microbatches,
            db=db, task_id=task.id, validate=False,
        )  # fmt: skip
    db.set_task_state(task.id, "done")
    return statistics.median(report.step_s[2:]), run.id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--slow-mbps", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    cluster = three_sites()
    plan = plan_job(cluster, MODEL, JOB, fixed=True).plan
    home = Path(tempfile.mkdtemp(prefix="dmsc-replan-"))
    db = Database(f"sqlite:///{home / 'dmsc.sqlite'}")
    train_text, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train_text, MODEL.seq, seed=1)
    where = [st.datacenter for st in plan.stages]
    phases: dict[str, Any] = {}
    before, _ = phase(plan, NOMINAL_MBPS, args.steps, db, corpus, home)
    phases["before"] = {"median_step_s": before, "datacenters": where}
    during, run = phase(plan, args.slow_mbps, args.steps, db, corpus, home)
    phases["during"] = {"median_step_s": during, "datacenters": where}

    t0 = time.perf_counter()
    measurements = read_measurements(db, run, time.time())
    decisions = orchestrate(default_modules(cluster), measurements, DecisionRule())
    decide_s = time.perf_counter() - t0
    moves = [d for d in decisions if d.proposal.module == "paths"]
    proposal = moves[0].proposal if moves else None
    out: dict[str, Any] = {
        "steps": args.steps,
        "slow_mbps": args.slow_mbps,
        "nominal_mbps": NOMINAL_MBPS,
        "decide_s": decide_s,
        "proposal": None
        if proposal is None
        else {
            "kind": proposal.kind,
            "target": proposal.target,
            "predicted_gain_s_per_step": proposal.predicted_gain_s_per_step,
            "cost_s": proposal.cost_s,
            "decision": moves[0].verdict,
            "reason": moves[0].reason,
        },
    }
    found = replan(plan, cluster, measurements.traces)
    if not isinstance(found, str) and proposal is not None and proposal.kind != "keep":
        new = found.new_plan
        after, _ = phase(new, args.slow_mbps, args.steps, db, corpus, home)
        phases["after"] = {
            "median_step_s": after,
            "datacenters": [st.datacenter for st in new.stages],
            "predicted_s": found.new_s,
        }
    out["phases"] = phases
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out))
        return
    for name, p in phases.items():
        print(
            f"{name:<7} {p['median_step_s']:.3f} s a step   stages in {', '.join(p['datacenters'])}"
        )
    if out["proposal"]:
        p = out["proposal"]
        print(
            f"decided in {decide_s:.2f} s: {p['kind']} {p['target']}, predicted gain "
            f"{p['predicted_gain_s_per_step'] * 1e3:.0f} ms a step, cost {p['cost_s']:.1f} s: "
            f"{p['decision']} ({p['reason']})"
        )


if __name__ == "__main__":
    main()
