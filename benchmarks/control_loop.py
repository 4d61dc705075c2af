"""The control loop off and on, side by side in one run, on real deployments: a slowed link, a
stepped inference ramp, a busy node and a lost device.

Every scenario deploys gpt-mini with the local launcher (real worker processes, gRPC, SQLite)
twice: **off** (``--control-interval 0``: nothing watches) and **on** (``--control-interval``
``--interval``, 1 s by default, far shorter than the default 5 s so that the whole benchmark fits
in about six minutes on two cores; ``--control act``, objectives set per scenario). The same
fault is injected at the same point of the same work in both.

1. **slowed link** (``link``): gpt-mini pp=2 x dp=2 on three CPU "sites"
   (examples/clusters/three-sites-cpu.yaml, as benchmarks/replan.py), the site-a - site-b link
   shaped in the data plane to ``--slow-mbps`` (``StageLayout.link_mbps``: the mechanism of
   replan.py and thin_links.py; it is set when the workers start, so this one control plane runs
   in the benchmark's process, the loop started on it as ``dmsc up`` starts it). The fault is
   there from the first step: it counts from the start of the first training task. Two training
   tasks, ``--link-steps`` and ``--link-after-steps``, ``--gap`` seconds apart (the loop applies
   a move between tasks only). Objective ``step_time_s`` at ``--link-slo`` with the action
   ``move`` (benchmarks/results/replan.json: 0.33 s a step at the nominal link, 0.89 s slowed);
   the policy's ``confirm_ticks`` is ``--confirm-ticks``, its ``replan_interval_s``
   ``--replan-interval``.
2. **stepped inference ramp** (``ramp``): gpt-mini pp=2 x dp=1 on one box of four CPU devices
   (benchmarks/_deployment.py), ``dmsc up --gateway``, closed-loop clients through
   ``POST /v1/infer`` in steps (``--ramp``: clients x seconds); the fault is the step up. On:
   the loop with ``infer_p99_s`` at ``--infer-slo`` and the action ``scale-out``, and the
   autoscaler (``--autoscale``, with ``lookahead``) that makes the elastic pool; off: neither
   (nothing adapts the deployment). The objective is one two pipelines can hold at the top
   step and one cannot (benchmarks/results/autoscale.json: p99 1.53 s with two at 6 clients,
   3.19 s with one); on two cores the second pipeline only has what the first leaves idle.
3. **busy node** (``busy``): gpt-mini in one stage (pp=1 x dp=1) on
   examples/clusters/pinned-nodes-cpu.yaml (this machine as two nodes of one datacenter, each
   pinned to a core of its own), so the stage runs on node 0's core and node 1 is free. Two
   training tasks (``--busy-steps``, then ``--busy-after-steps`` after ``--gap`` seconds); a
   third into the first, ``--burners-per-core`` CPU-burning processes pinned to node 0's core,
   each in a session of its own, until the second ends. On: the policy's ``busy`` check (90% on
   ``--confirm-ticks`` ticks) and ``step_time_s`` (action ``alert``), ``--step-slo``, by
   default twice the median step before the fault of the run with the loop off, given to the
   run with it on (benchmarks/results/control_loop_cost_cpu.json: a median step of 0.17 to
   0.31 s here, and more when the shared machine is loaded: no fixed figure fits). The loop
   may move the stage to the idle node 1 (``move-node``), applied between the tasks. The
   worker's CPU share and its node's (its core) before, during the burn and in the second task
   come from its step traces (the telemetry the loop reads), and the cores the worker runs on
   before and after from the process itself.
4. **lost device** (``lost``): gpt-mini pp=2 x dp=1 on examples/clusters/local-cpu.yaml
   (``--failure-timeout 3``), one training task
   of ``--lost-steps`` checkpointing every 5; after a third of them the stage-1 worker is
   killed (``dmsc chaos --kill-worker stage=1``, kill -9). The runtime detects and replaces it
   (its ``faults`` row), loop or not; on: ``step_time_s`` (as for the busy node) and
   ``error_rate`` at 0.2 are checked every tick.

Figures per scenario and mode (pure, in benchmarks/_loop_figures.py), all from the database the
run left (``control_decisions``, ``alerts``, ``scale_events``, ``metrics``, ``faults``):

- ``detect_s``: the fault to the loop's first decision row or alert after it (notes left out:
  a forecast or a "keep", written whatever was measured);
- ``decide_s``: that row to the decision on the fault: the first that changes the deployment
  (a move accepted, an alert whose policy names ``scale-out``), or, where none does, the first
  exception raised into the queue (``decision`` names it, ``outcome`` is what became of it);
- ``apply_s``: that decision to the scale event that carried it out (the move done, the replica
  serving); ``fault_to_applied_s`` the whole way;
- ``slo_lost_s``: the seconds over the objective: for training, the seconds spent in steps
  slower than the step objective from the fault on (both tasks for ``link``); for the ramp,
  the seconds of 5-s windows of arrivals after the step up whose p99 latency is above the
  objective;
- ``decisions``: the rows of each kind after the fault (``paths/move-stage: apply``, ``alert
  step_time_s``, ``scale out (autoscaler)``...), and ``autoscaler_out_s``: when the autoscaler
  added a replica of its own;
- per scenario also: ``window_s`` (the work's wall time, fault to end), median steps, the
  runtime's own fault row (lost device), the workers' CPU % and their node's (busy node).

The machine is shared: the load average before and after is recorded (as benchmarks/tls_cost.py
does). Prints a table, or with --json one object with the same figures
(benchmarks/results/control_loop_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _deployment import ONE_BOX, closed_loop, free_port, home_and_dmsc
from _loop_figures import (
    alert_row,
    decision_row,
    loop_figures,
    p99_seconds_over,
    scale_row,
    step_seconds_over,
)

from dmsc.data.control_records import alerts, decisions
from dmsc.data.db import Database
from dmsc.data.traces import step_traces
from dmsc.runtime.control.advisors.base import unix_s

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "on")


# -- reading a run back ------------------------------------------------------------------------
def _db(home: Path) -> Database:
    return Database(f"sqlite:///{home / 'dmsc.sqlite'}")


def _rows(db: Database) -> list[dict[str, Any]]:
    """Every decision, alert and scale event of the database's runs, as plain rows."""
    out: list[dict[str, Any]] = []
    for run in {t.run_id for t in db.tasks()} or {1}:
        out += [decision_row(unix_s(d.at) or 0.0, d) for d in decisions(db, run, 10_000)]
        out += [alert_row(unix_s(a.at) or 0.0, a) for a in alerts(db, run, limit=10_000)]
        out += [scale_row(unix_s(e.at) or 0.0, e) for e in db.scale_events(run)]
    return sorted(out, key=lambda r: r["t"])


