"""What the control loop costs (:mod:`dmsc.runtime.control.loop`): its ticks, and the training
step with the loop on against off.

``dmsc up`` on the local CPU cluster (gpt-mini in two stages, as the tests deploy it), a
training task of ``--steps`` steps, ``dmsc down``; once with ``--control-interval 0`` (off) and
once with ``--control-interval INTERVAL`` and an objective checked every tick, alternating,
``--rounds`` times each. From each run: the median step time of the task (the ``metrics``
table), and with the loop on its ticks, their mean wall time and CPU time, and how many ran the
functional modules (the control plane's Prometheus metrics ``dmsc_control_loop_tick_seconds``,
``dmsc_control_loop_cpu_seconds_total`` and ``dmsc_control_loop_module_runs_total``, scraped
before ``dmsc down``). The loop's CPU share is its CPU time per tick over the interval. The
machine's load averages before and after say what else ran.

Prints a table, or with --json one object (``benchmarks/results/control_loop_cost_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def dmsc(home: Path, *args: str) -> str:
    env = {**os.environ, "DMSC_HOME": str(home)}
    res = subprocess.run(
        [sys.executable, "-m", "dmsc", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if res.returncode != 0:
        raise SystemExit(f"dmsc {' '.join(args)}: {res.stderr}")
    return res.stdout


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def one_run(home: Path, plan: Path, interval: float, steps: int) -> dict[str, Any]:
    from dmsc.data.db import Database

    flags = ["--control-interval", str(interval), "--slo", "step_time_s=60"]
    dmsc(home, "up", "--plan", str(plan), *flags)
    try:
        dmsc(home, "train", "--steps", str(steps))
        time.sleep(interval)  # a tick after the last step
        info = json.loads((home / "control.json").read_text())
        text = httpx.get(f"http://{info['metrics']}/metrics", timeout=10).text
    finally:
        dmsc(home, "down")
    db = Database(f"sqlite:///{home / 'dmsc.sqlite'}")
    task = max(t.id for t in db.tasks() if t.kind == "train")
    step_s = [m.step_s for m in db.metrics(task)][2:]  # the first steps warm up
    ticks = _metric(text, "dmsc_control_loop_tick_seconds_count")
    return {
        "interval_s": interval,
        "median_step_s": statistics.median(step_s),
        "ticks": ticks,
        "tick_wall_ms": _metric(text, "dmsc_control_loop_tick_seconds_sum") / ticks * 1e3
        if ticks
        else None,
        "tick_cpu_ms": _metric(text, "dmsc_control_loop_cpu_seconds_total") / ticks * 1e3
        if ticks
        else None,
        "module_runs": _metric(text, "dmsc_control_loop_module_runs_total"),
    }


def measure(interval: float, steps: int, rounds: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        plan = home / "plan.json"
        dmsc(home, "plan", "--cluster", str(ROOT / "examples/clusters/local-cpu.yaml"),
             "--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2", "--tp", "1",
             "--pp", "2", "--dp", "1", "--out", str(plan))  # fmt: skip
        for _ in range(rounds):
            for each in (0.0, interval):
                # each run in a data directory of its own: in one directory the runs' tables
                # and checkpoints piled up and each round's steps were slower than the last
                # (0.112, 0.120 and 0.134 s with the loop off), which reads as the loop's
                # cost when it runs second in every round
                run_home = Path(tempfile.mkdtemp(prefix="run-", dir=home))
                runs.append(one_run(run_home, plan, each, steps))
    off = [r["median_step_s"] for r in runs if r["interval_s"] == 0]
    on = [r for r in runs if r["interval_s"] > 0]
    cpu = statistics.mean(r["tick_cpu_ms"] for r in on)
    return {
        "steps": steps,
        "rounds": rounds,
        "interval_s": interval,
        "runs": runs,
        "median_step_off_s": statistics.median(off),
        "median_step_on_s": statistics.median(r["median_step_s"] for r in on),
        "step_on_over_off": statistics.median(r["median_step_s"] for r in on)
        / statistics.median(off),
        "tick_wall_ms": statistics.mean(r["tick_wall_ms"] for r in on),
        "tick_cpu_ms": cpu,
        "cpu_share": cpu / 1e3 / interval,
        "load_before": load_before,  # the 1, 5 and 15 minute load averages (other jobs)
        "load_after": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=1.0, help="Seconds between ticks (on).")
    ap.add_argument("--steps", type=int, default=40, help="Training steps per run.")
    ap.add_argument("--rounds", type=int, default=2, help="Runs with the loop off and on each.")
    ap.add_argument("--json", action="store_true", help="One JSON object instead of the table.")
    args = ap.parse_args()
    out = measure(args.interval, args.steps, args.rounds)
    if args.json:
        print(json.dumps(out))
        return
    for r in out["runs"]:
        print(
            f"interval {r['interval_s']:>4g} s: median step {r['median_step_s'] * 1e3:7.1f} ms, "
            f"{r['ticks']:.0f} ticks, {r['tick_wall_ms'] or 0:.1f} ms wall and "
            f"{r['tick_cpu_ms'] or 0:.1f} ms CPU each, {r['module_runs']:.0f} ran the modules"
        )
    print(
        f"step with the loop on / off: {out['step_on_over_off']:.3f}; a tick: "
        f"{out['tick_wall_ms']:.1f} ms wall, {out['tick_cpu_ms']:.1f} ms CPU "
        f"({out['cpu_share']:.2%} of a core at one tick per {out['interval_s']:g} s)"
    )


if __name__ == "__main__":
    main()
