"""The planner learning from a run: predicted against measured step time on the CPU demo's plan,
before recalibration and after one, over several runs.

Each run, in a fresh data directory, does what ``dmsc demo`` does and then what a user does to
recalibrate, all through the ``dmsc`` command:

1. **before**: ``dmsc calibrate`` (this machine measured), ``dmsc plan`` of the demo's job
   (gpt-mini, pp=3, batch 16 in 4 micro-batches, 1F1B) on the calibrated spec, ``dmsc up``,
   ``dmsc train --steps N``, ``dmsc down``: the prediction is the plan's, the measurement the
   task's median step (warm-up left out);
2. **after**: ``dmsc calibrate --from-run RUN`` (the spec the control plane fitted to run 1's
   traces when its task ended), ``dmsc plan --calibrated`` (the same job on that fit), ``dmsc
   up`` with the new plan, ``dmsc train --steps N``, ``dmsc down``.

The error is measured over predicted minus one (positive: slower than predicted). How far a step
repeats within one run on this machine is reported beside it (``repeat_error``: the median step
of the second half of the task's steps against the first's): no prediction can come closer to a
run than the run comes to itself. The fit's own
figures (the devices' speed from the stages' spans, the step factor beyond them, the links'
factors) are reported beside them. Prints a table, or with --json one object; --out also writes
the JSON (benchmarks/results/recalibration_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from _deployment import home_and_dmsc

GOAL = 0.05  # |error| at most this, every run
JOB = ("--model", "gpt-mini", "--global-batch", "16", "--micro-batch", "4")
STRATEGY = ("--tp", "1", "--pp", "3", "--dp", "1", "--schedule", "1f1b")


def _halves(home: Path, task: int) -> tuple[float, float]:
    """The median step of the first and of the second half of the task's steps, warm-up left
    out as the task's median leaves it out: how far the step repeats within one run."""
    from dmsc.data.db import Database

    steps = [m.step_s for m in Database(f"sqlite:///{home / 'dmsc.sqlite'}").metrics(task)]
    kept = steps[len(steps) // 5 :]
    half = len(kept) // 2
    return statistics.median(kept[:half]), statistics.median(kept[half:])


def _train(dmsc: Any, home: Path, plan: Path, cluster: Path, steps: int) -> dict[str, Any]:
    """Deploy ``plan``, train ``steps`` steps, take it down: the task's reply and its run."""
    dmsc("up", "--plan", str(plan), "--cluster", str(cluster))
    try:
        run = json.loads(dmsc("status", "--json"))["run"]
        reply = json.loads(dmsc("train", "--steps", str(steps), "--json").splitlines()[-1])
        load = os.getloadavg()[0]  # the machine's run queue meanwhile (shared: it varies)
    finally:
        dmsc("down")
    measured, predicted = reply["median_step_s"], reply["predicted_step_s"]
    first, second = _halves(home, reply["task"])
    return {
        "run": run,
        "task": reply["task"],
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "error": measured / predicted - 1,
        "load_1min": load,
        "halves_step_s": [first, second],
        "repeat_error": second / first - 1,  # the second half against the first
    }


def one_run(steps: int) -> dict[str, Any]:
    home, dmsc = home_and_dmsc("dmsc-recal-")
    calibrated = home / "local-cpu.calibrated.yaml"
    dmsc("calibrate", "--out", str(calibrated))
    plan = home / "plan.json"
    dmsc("plan", "--cluster", str(calibrated), *JOB, *STRATEGY, "--out", str(plan))
    before = _train(dmsc, home, plan, calibrated, steps)
    refit = home / "recalibrated.yaml"
    dmsc("calibrate", "--from-run", str(before["run"]), "--out", str(refit))
    plan2 = home / "plan-calibrated.json"
    planned = json.loads(
        dmsc("plan", "--cluster", str(calibrated), *JOB, *STRATEGY, "--calibrated", "--json",
             "--out", str(plan2))
    )  # fmt: skip
    after = _train(dmsc, home, plan2, refit, steps)
    fit = _fit_figures(home, before["run"])
    same = _placed(plan) == _placed(plan2)
    return {
        "before": before,
        "after": after,
        "fit": fit,
        "calibrated": planned["calibrated"],
        "same_plan": same,  # False: the planner cut or placed the stages otherwise on the fit
    }


def _placed(plan: Path) -> list[Any]:
    """A plan's stages as deployed: each one's layers and its replicas' devices."""
    stages = json.loads(plan.read_text())["stages"]
    return [
        (st["chunks"], [(r["datacenter"], r["devices"]) for r in st["replicas"]]) for st in stages
    ]


def _fit_figures(home: Path, run: int) -> dict[str, Any]:
    """The fit the control plane kept for ``run`` (its figures, from the database)."""
    from dmsc.data.calibrations import run_fits
    from dmsc.data.db import Database

    rec = next(
        r for r in run_fits(Database(f"sqlite:///{home / 'dmsc.sqlite'}"), run) if r.spec_json
    )
    fit = json.loads(rec.fit_json)
    return {
        k: fit[k]
        for k in ("span_speed", "step_factor", "device_speed", "link_scale", "steps", "notes")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    started = time.time()
    runs = [one_run(args.steps) for _ in range(args.runs)]
    within = {
        phase: [abs(r[phase]["error"]) <= GOAL for r in runs] for phase in ("before", "after")
    }
    out = {
        "machine": f"{platform.node()} ({platform.machine()}, {platform.python_version()})",
        "steps": args.steps,
        "goal": GOAL,
        "runs": runs,
        "within_goal": {k: sum(v) for k, v in within.items()},
        "median_abs_error": {
            phase: statistics.median(abs(r[phase]["error"]) for r in runs)
            for phase in ("before", "after")
        },
        # after, split by whether the recalibrated planner kept the plan the fit measured
        "after_error_by_plan": {
            kept: [
                round(r["after"]["error"], 4) for r in runs if r["same_plan"] == (kept == "same")
            ]
            for kept in ("same", "other")
        },
        "median_abs_repeat_error": statistics.median(
            abs(r[phase]["repeat_error"]) for r in runs for phase in ("before", "after")
        ),
        "seconds": time.time() - started,
    }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
        return
    print(f"{'run':>3} {'before: predicted':>18} {'measured':>9} {'error':>7}   "
          f"{'after: predicted':>17} {'measured':>9} {'error':>7}   "
          "step factor   halves apart   plan after")  # fmt: skip
    for i, r in enumerate(runs, 1):
        b, a = r["before"], r["after"]
        print(
            f"{i:>3} {b['predicted_step_s'] * 1e3:>15.1f} ms {b['measured_step_s'] * 1e3:>6.1f} ms"
            f" {b['error']:>+7.1%}   {a['predicted_step_s'] * 1e3:>14.1f} ms "
            f"{a['measured_step_s'] * 1e3:>6.1f} ms {a['error']:>+7.1%}   "
            f"{r['fit']['step_factor']:.3f}   {b['repeat_error']:+.1%} / {a['repeat_error']:+.1%}"
            f"   {'the one measured' if r['same_plan'] else 'cut or placed otherwise'}"
        )
    print(
        f"within {GOAL:.0%}: before {out['within_goal']['before']} of {len(runs)} runs, after "
        f"{out['within_goal']['after']} of {len(runs)}; a run's second half against its first: "
        f"{out['median_abs_repeat_error']:.1%} apart (median)"
    )


if __name__ == "__main__":
    main()
