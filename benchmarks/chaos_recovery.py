"""Faults injected into a running gpt-mini deployment (real processes on 127.0.0.1) and what the
runtime does about them: time to detect, time to recover, steps lost, requests failed.

Scenarios: kill -9 and SIGSTOP of a stage worker during training (3 stages, checkpoint every
4 steps; the replacement launched, or a warm spare taking the stage over), a replica's stage
worker killed during a stream of inference requests (2 replicas of 2 stages, with and without
redundant execution), kill -9 of the control plane during a training task (``dmsc up`` in a
scratch home), and a late data-parallel gradient under each policy.

With ``--launcher ray``: the same kill -9 of a stage worker with the local launcher and with Ray
(without and with warm spares), a lost and a partitioned Ray node, and ``dmsc up`` time and
memory with each launcher, on a local Ray cluster (see ``benchmarks/_ray_faults.py``).

Prints a table, or with --json one object with the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.runtime.business.gateway import wait_ready
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.training.session import Recovering, train
from dmsc.spec import resolve_model
from dmsc.testing.chaos import FaultReport, serve_under_fault, train_under_fault

SPEC = resolve_model("gpt-mini")
THREE = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
TWO = [("embedding", "block_1"), ("block_2", "head")]
TTL = 3.0


def training_faults(corpora: tuple[Corpus, Corpus], steps: int) -> list[FaultReport]:
    out = []
    for fault, spares in (("kill", 0), ("freeze", 0), ("kill", 1)):
        report, fr = train_under_fault(
            StageLayout(SPEC, THREE),
            *corpora,
            steps,
            8,
            4,
            fault,  # type: ignore[arg-type]
            stage=1,
            at_step=steps // 2 + 1,
            checkpoint_every=4,
            registry_ttl_s=TTL,
            spares=spares,
        )
        fr.extra["steps_completed"] = len(report.losses)
        if spares:
            fr.fault += " (warm spare)"
        out.append(fr)
    return out


def inference_faults(requests: int) -> list[FaultReport]:
    out = []
    for redundant in (False, True):
        outcomes, fr = serve_under_fault(
            StageLayout(SPEC, TWO, replicas=2),
            requests,
            tokens=4,
            stage=1,
            kill_after=requests // 4,
            registry_ttl_s=TTL,
            redundant=redundant,
        )
        fr.fault = "kill (inference" + (", redundant)" if redundant else ")")
        fr.extra["max_request_s"] = max(o["seconds"] for o in outcomes)
        out.append(fr)
    return out


def _dmsc(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DMSC_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "dmsc", *args], capture_output=True, text=True, env=env, timeout=600
    )


def control_plane_fault(steps: int) -> FaultReport:
    """kill -9 of the control plane while a queued training task runs; restart; wait."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="dmsc-chaos-") as tmp:
        home = Path(tmp)
        plan = home / "plan.json"
        res = _dmsc(
            home,
            *("plan", "--cluster", str(root / "examples/clusters/local-cpu.yaml")),
            *("--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2"),
            *("--tp", "1", "--pp", "2", "--dp", "1", "--out", str(plan)),
        )
        assert res.returncode == 0, res.stderr

        def up() -> str:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            res = _dmsc(home, "up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}")
            assert res.returncode == 0, res.stderr
            assert wait_ready(f"http://127.0.0.1:{port}")
            return f"http://127.0.0.1:{port}"

        import httpx

        key = _dmsc(home, "token", "create", "--tenant", "b", "--scopes", "submit,read")
        auth = {"Authorization": f"Bearer {key.stdout.strip()}"}
        base = up()
        body = {"steps": steps, "checkpoint_every": 5}
        task = httpx.post(f"{base}/v1/tasks", json=body, headers=auth, timeout=60).json()["id"]
        db = Database(f"sqlite:///{home / 'dmsc.sqlite'}")
        while len(db.metrics(task)) < steps // 2:
            time.sleep(0.1)
        done_before = len(db.metrics(task))
        pid = json.loads((home / "control.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.time()
        time.sleep(0.5)
        base = up()
        fr = FaultReport("kill -9 (control plane)", "control plane")
        try:
            while db.tasks()[-1].state not in ("done", "failed"):
                time.sleep(0.2)
            status = json.loads(_dmsc(home, "status", "--json").stdout)
        finally:
            _dmsc(home, "down")
        restart = next(f for f in status["faults"] if f["kind"] == "control-plane")
        fr.detected_after_s = restart["detected_at"] - killed  # the restart notices
        fr.recovered_after_s = restart["recovered_at"] - killed
        fr.steps_lost = done_before - int(restart["checkpoint_step"] or 0)
        steps_seen = [m.step for m in db.metrics(task)]
        fr.extra["task_state"] = db.tasks()[-1].state
        fr.extra["steps_once_each"] = steps_seen == list(range(steps))
        return fr


def late_gradients(corpora: tuple[Corpus, Corpus]) -> dict[str, Any]:
    """Step time of the step whose gradient (replica 1 of each stage) is 2 s late, bound 0.5 s."""
    slow = {"slow_grads": {"steps": [3], "seconds": 2.0}}
    out: dict[str, Any] = {}
    for policy in ("wait", "skip", "restart"):
        layout = StageLayout(SPEC, TWO, replicas=2, faults={"stage0-r1": slow, "stage1-r1": slow})
        times: dict[int, float] = {}
        with Deployment(layout) as dep:
            report = train(
                dep,
                *corpora,
                6,
                8,
                2,
                on_step=lambda s, o, times=times: times.__setitem__(s, o["step_s"]),
                recovering=Recovering(late_policy=policy, grad_wait_s=0.5),
                validate=False,
            )
        others = [t for s, t in times.items() if s != 3]
        out[policy] = {
            "late_step_s": times[3],
            "other_steps_s": sorted(others)[len(others) // 2],
            "skipped": len(report.skipped),
            "restarts": report.restarts,
        }
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fault_table(faults: list[FaultReport]) -> None:
    print(f"fault tolerance (registry TTL {TTL:g} s, heartbeat every TTL/3)")
    print(f"{'fault':32} {'target':14} {'detect s':>9} {'recover s':>10} {'lost':>5} {'failed':>8}")
    for f in faults:
        failed = f"{f.requests_failed}/{f.requests_total}" if f.requests_total else "-"
        print(
            f"{f.fault:32} {f.target:14} {_fmt(f.detected_after_s):>9} "
            f"{_fmt(f.recovered_after_s):>10} {f.steps_lost:>5} {failed:>8}"
        )


def ray_main(corpora: tuple[Corpus, Corpus], steps: int, as_json: bool) -> None:
    from _ray_faults import ray_figures

    out = ray_figures(SPEC, TWO, corpora, steps, TTL)
    faults = out.pop("faults")
    out["faults"] = [{**f.row(), **f.extra} for f in faults]
    if as_json:
        print(json.dumps(out))
        return
    _fault_table(faults)
    up = out["startup"]
    print(f"\nRay cluster of 3 nodes on 127.0.0.1: started in {out['cluster_start_s']:.1f} s, "
          f"{out['cluster_idle_mib']:.0f} MiB (PSS) idle")  # fmt: skip
    print(f"dmsc up, gpt-mini in {up['stages']} stages, median of the rounds:")
    for name, secs in up["up_s"].items():
        mem = up["memory"][name]
        ray = f", Ray's processes {mem['ray_mib']:.0f} MiB" if "ray_mib" in mem else ""
        print(f"  {name:6} {secs:6.2f} s; control plane and workers {mem['dmsc_mib']:.0f} MiB{ray}")
    print(f"  ray / local: {up['up_ratio_ray_to_local']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--launcher", choices=("local", "ray"), default="local")
    args = parser.parse_args()
    train_text, valid_text = stdlib_text(max_bytes=400_000)
    corpora = (Corpus(train_text, SPEC.seq, seed=1), Corpus(valid_text, SPEC.seq, seed=2))
    if args.launcher == "ray":
        ray_main(corpora, args.steps, args.json)
        return
    faults = [
        *training_faults(corpora, args.steps),
        *inference_faults(args.requests),
        control_plane_fault(30),
    ]
    late = late_gradients(corpora)
    result = {
        "registry_ttl_s": TTL,
        "faults": [{**f.row(), **f.extra, "fenced": f.fenced} for f in faults],
        "late_gradients": late,
    }
    if args.json:
        print(json.dumps(result))
        return

    _fault_table(faults)
    print("\nlate gradient (2 s late, bound 0.5 s): step time of that step / a typical step")
    for policy, v in late.items():
        print(
            f"  {policy:8} {v['late_step_s']:.2f} s / {v['other_steps_s']:.3f} s, "
            f"skipped {v['skipped']}, restarts {v['restarts']}"
        )


if __name__ == "__main__":
    main()
