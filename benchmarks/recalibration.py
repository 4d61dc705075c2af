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

With ``--chain`` the runs share one data directory instead, as a user's ``$DMSC_HOME`` keeps
them: a first run planned on ``dmsc calibrate``'s spec, then ``--runs`` runs each planned
``--calibrated`` on the newest fit, which pools the earlier runs of the same placement (up to
five tasks, :mod:`dmsc.data.calibrations`): the planner learning from every run. Each run's
error is reported against its own plan's prediction and against the first plan's.

A task trains the demo's 200 steps unless ``--steps`` says otherwise.

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


def chained(runs: int, steps: int) -> dict[str, Any]:
    """``runs`` + 1 runs in one data directory, as a user's ``$DMSC_HOME`` keeps them: the first
    planned on ``dmsc calibrate``'s spec, each later one ``dmsc plan --calibrated`` on the newest
    fit, which pools the earlier runs of the same placement (up to five tasks). Each run's error
    against its own plan's prediction, and against the first plan's (before recalibration)."""
    home, dmsc = home_and_dmsc("dmsc-recal-chain-")
    calibrated = home / "local-cpu.calibrated.yaml"
    dmsc("calibrate", "--out", str(calibrated))
    first = home / "plan-0.json"
    dmsc("plan", "--cluster", str(calibrated), *JOB, *STRATEGY, "--out", str(first))
    out = [_train(dmsc, home, first, calibrated, steps)]
    before_s = out[0]["predicted_step_s"]
    for i in range(1, runs + 1):
        refit = home / f"recalibrated-{i}.yaml"
        dmsc("calibrate", "--from-run", str(out[-1]["run"]), "--out", str(refit))
        plan = home / f"plan-{i}.json"
        planned = json.loads(
            dmsc("plan", "--cluster", str(calibrated), *JOB, *STRATEGY, "--calibrated",
                 "--json", "--out", str(plan))
        )  # fmt: skip
        run = _train(dmsc, home, plan, refit, steps)
        run["calibrated"] = planned["calibrated"]
        run["pooled_tasks"] = _fit_figures(home, out[-1]["run"])["pooled"]
        run["same_plan"] = _placed(plan) == _placed(first)
        out.append(run)
    for run in out:
        run["error_before"] = run["measured_step_s"] / before_s - 1
    after = [r["error"] for r in out[1:]]
    return {
        "runs": out,
        "within_goal": {
            "before": sum(abs(r["error_before"]) <= GOAL for r in out[1:]),
            "after": sum(abs(e) <= GOAL for e in after),
        },
        "median_abs_error": {
            "before": statistics.median(abs(r["error_before"]) for r in out[1:]),
            "after": statistics.median(abs(e) for e in after),
        },
        "median_abs_repeat_error": statistics.median(abs(r["repeat_error"]) for r in out),
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
        k: fit.get(k)
        for k in (
            "span_speed",
            "step_factor",
            "device_speed",
            "link_scale",
            "steps",
            "notes",
            "pooled",
        )
    }


def _written(out: dict[str, Any], args: argparse.Namespace) -> bool:
    """Write ``out`` to ``--out`` when given; print it as JSON and say so with ``--json``."""
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return bool(args.json)


def _print_chain(args: argparse.Namespace, started: float) -> None:
    got = chained(args.runs, args.steps)
    out = {
        "machine": f"{platform.node()} ({platform.machine()}, {platform.python_version()})",
        "mode": "chain",
        "steps": args.steps,
        "goal": GOAL,
        **got,
        "seconds": time.time() - started,
    }
    if _written(out, args):
        return
    print(f"{'run':>3} {'predicted':>10} {'measured':>9} {'error':>7} {'vs first plan':>14}   "
          "pooled   halves apart")  # fmt: skip
    for i, r in enumerate(got["runs"]):
        print(
            f"{i:>3} {r['predicted_step_s'] * 1e3:>7.1f} ms {r['measured_step_s'] * 1e3:>6.1f} ms"
            f" {r['error']:>+7.1%} {r['error_before']:>+14.1%}   "
            f"{len(r.get('pooled_tasks') or []) + (1 if i else 0):>6}   {r['repeat_error']:+.1%}"
        )
    w, n = got["within_goal"], args.runs
    print(
        f"within {GOAL:.0%} after recalibration: {w['after']} of {n} runs (on the first plan's "
        f"prediction: {w['before']} of {n}); a run's halves {got['median_abs_repeat_error']:.1%} "
        "apart (median)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="a task's steps (the demo's 200)")
    ap.add_argument(
        "--chain",
        action="store_true",
        help="one data directory: a first run, then --runs runs each planned on the newest fit",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    started = time.time()
    if args.chain:
        _print_chain(args, started)
        return
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
    if _written(out, args):
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
