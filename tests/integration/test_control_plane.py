"""``dmsc up / status / train / infer / down`` as a user runs them: real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

from runtime_helpers import dmsc, make_plan, one_box, up_with_gateway, wait_for

from dmsc.data.control_records import decisions
from dmsc.data.db import Database
from dmsc.runtime.control.client import ControlClient
from dmsc.runtime.transport.messages import InferRequest, ReplanRequest
from dmsc.runtime.transport.replies import InferEnd, InferPiece


def test_up_status_train_infer_down(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    res = dmsc(tmp_path, "status")
    assert res.returncode == 2 and "not running" in res.stderr
    # the tasks' data lies in the test's directory (dmsc up runs in the repository's)
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--data-root", str(tmp_path))
    assert res.returncode == 0, res.stderr
    try:
        assert dmsc(tmp_path, "up", "--plan", str(plan)).returncode == 2  # already running
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert len(status["services"]) == 2
        assert all(s["health"] == "ok" and s["registered"] for s in status["services"])
        # logs a user can find: the control plane's and each worker's, under $DMSC_HOME/logs
        assert "serving at" in (tmp_path / "logs" / "control.log").read_text()
        for s in status["services"]:
            assert (tmp_path / "logs" / f"{s['sid']}.stderr").is_file()
        # the user's own text, a learning-rate schedule, a seed (issue 12, item 4)
        data = tmp_path / "text"
        data.mkdir()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in ("json/decoder.py", "json/encoder.py", "csv.py"):
            (data / name.replace("/", "_")).write_bytes((stdlib / name).read_bytes())
        settings = ["--lr", "3e-3", "--lr-schedule", "cosine", "--warmup", "1", "--seed", "2"]
        res = dmsc(tmp_path, "train", "--steps", "3", "--json", "--data", str(data), *settings)
        assert res.returncode == 0, res.stderr
        *progress, last = [json.loads(line) for line in res.stdout.splitlines()]
        assert [p["step"] for p in progress] == [0, 1, 2]  # a JSON line per step, then the task
        out = last
        assert out["steps"] == 3 and out["model_version"] >= 1
        assert out["val_end"] < out["val_start"] + 0.5
        bad = dmsc(tmp_path, "train", "--steps", "0")
        assert bad.returncode == 2 and "--steps" in bad.stderr
        # data outside the control plane's data roots is refused, naming them and the flag
        elsewhere = Path(__file__)
        bad = dmsc(tmp_path, "train", "--steps", "1", "--data", str(elsewhere))
        assert bad.returncode == 2 and "outside the control plane's data roots" in bad.stderr
        assert str(tmp_path) in bad.stderr and "--data-root" in bad.stderr
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "5")
        assert res.returncode == 0 and res.stdout.startswith("def ")
        # sampling settings; streamed or not, the same seed gives the same text
        seeded = ["--prompt", "def ", "--tokens", "12", "--temperature", "1.5", "--seed", "5"]
        streamed = dmsc(tmp_path, "infer", *seeded)
        whole = dmsc(tmp_path, "infer", *seeded, "--no-stream")
        out = json.loads(dmsc(tmp_path, "infer", *seeded, "--json").stdout)
        assert streamed.stdout == whole.stdout == "def " + out["text"] + "\n"
        assert out["seed"] == 5 and out["replica"] == "replica-0"
        bad = dmsc(tmp_path, "infer", "--prompt", "x", "--top-p", "0")
        assert bad.returncode == 2 and "--top-p" in bad.stderr
        # Ctrl-C on a streamed infer: the generation stops, its task says cancelled
        env = {**os.environ, "DMSC_HOME": str(tmp_path)}
        long = subprocess.Popen(
            [sys.executable, "-m", "dmsc", "infer", "--prompt", "def ", "--tokens", "1000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert long.stdout is not None and long.stdout.read(6).startswith(b"def ")
        long.send_signal(signal.SIGINT)
        _, err = long.communicate(timeout=30)
        assert long.returncode == 130 and b"cancelled after" in err, err
        db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
        deadline = time.monotonic() + 10
        while db.tasks()[-1].state == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert db.tasks()[-1].state == "cancelled"
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "0")
        assert res.returncode == 2 and "tokens" in res.stderr and "Traceback" not in res.stderr
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert [t["state"] for t in status["tasks"]] == ["done"] * 5 + ["cancelled"]
        # pp = 2: the pipeline's waits and sends, measured in each of the 3 steps, in the status
        # and in the train task's result; beside no prediction, as the step's: local-cpu's CPU
        # figures were never measured, so the plan's are guesses (`dmsc calibrate` first)
        (pp,) = status["modes"]
        assert pp["mode"] == "pp" and pp["steps"] == 3 and pp["measured_bytes"] > 0
        assert pp["measured_s"] > 0 and pp["predicted_s"] is None
        assert "device type cpu" in status["modes_prediction"]
        assert "never measured" in status["modes_prediction"]
        assert json.loads(db.tasks()[0].result_json)["modes"] == status["modes"]
        # The train task ran once: the Train call queued it and the queue ran it (it used to run
        # in the call, and the queue once claimed it again after the call released the lock).
        time.sleep(1.0)  # the queue polls every 0.5 s
        db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
        assert [(t.kind, t.state, t.attempts) for t in db.tasks()] == [
            ("train", "done", 1),  # one attempt, as a task the queue claims once counts
            *[("infer", "done", 1)] * 4,
            ("infer", "cancelled", 1),
        ]
        params = json.loads(db.tasks()[0].params_json)
        assert params["data"] == str(data.resolve()) and params["lr_schedule"] == "cosine"
        log = (tmp_path / "logs" / "control.log").read_text().splitlines()
        assert [json.loads(x)["msg"] for x in log].count("task done") == 1
        # the typed client the CLI uses, on the same control plane
        client = ControlClient.connect(tmp_path / "control.json")
        now = client.status()
        assert now.run == status["run"] and [s.health for s in now.services] == ["ok", "ok"]
        req = InferRequest(prompt="def ", tokens=6, temperature=1.5, seed=5)
        whole = client.infer(req)
        *pieces, end = list(client.infer_stream(req))
        assert isinstance(end, InferEnd) and end.seed == whole.seed == 5
        assert "".join(p.text for p in pieces if isinstance(p, InferPiece)) == whole.text
        assert whole.replica == "replica-0" and len(whole.token_ids) == len(end.token_ids)
        dry = client.replan(ReplanRequest(dry_run=True))
        assert dry.run == now.run and dry.dry_run and dry.decide_s is not None
        client.close()
    finally:
        res = dmsc(tmp_path, "down")
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "control.json").exists()
    assert (tmp_path / "dmsc.sqlite").exists()


def test_up_with_a_bad_plan(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("{}")
    res = dmsc(tmp_path, "up", "--plan", str(bad))
    assert res.returncode == 2 and "not a dmsc plan" in res.stderr
    res = dmsc(tmp_path, "up", "--plan", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "no such file" in res.stderr


def test_a_worker_that_cannot_start_shows_its_last_log_lines(tmp_path: Path) -> None:
    """``dmsc up`` when a stage worker dies at start: the error names the worker and shows the
    end of its standard error, and nothing is left running. The failure is injected at the start
    of a fresh interpreter (``DMSC_WORKER_START=exec``); a forked worker's failed start is
    tests/runtime/control/launch/test_launchers.py's."""
    plan = make_plan(tmp_path)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(  # runs in every Python process started below
        "import os, sys\n"
        "if '--config' in sys.argv:  # a stage worker\n"
        "    sys.stderr.write('injected: no accelerator driver\\n'); sys.stderr.flush()\n"
        "    os._exit(7)\n"
    )
    path = os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, "-m", "dmsc", "up", "--plan", str(plan)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "DMSC_HOME": str(tmp_path),
            "PYTHONPATH": path,
            "DMSC_WORKER_START": "exec",
        },
    )
    assert res.returncode == 2, res.stderr
    assert "the control plane failed to start" in res.stderr
    assert "failed to start; its last log lines" in res.stderr
    assert "injected: no accelerator driver" in res.stderr
    assert str(tmp_path / "logs") in res.stderr
    assert not (tmp_path / "control.json").exists()


