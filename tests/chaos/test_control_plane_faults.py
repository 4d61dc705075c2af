"""The control plane under faults, as a user runs it: ``dmsc up`` with a gateway, real
processes on 127.0.0.1, faults injected with real signals."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import httpx
import pytest
from runtime_helpers import dmsc, make_plan, one_box, up_with_gateway

from dmsc.data.db import Database
from dmsc.runtime.transport.authority import Authority, worker_name
from dmsc.runtime.transport.messages import CONTROL_SERVICE
from dmsc.runtime.transport.processes import alive
from dmsc.runtime.transport.rpc import Client

TIMEOUT = "3"  # seconds without a heartbeat before a worker is declared failed
TRAIN_STEPS = 60  # the kill lands after step 5; 60 steps outlast detection and recovery
TRAIN_ARGS = ("--steps", str(TRAIN_STEPS), "--checkpoint-every", "10")


def _db(home: Path) -> Database:
    return Database(f"sqlite:///{home / 'dmsc.sqlite'}")


def _wait(predicate, seconds: float, what: str, every: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_of_the_control_plane_loses_and_repeats_no_step(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    key = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "submit,read").stdout
    auth = {"Authorization": f"Bearer {key.strip()}"}
    base = up_with_gateway(tmp_path, plan, "--failure-timeout", TIMEOUT)
    workers = [s["pid"] for s in json.loads(dmsc(tmp_path, "status", "--json").stdout)["services"]]
    tasks = [{"steps": 30, "checkpoint_every": 5}, {"steps": 5}, {"steps": 5}]
    ids = []
    for body in tasks:
        r = httpx.post(f"{base}/v1/tasks", json=body, headers=auth, timeout=60)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    db = _db(tmp_path)
    # 12 steps or more, and some steps past a checkpoint (every 5): those will run again
    _wait(lambda: (n := len(db.metrics(ids[0]))) >= 12 and n % 5 in (1, 2, 3), 120, "steps", 0.01)
    info = json.loads((tmp_path / "control.json").read_text())
    os.kill(info["pid"], signal.SIGKILL)
    killed = time.time()
    # the killed control plane's workers see it gone and stop (none is left behind)
    _wait(lambda: not any(alive(pid) for pid in workers), 60, "the orphaned workers to stop")
    time.sleep(1)
    newest = db.last_checkpoint(info["run"], ids[0])  # the first task's, before the crash
    assert newest is not None
    redone = len([m for m in db.metrics(ids[0]) if m.step >= newest.step])
    assert redone > 0
    base = up_with_gateway(tmp_path, plan, "--failure-timeout", TIMEOUT)  # the run resumes
    try:

        def finished() -> list[str] | None:
            states = [httpx.get(f"{base}/v1/tasks/{i}", headers=auth).json()["state"] for i in ids]
            return states if all(s in ("done", "failed") for s in states) else None

        assert _wait(finished, 240, "the tasks") == ["done", "done", "done"]
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
    # Every step of every task recorded exactly once, in one unbroken sequence.
    steps = [[m.step for m in db.metrics(i)] for i in ids]
    assert steps[0] == list(range(0, 30))
    assert steps[1] == list(range(30, 35)) and steps[2] == list(range(35, 40))
    assert status["steps"] == 40
    restart = [f for f in status["faults"] if f["kind"] == "control-plane"]
    assert len(restart) == 1 and str(ids[0]) in restart[0]["reason"]
    # the first task went back to a checkpoint at most 5 steps old, not to its start
    assert restart[0]["checkpoint_step"] is not None and restart[0]["checkpoint_step"] >= 10
    assert restart[0]["recovered_at"] - killed < 60
    # the steps done after that checkpoint ran again, and the restart's fault counts them
    assert restart[0]["steps_lost"] == redone
    # every task records the model version it produced, the resumed one too
    versions = {v.task_id: v.step for v in db.versions(info["run"])}
    assert versions == {ids[0]: 30, ids[1]: 35, ids[2]: 40}


def test_inference_survives_a_killed_replica_and_the_replica_is_healed(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, one_box(tmp_path, 4), pp=2, dp=2)
    key = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "infer,read").stdout
    auth = {"Authorization": f"Bearer {key.strip()}"}
    base = up_with_gateway(tmp_path, plan, "--failure-timeout", TIMEOUT)
    try:
        before = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        victim = next(s for s in before["services"] if (s["stage"], s["replica"]) == (1, 0))
        outcomes = []
        for i in range(16):
            if i == 4:
                os.kill(victim["pid"], signal.SIGKILL)
            t0 = time.monotonic()
            r = httpx.post(
                f"{base}/v1/infer",
                json={"prompt": "def ", "tokens": 3, "redundant": i % 2 == 1},
                headers=auth,
                timeout=90,
            )
            outcomes.append((r.status_code, time.monotonic() - t0, r.json()))
        answered = [o for o in outcomes if o[0] == 200]
        # every request answered (the other replica takes over), none near its deadline
        assert len(answered) == len(outcomes), outcomes
        assert max(o[1] for o in outcomes) < 60

        def healed() -> dict | None:  # type: ignore[type-arg]
            now = json.loads(dmsc(tmp_path, "status", "--json").stdout)
            mine = [f for f in now["faults"] if victim["sid"] in f["services"].split(",")]
            return now if mine and mine[-1]["recovered_at"] and not now["replicas_down"] else None

        after = _wait(healed, 60, "the watchdog to heal replica 0")
        new = next(s for s in after["services"] if s["sid"] == victim["sid"])
        assert new["pid"] != victim["pid"] and new["health"] == "ok"
        # and replica 0 serves again
        seen = set()
        for _ in range(6):
            r = httpx.post(
                f"{base}/v1/infer", json={"prompt": "a", "tokens": 1}, headers=auth, timeout=60
            )
            seen.add(r.json()["replica"])
        assert "replica-0" in seen
    finally:
        assert dmsc(tmp_path, "down").returncode == 0


def test_dmsc_chaos_kills_a_worker_and_reports_the_recovery(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    up = dmsc(tmp_path, "up", "--plan", str(plan), "--failure-timeout", TIMEOUT, "--spares", "1")
    assert up.returncode == 0, up.stderr
    try:
        spare = json.loads(dmsc(tmp_path, "status", "--json").stdout)["spares"][0]
        bad = dmsc(tmp_path, "chaos", "--kill-worker", "stage=x")
        assert bad.returncode == 2 and "--kill-worker" in bad.stderr
        bad = dmsc(tmp_path, "chaos", "--kill-worker", "stage=7")
        assert bad.returncode == 2 and "no worker" in bad.stderr
        res = dmsc(tmp_path, "chaos", "--kill-worker", "stage=1", "--watch", "60", "--json")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["recovered"] and out["detected_after_s"] < 3.0
        # the warm spare took stage 1 over, and a new spare was started
        now = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert next(s for s in now["services"] if s["stage"] == 1)["pid"] == spare["pid"]
        _wait(
            lambda: json.loads(dmsc(tmp_path, "status", "--json").stdout)["spares"],
            30,
            "a new spare",
        )
        res = dmsc(tmp_path, "chaos", "--kill-worker", "stage=0", "--freeze", "--json")
        assert res.returncode == 0, res.stderr
        frozen = json.loads(res.stdout)
        assert frozen["recovered"] and frozen["detected_after_s"] < float(TIMEOUT) + 3
        # the thawed instance is fenced: it leaves and only the replacement serves
        _wait(lambda: not alive(frozen["pid"]), 20, "the fenced instance to exit")
        # its certificate (stage 0's SID at epoch 0) is refused by the control plane, credential
        # or not: mutual TLS checks the epoch against the registry's floors
        info = json.loads((tmp_path / "control.json").read_text())
        now = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        sid = next(s["sid"] for s in now["services"] if s["stage"] == 0)
        fenced = Authority.at(tmp_path / "tls").issue(worker_name(sid, 0))
        caller = Client(
            info["address"], CONTROL_SERVICE, timeout_s=10, token=info["token"], leaf=fenced
        )
        with pytest.raises(grpc.RpcError) as err:
            caller.call("Status")
        caller.close()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"{sid} at epoch 0 is fenced" in (err.value.details() or "")
        res = dmsc(tmp_path, "train", "--steps", "2", "--json")
        assert res.returncode == 0, res.stderr
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert all(s["health"] == "ok" for s in status["services"])
        assert len([f for f in status["faults"] if f["kind"] == "worker"]) == 2
    finally:
        assert dmsc(tmp_path, "down").returncode == 0


def test_dmsc_chaos_during_dmsc_train(tmp_path: Path) -> None:
    """The issue's user story: a training task keeps going while `dmsc chaos` kills a worker."""
    import subprocess
    import sys

    plan = make_plan(tmp_path)
    assert dmsc(tmp_path, "up", "--plan", str(plan), "--failure-timeout", TIMEOUT).returncode == 0
    try:
        env = {**os.environ, "DMSC_HOME": str(tmp_path)}
        trainer = subprocess.Popen(
            [*(sys.executable, "-m", "dmsc", "train", "--json"), *TRAIN_ARGS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        db = _db(tmp_path)
        _wait(lambda: db.tasks() and len(db.metrics(db.tasks()[-1].id)) >= 5, 60, "training")
        res = dmsc(tmp_path, "chaos", "--kill-worker", "stage=1", "--watch", "60", "--json")
        assert res.returncode == 0, res.stderr
        chaos = json.loads(res.stdout)
        assert chaos["recovered"] and chaos["detected_after_s"] < 3.0
        assert trainer.poll() is None  # the fault hit the running task
        out, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err
        report = json.loads(out.splitlines()[-1])  # after a JSON line per step
        assert report["steps"] == TRAIN_STEPS and len(report["recoveries"]) == 1
        assert report["steps_lost"] <= 10
        steps = [m.step for m in db.metrics(report["task"])]
        assert steps == list(range(TRAIN_STEPS))
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
