"""``dmsc up / status / train / infer / down`` as a user runs them: real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dmsc(home: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DMSC_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "dmsc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def make_plan(home: Path, cluster: Path | None = None, pp: int = 2, dp: int = 1) -> Path:
    plan = home / "plan.json"
    res = dmsc(
        home,
        "plan",
        "--cluster",
        str(cluster or ROOT / "examples/clusters/local-cpu.yaml"),
        "--model",
        "gpt-mini",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--tp",
        "1",
        "--pp",
        str(pp),
        "--dp",
        str(dp),
        "--out",
        str(plan),
    )
    assert res.returncode == 0, res.stderr
    return plan


def test_up_status_train_infer_down(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    res = dmsc(tmp_path, "status")
    assert res.returncode == 2 and "not running" in res.stderr
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        assert dmsc(tmp_path, "up", "--plan", str(plan)).returncode == 2  # already running
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert len(status["services"]) == 2
        assert all(s["health"] == "ok" and s["registered"] for s in status["services"])
        res = dmsc(tmp_path, "train", "--steps", "3", "--json")
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["steps"] == 3 and out["model_version"] >= 1
        assert out["val_end"] < out["val_start"] + 0.5
        bad = dmsc(tmp_path, "train", "--steps", "0")
        assert bad.returncode == 2 and "--steps" in bad.stderr
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "5")
        assert res.returncode == 0 and res.stdout.startswith("def ")
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "0")
        assert res.returncode == 2 and "tokens" in res.stderr and "Traceback" not in res.stderr
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert [t["state"] for t in status["tasks"]] == ["done", "done"]
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


def test_gateway_in_front_of_a_live_deployment(tmp_path: Path) -> None:
    import socket
    import time

    import httpx

    plan = make_plan(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = dmsc(
        tmp_path, "token", "create", "--tenant", "alice", "--scopes", "infer,submit,read"
    ).stdout.strip()
    assert key.startswith("dmsc_")
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}")
    assert res.returncode == 0, res.stderr
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    try:
        for _ in range(50):
            try:
                if httpx.get(f"{base}/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert (
            httpx.post(f"{base}/v1/infer", json={"prompt": "def ", "tokens": 4}).status_code == 401
        )
        r = httpx.post(
            f"{base}/v1/infer", json={"prompt": "def ", "tokens": 4}, headers=auth, timeout=60
        )
        assert r.status_code == 200 and len(r.json()["text"]) >= 1
        r = httpx.post(f"{base}/v1/tasks", json={"steps": 2, "priority": 3}, headers=auth)
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
    finally:
        assert dmsc(tmp_path, "down").returncode == 0


def test_a_restarted_control_plane_loses_no_queued_task(tmp_path: Path) -> None:
    import signal
    import socket
    import time

    import httpx

    plan = make_plan(tmp_path)
    key = dmsc(
        tmp_path, "token", "create", "--tenant", "t", "--scopes", "submit,read"
    ).stdout.strip()
    auth = {"Authorization": f"Bearer {key}"}

    def up() -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        res = dmsc(tmp_path, "up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}")
        assert res.returncode == 0, res.stderr
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{base}/v1/health")
                return base
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("gateway did not come up")

    base = up()
    ids = []
    for _ in range(3):
        r = httpx.post(f"{base}/v1/tasks", json={"steps": 20}, headers=auth, timeout=60)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    for _ in range(100):  # wait until the first task runs, then kill the control plane
        if httpx.get(f"{base}/v1/tasks/{ids[0]}", headers=auth).json()["state"] == "running":
            break
        time.sleep(0.1)
    pid = json.loads((tmp_path / "control.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(1)
    base = up()  # the stale control file is noticed; the run resumes
    try:
        states: list[str] = []
        for _ in range(240):
            states = [httpx.get(f"{base}/v1/tasks/{i}", headers=auth).json()["state"] for i in ids]
            if all(s in ("done", "failed") for s in states):
                break
            time.sleep(0.5)
        assert states == ["done", "done", "done"]
    finally:
        assert dmsc(tmp_path, "down").returncode == 0


def test_gray_release_sends_the_canary_share_to_the_canary_replica(tmp_path: Path) -> None:
    import socket
    import time

    import httpx

    cluster = tmp_path / "one-box.yaml"  # two replicas need two devices in one datacenter
    cluster.write_text(
        "device_types: {cpu: {peak_tflops: {fp32: 0.1}, memory_gib: 4, memory_bw_gbyte_s: 10}}\n"
        "node_types: {host: {device: cpu, devices: 2, link: {bandwidth_gbit_s: 10}}}\n"
        "datacenters: [{name: dc, nodes: [{type: host, count: 1}],\n"
        "               network: {gbit_s_per_node: 10}}]\n"
    )
    plan = make_plan(tmp_path, cluster, pp=1, dp=2)
    key = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "infer").stdout.strip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert (
        dmsc(tmp_path, "up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}").returncode == 0
    )
    base, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    try:
        v1 = json.loads(dmsc(tmp_path, "train", "--steps", "1", "--json").stdout)["model_version"]
        v2 = json.loads(dmsc(tmp_path, "train", "--steps", "1", "--json").stdout)["model_version"]
        assert dmsc(tmp_path, "models", "promote", str(v1)).returncode == 0
        assert dmsc(tmp_path, "models", "canary", str(v2), "--percent", "50").returncode == 0
        time.sleep(2)  # the control plane loads the versions into the replicas
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