def _train_tasks(db: Database) -> list[Any]:
    return [t for t in db.tasks() if t.kind == "train"]


def _steps(db: Database, task: int) -> list[float]:
    return [m.step_s for m in db.metrics(task)]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _wait_steps(db: Database, n: int, timeout_s: float = 300) -> int:
    """Wait until the newest training task has ``n`` steps; its id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tasks = _train_tasks(db)
        if tasks and len(db.metrics(tasks[-1].id)) >= n:
            return tasks[-1].id
        time.sleep(0.1)
    raise SystemExit(f"no training task reached {n} steps in {timeout_s:g} s")


def _done(home: Path, a: argparse.Namespace) -> None:
    """A run's data directory, read: removed (its checkpoints take about 100 MB) unless
    ``--keep-homes``."""
    if a.keep_homes:
        print(f"# kept {home}", file=sys.stderr)
    else:
        shutil.rmtree(home, ignore_errors=True)


def _loop_flags(mode: str, interval: float, slos: list[str]) -> list[str]:
    if mode == "off":
        return ["--control-interval", "0"]
    flags = ["--control-interval", f"{interval:g}", "--control", "act"]
    for s in slos:
        flags += ["--slo", s]
    return flags


_PLANS: dict[tuple[str, int, int], str] = {}  # (cluster file's text, dp, pp) -> dmsc plan's plan


def _plan(home: Path, dmsc: Callable[..., str], cluster: Path, dp: int, pp: int = 2) -> Path:
    """gpt-mini ``pp`` x ``dp`` on ``cluster`` into ``home/plan.json`` (``dmsc plan`` once per
    cluster, dp and pp: a plan holds no path of its home, the second run copies it)."""
    plan = home / "plan.json"
    key = (cluster.read_text(), dp, pp)
    if key in _PLANS:
        plan.write_text(_PLANS[key])
        return plan
    dmsc(
        *("plan", "--cluster", str(cluster), "--model", "gpt-mini", "--global-batch", "8"),
        *("--micro-batch", "2", "--tp", "1", "--pp", str(pp), "--dp", str(dp), "--out", str(plan)),
    )
    _PLANS[key] = plan.read_text()
    return plan


# -- 1. a slowed link --------------------------------------------------------------------------
def slowed_link(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    """Two training tasks on a deployment whose site-a - site-b link is slowed (the control
    plane in this process: the link is shaped where its workers start)."""
    from dmsc.planner.solve import plan_job
    from dmsc.runtime.control.loop.objectives import Policy
    from dmsc.runtime.control.loop.runner import ControlLoop
    from dmsc.runtime.control.loop.tick import LoopConfig
    from dmsc.runtime.control.plane import ControlPlane
    from dmsc.runtime.transport import logs
    from dmsc.runtime.transport.messages import TrainRequest
    from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

    cluster = load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)  # each stage fills a site
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    home = Path(tempfile.mkdtemp(prefix=f"dmsc-loop-link-{mode}-"))
    db = _db(home)
    log = logs.file_logger(f"dmsc.control.bench-{mode}", logs.log_file(home, logs.CONTROL))
    cp = ControlPlane(plan, db, home=home, cluster=cluster, log=log)
    cp.deployment.layout.link_mbps = {
        ("site-a", "site-b"): a.slow_mbps,
        ("site-a", "site-c"): 100.0,
        ("site-c", "site-b"): 100.0,
    }
    before = [st.datacenter for st in plan.stages]
    loop = None
    try:
        cp.start()
        if mode == "on":
            policy = Policy.model_validate(
                {
                    "slos": {"step_time_s": {"max": a.link_slo, "action": "move"}},
                    "confirm_ticks": a.confirm_ticks,
                    "replan_interval_s": a.replan_interval,
                }
            )
            loop = ControlLoop(cp, LoopConfig(policy, "act"), a.interval, log)
            loop.start(cp.stopped)
        t0 = time.time()
        cp.train(TrainRequest(steps=a.link_steps, checkpoint_every=a.link_steps))
        time.sleep(a.gap)  # between two tasks: where the loop may move the deployment
        cp.train(TrainRequest(steps=a.link_after_steps, checkpoint_every=a.link_after_steps))
        end = time.time()
        after = [st.datacenter for st in cp.plan.stages]
    finally:
        cp.stopped.set()
        if loop is not None:
            loop.close()
        cp.deployment.shutdown()
    tasks = _train_tasks(db)
    fault = unix_s(tasks[0].started_at) or t0
    steps = [_steps(db, t.id) for t in tasks]
    out = loop_figures(fault, _rows(db))
    out.update(
        slo_s=a.link_slo,
        slo_lost_s=sum(step_seconds_over(s[1:], a.link_slo) for s in steps),  # step 0 warms up
        window_s=end - fault,
        median_step_s=[_median(s[1:]) for s in steps],
        datacenters={"before": before, "after": after},
        loop_cost=loop.cost.as_json() if loop is not None else None,
    )
    _done(home, a)
    return out


# -- 2. a stepped inference ramp ---------------------------------------------------------------
def ramp(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    home, dmsc = home_and_dmsc(f"dmsc-loop-ramp-{mode}-")
    cluster = home / "one-box.yaml"
    cluster.write_text(ONE_BOX)
    plan = _plan(home, dmsc, cluster, 1)
    port = free_port()
    extra = ["--autoscale", a.autoscale, "--cluster", str(cluster)] if mode == "on" else []
    flags = _loop_flags(mode, a.interval, [f"infer_p99_s={a.infer_slo:g}:scale-out"])
    dmsc("up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}", "--tenant-requests", "64",
         *extra, *flags)  # fmt: skip
    steps = [(int(c), float(s)) for c, s in (p.split("x") for p in a.ramp.split(","))]
    answered: list[tuple[float, float]] = []
    errors = 0
    fault = end = 0.0
    try:
        out = dmsc("token", "create", "--tenant", "bench", "--scopes", "infer,read",
                   "--rate", "1000", "--burst", "1000")  # fmt: skip
        key = re.findall(r"dmsc_[A-Za-z0-9_-]+", out)[-1]
        body = {"prompt": "def ", "tokens": a.tokens, "temperature": 0.8}
        url = f"http://127.0.0.1:{port}/v1/infer"
        for i, (n, seconds) in enumerate(steps):
            if i == 1:
                fault = time.time()  # the step up
            got = closed_loop(url, body, {"Authorization": f"Bearer {key}"}, n, seconds)
            answered += zip(got.sent, got.latency, strict=True)
            errors += len(got.errors)
        end = time.time()
        time.sleep(a.interval)  # the loop's last tick sees the end
    finally:
        dmsc("down")
    db = _db(home)
    res = loop_figures(fault, _rows(db))
    during = [lat for t, lat in answered if t >= fault]
    from _loop_figures import nearest_rank

    res.update(
        slo_s=a.infer_slo,
        slo_lost_s=p99_seconds_over(answered, a.infer_slo, fault, end),
        window_s=end - fault,
        answered=len(answered),
        errors=errors,
        p99_after_step_s=nearest_rank(during, 99) if during else None,
        replicas_added=sum(r["source"] == "scale" and r["action"] == "out" for r in _rows(db)),
    )
    _done(home, a)
    return res


# -- 3. a busy node and 4. a lost device: dmsc up, one training task ---------------------------
def _up_and_train(
    mode: str, a: argparse.Namespace, name: str, steps: int, slos: list[str], inject: Callable
) -> tuple[Path, Database, dict[str, Any]]:
    """``dmsc up`` on local-cpu (pp=2), one training task of ``steps`` in a thread, and
    ``inject(home, dmsc, db)`` once a third of its steps ran (its return: the fault's time and
    what else it measured, and a function that ends the fault)."""
    home, dmsc = home_and_dmsc(f"dmsc-loop-{name}-{mode}-")
    plan = _plan(home, dmsc, ROOT / "examples/clusters/local-cpu.yaml", 1)
    dmsc("up", "--plan", str(plan), "--failure-timeout", "3", *_loop_flags(mode, a.interval, slos))
    db = _db(home)
    info: dict[str, Any] = {}
    try:
        done: list[str] = []
        trainer = threading.Thread(
            target=lambda: done.append(
                dmsc("train", "--steps", str(steps), "--checkpoint-every", "5")
            )
        )
        trainer.start()
        _wait_steps(db, steps // 3)
        info = inject(home, dmsc, db)
        trainer.join()
        info["end_s"] = time.time()
        stop = info.pop("stop", None)
        if stop is not None:
            stop()
        time.sleep(a.interval)  # a tick after the last step
    finally:
        dmsc("down")
    return home, db, info


def _burn(per_core: int, cores: set[int] | None = None) -> tuple[float, Callable[[], None]]:
    """``per_core`` CPU-burning processes per core of the machine (of ``cores`` only, pinned to
    them: a busy node's), each in a session of its own (Linux's autogroup scheduler shares the
    CPU between sessions first: burners in one session would take one share between them, as
    one tenant's job does); when they started, and what stops them."""
    on = sorted(cores) if cores else list(range(os.cpu_count() or 1))
    procs = []
    for core in on:
        for _ in range(per_core):
            p = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            if cores:
                os.sched_setaffinity(p.pid, {core})
            procs.append(p)

    def stop() -> None:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()

    return time.time(), stop


_STEP_SLOS: dict[str, float] = {}  # scenario -> the step objective both its runs are held to
STEP_SLO_FACTOR = 2.0


def _step_slo(a: argparse.Namespace, name: str, before: list[float] | None = None) -> float:
    """The step objective of scenario ``name``: ``--step-slo``, or when that is 0,
    ``STEP_SLO_FACTOR`` times the median step before the fault of its first run (loop off),
    which the second run (loop on) is then given at ``dmsc up``: the shared machine's load
    moves the step more than a fixed figure allows. Called before a run (the objective, or 0
    while none is known) and after it with its steps before the fault."""
    if a.step_slo > 0:
        return float(a.step_slo)
    if name not in _STEP_SLOS and before:
        _STEP_SLOS[name] = round(STEP_SLO_FACTOR * statistics.median(before), 3)
    return _STEP_SLOS.get(name, 0.0)


def busy_node(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    """Two training tasks on examples/clusters/pinned-nodes-cpu.yaml (node 0 on core 0, node 1
    on core 1): the one stage on node 0, node 1 free. A third into the first task, burners
    start on node 0's core, until the second task ends."""
    home, dmsc = home_and_dmsc(f"dmsc-loop-busy-{mode}-")
    cluster = ROOT / "examples/clusters/pinned-nodes-cpu.yaml"
    plan = _plan(home, dmsc, cluster, 1, pp=1)
    slo = _step_slo(a, "busy")
    flags = _loop_flags(mode, a.interval, [f"step_time_s={slo:g}"])
    if mode == "on":
        policy = home / "policy.json"
        policy.write_text(json.dumps({"busy": {"cpu_percent": 90, "ticks": a.confirm_ticks},
                                      "confirm_ticks": a.confirm_ticks}))  # fmt: skip
        flags += ["--policy", str(policy)]
    dmsc("up", "--plan", str(plan), "--cluster", str(cluster), *flags)
    db = _db(home)
    stop: Callable[[], None] = lambda: None  # noqa: E731
    try:
        done: list[str] = []
        first = threading.Thread(
            target=lambda: done.append(dmsc("train", "--steps", str(a.busy_steps)))
        )
        first.start()
        task = _wait_steps(db, a.busy_steps // 3)
        at_step = len(db.metrics(task))
        cores = {"before": _stage_cores(home, 0)}
        fault, stop = _burn(a.burners_per_core, cores={0})
        first.join()
        time.sleep(a.gap)  # between the tasks: where the loop applies a move
        dmsc("train", "--steps", str(a.busy_after_steps))
        end = time.time()
        cores["after"] = _stage_cores(home, 0)
        stop()
        time.sleep(a.interval)  # a tick after the last step
    finally:
        stop()
        dmsc("down")
    tasks = _train_tasks(db)
    k = at_step
    before = _steps(db, tasks[0].id)
    slo = _step_slo(a, "busy", before[1:k])
    after = _steps(db, tasks[-1].id)
    cpu: dict[str, list[float]] = {"before": [], "during": [], "second task": []}
    node: dict[str, list[float]] = {"before": [], "during": [], "second task": []}
    traced = [(t, "before" if t.step < k else "during") for t in step_traces(db, tasks[0].id)]
    traced += [(t, "second task") for t in step_traces(db, tasks[-1].id)]
    for t, when in traced:
        if t.stage != 0 or t.step < 1:
            continue
        if t.cpu_percent is not None:
            cpu[when].append(t.cpu_percent)
        if t.node_cpu_percent is not None:
            node[when].append(t.node_cpu_percent)
    out = loop_figures(fault, _rows(db))
    out.update(
        slo_s=slo,
        slo_lost_s=step_seconds_over(before[k:] + after, slo),  # from the fault on
        window_s=end - fault,
        median_step_s={
            "before": _median(before[1:k]),
            "during": _median(before[k:]),
            "second task": _median(after[1:]),
        },
        # stage 0's worker and its node (its cores), from the step traces
        worker_cpu_percent={w: _median(v) for w, v in cpu.items()},
        node_cpu_percent={w: _median(v) for w, v in node.items()},
        stage0_cores=cores,  # its worker's CPU affinity, before the burn and after the work
        burners=a.burners_per_core,
    )
    _done(home, a)
    return out


def _stage_cores(home: Path, stage: int) -> list[int] | None:
    """The cores the worker of ``stage`` (replica 0) may run on now: its process found by the
    standard error it writes (``logs/sid-STAGE-...-r0.stderr``)."""
    import psutil

    for proc in psutil.process_iter():
        try:
            for f in proc.open_files():
                name = Path(f.path).name
                if str(home) in f.path and name.startswith(f"sid-{stage}-") and "-r0" in name:
                    return sorted(proc.cpu_affinity())
        except psutil.Error:
            continue
    return None


def lost_device(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    def inject(home: Path, dmsc: Callable[..., str], db: Database) -> dict[str, Any]:
        at_step = len(db.metrics(_train_tasks(db)[-1].id))
        said = json.loads(dmsc("chaos", "--kill-worker", "stage=1", "--watch", "120", "--json"))
        return {"chaos": said, "at_step": at_step}

    slo = _step_slo(a, "lost")
    slos = [f"step_time_s={slo:g}", "error_rate=0.2"]
    home, db, info = _up_and_train(mode, a, "lost", a.lost_steps, slos, inject)
    faults = [f for f in db.faults(_train_tasks(db)[-1].run_id) if f.kind == "worker"]
    said = info["chaos"]
    fault = faults[0].detected_at - said["detected_after_s"] if faults else info["end_s"]
    task = _train_tasks(db)[-1]
    steps = _steps(db, task.id)
    k = info["at_step"]
    slo = _step_slo(a, "lost", steps[1:k])
    out = loop_figures(fault, _rows(db))
    out.update(
        slo_s=slo,
        slo_lost_s=step_seconds_over(steps[k:], slo),  # from the fault on
        window_s=info["end_s"] - fault,
        median_step_s={"before": _median(steps[1:k]), "after": _median(steps[k:])},
        task_state=task.state,
        runtime_fault={
            "detected_s": said["detected_after_s"],
            "recovered_s": said["recovered_after_s"],
            "steps_lost": said["steps_lost"],
        },
    )
    _done(home, a)
    return out


SCENARIOS: dict[str, Callable[[str, argparse.Namespace], dict[str, Any]]] = {
    "link": slowed_link,
    "ramp": ramp,
    "busy": busy_node,
    "lost": lost_device,
}


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    ap.add_argument("--interval", type=float, default=1.0, help="the loop's tick, seconds (on)")
    ap.add_argument("--slow-mbps", type=float, default=10.0)
    ap.add_argument("--link-steps", type=int, default=24, help="the first task's steps")
    ap.add_argument("--link-after-steps", type=int, default=12, help="the second's")
    ap.add_argument("--link-slo", type=float, default=0.6, help="step_time_s, slowed link")
    ap.add_argument("--confirm-ticks", type=int, default=2)
    ap.add_argument(
        "--replan-interval", type=float, default=30.0, help="the policy's replan_interval_s"
    )
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between the link's tasks")
    ap.add_argument("--ramp", default="1x8,6x25", help="CLIENTSxSECONDS,...")
    ap.add_argument("--tokens", type=int, default=24)
    # two pipelines just hold it at the top step: at 6 clients their p99 was 1.53 s
    # (benchmarks/results/autoscale.json, fixed-max), one pipeline's 3.19 s
    ap.add_argument("--infer-slo", type=float, default=1.5, help="infer_p99_s, seconds")
    ap.add_argument(
        "--autoscale", default="infer:min=1,max=2,target=2,cooldown=5,window=5,lookahead=12"
    )
    ap.add_argument(
        "--step-slo",
        type=float,
        default=0.0,
        help="step_time_s, busy and lost (0: twice the loop-off run's median step before the "
        "fault)",
    )
    ap.add_argument("--busy-steps", type=int, default=24, help="busy: the first task's steps")
    ap.add_argument("--busy-after-steps", type=int, default=12, help="busy: the second's")
    ap.add_argument("--burners-per-core", type=int, default=3)
    ap.add_argument("--lost-steps", type=int, default=30)
    ap.add_argument("--keep-homes", action="store_true", help="keep each run's data directory")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    names = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        results[name] = {}
        for mode in MODES:
            s0 = time.perf_counter()
            results[name][mode] = SCENARIOS[name](mode, a)
            results[name][mode]["bench_wall_s"] = time.perf_counter() - s0
            print(f"# {name} {mode}: {json.dumps(results[name][mode])}", file=sys.stderr)
    doc = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("json", "out", "keep_homes")},
        "cores": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "scenarios": results,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    if a.json:
        print(json.dumps(doc))
        return
    print(
        f"control loop off and on, tick {a.interval:g} s; {doc['wall_s']:.0f} s in all; load "
        f"{load_before[0]:.1f} before, {doc['load_after'][0]:.1f} after ({os.cpu_count()} cores)"
    )
    head = ("scenario", "loop", "detect s", "decide s", "apply s", "SLO lost s", "window s")
    print(f"{head[0]:<9} {head[1]:<4} " + " ".join(f"{h:>10}" for h in head[2:]) + "  decisions")
    for name, per in results.items():
        for mode, r in per.items():
            made = ", ".join(f"{k} x{n}" for k, n in r["decisions"].items()) or "none"
            if r["autoscaler_out_s"]:
                made += " (at " + ", ".join(f"{t:.1f}" for t in r["autoscaler_out_s"]) + " s)"
            print(
                f"{name:<9} {mode:<4} {_fmt(r['detect_s']):>10} {_fmt(r['decide_s']):>10} "
                f"{_fmt(r['apply_s']):>10} {_fmt(r['slo_lost_s']):>10} "
                f"{_fmt(r['window_s']):>10}  {made}"
            )


logging.getLogger("httpx").setLevel(logging.WARNING)

if __name__ == "__main__":
    main()