def test_gateway_in_front_of_a_live_deployment(tmp_path: Path) -> None:
    import time

    import httpx

    plan = make_plan(tmp_path)
    key = dmsc(
        tmp_path, "token", "create", "--tenant", "alice", "--scopes", "infer,submit,read",
        "--weight", "2",
    ).stdout.strip()  # fmt: skip
    assert key.startswith("dmsc_")
    # the control loop ticks every 0.3 s with an objective every step breaks (judged from the
    # third step: the task below trains 3), and posts its alerts to a webhook served here
    hook, posted = _webhook()
    loop = ["--control-interval", "0.3", "--slo", "step_time_s=0.001", "--alert-webhook", hook]
    base = up_with_gateway(tmp_path, plan, "--queue", "fair", *loop)
    auth = {"Authorization": f"Bearer {key}"}
    try:
        # the policy the consumers claim in, as `dmsc up --queue` set it; the loop (act: the
        # default)
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert status["queue"] == "fair"
        assert (status["control"]["interval_s"], status["control"]["mode"]) == (0.3, "act")
        assert (
            httpx.post(f"{base}/v1/infer", json={"prompt": "def ", "tokens": 4}).status_code == 401
        )
        r = httpx.post(
            f"{base}/v1/infer", json={"prompt": "def ", "tokens": 4}, headers=auth, timeout=60
        )
        assert r.status_code == 200 and len(r.json()["text"]) >= 1
        r = httpx.post(f"{base}/v1/tasks", json={"steps": 3, "priority": 3}, headers=auth)
        assert r.status_code == 202
        task_id = r.json()["id"]
        state = "queued"
        for _ in range(120):
            state = httpx.get(f"{base}/v1/tasks/{task_id}", headers=auth).json()["state"]
            if state in ("done", "failed"):
                break
            time.sleep(0.5)
        assert state == "done"
        assert "dmsc_gateway_requests_total" in httpx.get(f"{base}/metrics").text
        # the loop: an alert on the task's slow steps (GET /v1/alerts, alice's own task shown),
        # its exception, one decision row and one control-log line, the webhook's post
        assert httpx.get(f"{base}/v1/alerts").status_code == 401
        alerts = wait_for(
            lambda: httpx.get(f"{base}/v1/alerts", headers=auth).json(), 30, "an alert"
        )
        (alert,) = [a for a in alerts if a["slo"] == "step_time_s"]
        assert alert["task"] == task_id and alert["value"] > 0.001 and alert["objective"] == 0.001
        db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
        (row,) = [d for d in decisions(db, alert["run"]) if d.target == "slo:step_time_s"]
        assert row.verdict == "raise" and row.outcome == f"raised: task {alert['exception_task']}"
        log = (tmp_path / "logs" / "control.log").read_text()
        assert log.count(f"control decision {row.id}: raise") == 1
        wait_for(lambda: posted, 30, "the webhook's post")
        assert posted[0]["alert"]["id"] == alert["id"]
        # a worker's standard error shows it ran out of memory: an alert from the logs
        sid = status["services"][0]["sid"]
        with (tmp_path / "logs" / f"{sid}.stderr").open("a") as f:
            f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")

        def oom() -> list[dict[str, Any]]:
            got = httpx.get(f"{base}/v1/alerts", headers=auth).json()
            return [a for a in got if a["slo"] == "log:out-of-memory"]

        (alert,) = wait_for(oom, 30, "the log's alert")
        assert alert["reason"].startswith(f"1 log line of {sid} showed out of memory: torch.")
        wait_for(lambda: len(posted) > 1, 30, "its webhook post")
        # a worker killed between tasks: the runtime replaces it, the loop alerts on it
        killed = dmsc(tmp_path, "chaos", "--kill-worker", "stage=1", "--watch", "60", "--json")
        assert killed.returncode == 0, killed.stderr

        def lost() -> list[dict[str, Any]]:
            got = httpx.get(f"{base}/v1/alerts", headers=auth).json()
            return [a for a in got if a["slo"] == "fault:worker"]

        (alert,) = wait_for(lost, 30, "the lost worker's alert")
        assert "lost and replaced" in alert["reason"] and alert["resolved_at"] is not None
        assert "recovered by the runtime in" in alert["reason"] and alert["value"] > 0
        wait_for(lambda: any(p["alert"]["id"] == alert["id"] for p in posted), 30, "its post")
    finally:
        assert dmsc(tmp_path, "down").returncode == 0


