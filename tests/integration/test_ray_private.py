"""``dmsc up --launcher ray`` on a Ray cluster started as a user starts one (``ray start``), and
on the private cluster dmsc starts itself without ``--ray-address`` (issue 29, points 8 and 17).
Everything runs in processes of its own (no ``ray.init`` in this one), on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from runtime_helpers import dmsc, make_plan

from dmsc.runtime.transport.processes import descendants

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _ray_start(out: Path, *args: str) -> Iterator[None]:
    """``ray start ARGS --block``, up once it says so; on exit, it and every process below it
    are stopped (not ``ray stop``: that would stop every Ray process of this user)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with out.open("w") as log:
        proc = subprocess.Popen([RAY, "start", *args, "--block"], stdout=log, stderr=log, env=env)
    try:
        end = time.monotonic() + 180
        while "Ray runtime started" not in out.read_text() and time.monotonic() < end:
            assert proc.poll() is None, out.read_text()
            time.sleep(0.5)
        assert "Ray runtime started" in out.read_text(), out.read_text()
        yield
    finally:
        below = descendants(proc.pid)
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _plan_in(home: Path, dc: str) -> Path:
    plan = make_plan(home, pp=2)
    doc = json.loads(plan.read_text())
    for stage in doc["stages"]:
        stage["datacenter"] = dc
        for rep in stage["replicas"]:
            rep["datacenter"] = dc
    plan.write_text(json.dumps(doc))
    return plan


def test_a_cluster_started_on_loopback_short_of_cpus_then_grown(tmp_path: Path) -> None:
    """A head started as the README says for one machine (``--node-ip-address 127.0.0.1``) with
    1 CPU for a 2-stage plan: ``dmsc up`` is refused at once (it used to wait 60 s and print
    Ray's free-resource dict), exit 2. A node with 2 more CPUs joins; the next ``dmsc up`` of
    the same plan starts, records no "control plane restarted" fault (the failed start made
    its run), and every worker serves on 127.0.0.1 (Ray registers the nodes on the machine's
    address: the workers used to serve there). The control plane's log warns that the cluster
    asks no token and speaks no TLS (issue 33, point 3)."""
    port = _free_port()
    plan = _plan_in(tmp_path, "dc-a")
    temp = Path(tempfile.mkdtemp(prefix="dmsc-t-"))  # short: Ray's socket paths fit 107 bytes
    head = ["--head", "--port", str(port), "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
            "--resources", '{"dc:dc-a": 4}', "--include-dashboard", "false",
            "--temp-dir", str(temp), "--disable-usage-stats"]  # fmt: skip
    up = ["up", "--plan", str(plan), "--launcher", "ray", "--ray-address", f"127.0.0.1:{port}"]
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, temp, ignore_errors=True)
        stack.enter_context(_ray_start(tmp_path / "head.out", *head))
        t0 = time.monotonic()
        res = dmsc(tmp_path, *up)
        assert res.returncode == 2, res.stderr
        assert "the plan needs 2 CPUs, the cluster has 1" in res.stderr
        assert time.monotonic() - t0 < 55  # not the placement groups' 60 s wait
        node = ["--address", f"127.0.0.1:{port}", "--num-cpus", "2",
                "--resources", '{"dc:dc-a": 4}', "--disable-usage-stats"]  # fmt: skip
        with _ray_start(tmp_path / "node.out", *node):
            res = dmsc(tmp_path, *up)
            assert res.returncode == 0, res.stderr
            try:
                status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
            finally:
                assert dmsc(tmp_path, "down").returncode == 0
    assert [s["node"] for s in status["services"]] == ["127.0.0.1", "127.0.0.1"]
    assert all(s["address"].startswith("127.0.0.1:") for s in status["services"])
    assert not status.get("faults"), status["faults"]
    # a cluster started without Ray's token authentication and TLS: the log says what is open
    log = (tmp_path / "logs" / "control.log").read_text()
    assert "RAY_AUTH_MODE is not token" in log and "RAY_USE_TLS is off" in log


def test_without_an_address_dmsc_runs_a_private_cluster_others_cannot_join(
    tmp_path: Path,
) -> None:
    """No ``--ray-address``: dmsc starts its own one-node cluster, on 127.0.0.1, in a folder of
    its own (mode 0700, not /tmp/ray), with token authentication and TLS (issue 33, point 3): a
    client without the token is refused even with the certificate, and a plain or uncertified
    gRPC client is refused at the handshake. The workers serve on 127.0.0.1; the cluster and
    its folder go with ``down``."""
    plan = _plan_in(tmp_path, "dc-a")
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--launcher", "ray")
    assert res.returncode == 0, res.stderr
    try:
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        log = (tmp_path / "logs" / "control.log").read_text()
        line = next(json.loads(x) for x in log.splitlines() if "private Ray cluster" in x)
        root = Path(line["msg"].rsplit(" ", 1)[1])
        assert root.is_dir() and root.stat().st_mode & 0o777 == 0o700
        (port,) = (root / "ray" / "session_latest").glob("gcs_server_port_*")
        gcs = f"127.0.0.1:{port.read_text().strip()}"
        tls = root / "tls"
        assert tls.stat().st_mode & 0o777 == 0o700 and (tls / "ray.key").stat().st_mode & 0o77 == 0
        ca, cert, key = ((tls / n).read_bytes() for n in ("ca.pem", "ray.pem", "ray.key"))

        def ready(channel: grpc.Channel) -> bool:
            try:
                grpc.channel_ready_future(channel).result(timeout=2)
                return True
            except grpc.FutureTimeoutError:
                return False
            finally:
                channel.close()

        assert not ready(grpc.insecure_channel(gcs))  # TLS only
        assert not ready(grpc.secure_channel(gcs, grpc.ssl_channel_credentials(ca)))  # no cert
        assert ready(grpc.secure_channel(gcs, grpc.ssl_channel_credentials(ca, key, cert)))
        # another user's client: Ray's environment variables not inherited, so no token (but,
        # as if it had stolen them, the TLS files: the token still keeps it out)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # reach it on 127.0.0.1, as it serves
        # one try, not Ray's 20 a second apart: refused at once either way (20 s saved)
        env["RAY_gcs_server_port_wait_time_s"] = "1"
        files = {"RAY_TLS_CA_CERT": "ca.pem", "RAY_TLS_SERVER_CERT": "ray.pem",
                 "RAY_TLS_SERVER_KEY": "ray.key"}  # fmt: skip
        env.update({"RAY_USE_TLS": "1"}, **{k: str(tls / v) for k, v in files.items()})
        join = f"import ray; ray.init(address={gcs!r}); print('JOINED')"
        intruder = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True,
                                  text=True, timeout=180)  # fmt: skip
        assert intruder.returncode != 0 and "JOINED" not in intruder.stdout
        assert "Authentication" in intruder.stderr or "auth" in intruder.stderr.lower()
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
    assert [s["node"] for s in status["services"]] == ["127.0.0.1", "127.0.0.1"]
    assert all(s["address"].startswith("127.0.0.1:") for s in status["services"])
    end = time.monotonic() + 30
    while root.exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert not root.exists()