def _webhook() -> tuple[str, list[dict[str, Any]]]:
    """A webhook on 127.0.0.1 (its URL) and the bodies posted to it (a daemon thread serves it
    until the test process ends)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    posted: list[dict[str, Any]] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/hook", posted


def test_gray_release_sends_the_canary_share_to_the_canary_replica(tmp_path: Path) -> None:

    import httpx

    plan = make_plan(tmp_path, one_box(tmp_path, 2), pp=1, dp=2)
    key = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "infer").stdout.strip()
    base, auth = up_with_gateway(tmp_path, plan), {"Authorization": f"Bearer {key}"}
    try:
        v1, v2 = (
            json.loads(dmsc(tmp_path, "train", "--steps", "1", "--json").stdout.splitlines()[-1])[
                "model_version"
            ]
            for _ in range(2)
        )
        assert dmsc(tmp_path, "models", "promote", str(v1)).returncode == 0
        assert dmsc(tmp_path, "models", "canary", str(v2), "--percent", "50").returncode == 0
        # The control plane loads the versions into the replicas (between tasks, drained one at
        # a time): wait for both, as the database records them, rather than for a fixed time.
        from dmsc.runtime.control.serving.held import holding

        db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")

        def loaded() -> bool:
            held = holding(db)
            return (
                "replica-0" in held
                and "replica-1" in held
                and {held["replica-0"].version, held["replica-1"].version} == {v1, v2}
            )

        wait_for(loaded, 60, "the replicas to load the production and canary versions")
        seen: dict[int, set[str]] = {}
        for i in range(30):
            r = httpx.post(
                f"{base}/v1/infer",
                json={"prompt": "a", "tokens": 1, "session": f"user-{i}"},
                headers=auth,
                timeout=60,
            ).json()
            seen.setdefault(r["model_version"], set()).add(r["replica"])
        assert set(seen) == {v1, v2}
        assert seen[v2] == {"replica-1"} and seen[v1] == {"replica-0"}
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
