"""How the local Ray cluster starts (``dmsc.testing.ray_local``), with Ray's ``Cluster``
replaced by a recording fake; the real cluster is started in tests/integration/test_ray.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import ray.cluster_utils

from dmsc.runtime.control.launch import ray_private
from dmsc.runtime.transport import processes
from dmsc.testing import ray_local


class _Cluster:
    """Records what Ray would be asked; ``fail`` makes the head's start fail as a head does
    when its GCS server never publishes its port."""

    made: ClassVar[list[_Cluster]] = []
    fail: ClassVar[bool] = False
    late: ClassVar[list[bool]] = []  # by start (head or node): times out as Ray's wait does
    strays: ClassVar[list[subprocess.Popen[bytes]]] = []
    stray_pids: ClassVar[list[int]] = []  # the strays and the processes below them

    def __init__(self, initialize_head: bool, head_node_args: dict[str, Any]) -> None:
        self.head_args = head_node_args
        self.gcs_wait = os.environ.get(ray_local.GCS_WAIT_ENV)
        self.waits: list[float] = []
        self.stopped = False
        self.address = "127.0.0.1:1"
        self.connected = False
        _Cluster.made.append(self)
        if _Cluster.fail:
            raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1")
        _Cluster._maybe_late()

    @staticmethod
    def _maybe_late() -> None:
        """A start that spawned its processes (a child here, with one of its own below) and
        then gave up on the registration, with Ray's words."""
        if _Cluster.late and _Cluster.late.pop(0):
            stray = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
            while len(tree := processes.descendants(stray.pid)) < 2:  # its child started
                pass
            _Cluster.stray_pids += tree
            _Cluster.strays.append(stray)
            raise Exception(  # what ray/_private/node.py raises
                "The current node timed out during startup. This could happen because some of "
                "the raylet failed to startup or the GCS has become overloaded."
            )

    def wait_for_nodes(self, timeout: float = 30) -> None:
        self.waits.append(timeout)

    def add_node(self, wait: bool = True, **kwargs: Any) -> dict[str, Any]:
        assert not wait  # waited for by wait_for_nodes, with the longer timeout
        _Cluster._maybe_late()
        return kwargs

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> type[_Cluster]:
    _Cluster.made, _Cluster.fail, _Cluster.late, _Cluster.strays = [], False, [], []
    _Cluster.stray_pids = []
    monkeypatch.setattr(ray.cluster_utils, "Cluster", _Cluster)
    monkeypatch.setattr(ray, "init", lambda **_kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.delenv(ray_local.GCS_WAIT_ENV, raising=False)
    return _Cluster


def test_the_head_and_every_node_get_the_longer_start_wait(fake_ray: type[_Cluster]) -> None:
    """A head that starts in over 30 s on a busy machine (Ray's default wait for its GCS server's
    port and for a node to register) still starts: Ray is given START_WAIT_S for both."""
    with ray_local.local_cluster({"dc:dc-0": 4}, [{"dc:dc-1": 4}]) as c:
        assert c.gcs_wait == str(ray_local.START_WAIT_S)
        assert c.head_args["wait"] is False
        assert c.waits == [ray_local.START_WAIT_S, ray_local.START_WAIT_S]
    assert ray_local.GCS_WAIT_ENV not in os.environ  # put back as it was


def test_the_cluster_stays_on_loopback_whenever_ray_was_imported(
    fake_ray: type[_Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray was imported (by this module) before the loopback setting: the head must still be
    reached on 127.0.0.1, not on the machine's address (CI: ``ray.init`` timed out on
    192.0.2.2 after another test had imported Ray first)."""
    from ray._private import ray_constants, services

    monkeypatch.delenv(ray_local.LOOPBACK_ENV, raising=False)
    assert ray_constants.ENABLE_RAY_CLUSTER  # as read at import, without the setting
    with ray_local.local_cluster({"dc:dc-0": 4}, []):
        assert services.get_node_ip_address() == "127.0.0.1"  # type: ignore[no-untyped-call]
        assert os.environ[ray_local.LOOPBACK_ENV] == "0"  # for the processes Ray starts
    assert ray_constants.ENABLE_RAY_CLUSTER
    assert ray_local.LOOPBACK_ENV not in os.environ


def test_an_operators_own_wait_is_kept(
    fake_ray: type[_Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_local.GCS_WAIT_ENV, "300")
    with ray_local.local_cluster({"dc:dc-0": 4}, []) as c:
        assert c.gcs_wait == "300"
    assert os.environ[ray_local.GCS_WAIT_ENV] == "300"


def test_a_head_that_does_not_start_says_why_with_its_log(
    fake_ray: type[_Cluster], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "gcs_server.err").write_text("first\nbind: Address already in use\n")
    tail = ray_local.gcs_log_tail
    monkeypatch.setattr(ray_local, "gcs_log_tail", lambda: tail(root=tmp_path))
    fake_ray.fail = True
    with (
        pytest.raises(RuntimeError, match="did not start") as e,
        ray_local.local_cluster({"dc:dc-0": 4}, []),
    ):
        pass
    assert "Address already in use" in str(e.value)
    assert "gcs_server_port_1" in str(e.value)


def test_the_log_tail_names_a_missing_log(tmp_path: Path) -> None:
    assert "no GCS server log" in ray_local.gcs_log_tail(root=tmp_path)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not gone, not a zombie), within 10 s."""
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(100):
        try:
            if stat.read_text().rsplit(") ", 1)[1].split()[0] == "Z":
                return False
        except OSError:
            return False
        time.sleep(0.1)
    return True


def _gone(p: subprocess.Popen[bytes]) -> bool:
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_a_node_that_misses_rays_registration_wait_is_killed_and_started_again(
    fake_ray: type[_Cluster],
) -> None:
    """CI: a head on a busy machine missed Ray's fixed 30 s registration wait and the test
    failed before it began. The head and a node each time out once here: both are started
    again, and the processes of the failed tries (and those below them) are gone."""
    fake_ray.late = [True, False, True]  # the head's first try, then the node's
    seen = set(processes.children(os.getpid()))
    with ray_local.local_cluster({"dc:dc-0": 4}, [{"dc:dc-1": 4}]) as c:
        assert len(fake_ray.made) == 2  # the head, tried twice
        assert c.waits == [ray_local.START_WAIT_S, ray_local.START_WAIT_S]
    assert len(fake_ray.strays) == 2
    assert all(_gone(p) and p.returncode == -9 for p in fake_ray.strays)
    assert not [p for p in fake_ray.stray_pids if _running(p)]  # those below them too
    assert set(processes.children(os.getpid())) <= seen


def test_a_head_that_keeps_missing_the_wait_fails_with_its_log(
    fake_ray: type[_Cluster],
) -> None:
    fake_ray.late = [True] * ray_private.START_TRIES
    with (
        pytest.raises(RuntimeError, match=r"did not start.*timed out during startup"),
        ray_local.local_cluster({"dc:dc-0": 4}, []),
    ):
        pass
    assert len(fake_ray.made) == ray_private.START_TRIES
    assert all(_gone(p) for p in fake_ray.strays[:-1])
    # the last try's is left to the caller's shutdown, as before: killed here, with the sleep
    # below its shell (killing the shell alone left that sleep running for a minute after the
    # suite, where benchmarks/readme_commands.py found it)
    last = fake_ray.strays[-1]
    for pid in processes.descendants(last.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    last.wait(timeout=10)


class _Info:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process


class _Node:
    def __init__(self, node_id: str, raylet: subprocess.Popen[bytes]) -> None:
        self.node_id = node_id
        self.all_processes = {"raylet": [_Info(raylet)]}


def test_a_node_lost_by_itself_is_named_with_how_its_raylet_ended() -> None:
    """CI once saw a dc-0 raylet ended by a SIGKILL from outside the test before the test did
    anything; the test could not tell that from its own fault. A node whose raylet has exited
    while still one of the cluster's is named, with the signal; a running one is not, and a
    node removed on purpose is no longer the cluster's."""
    alive = subprocess.Popen(["sleep", "30"])
    killed = subprocess.Popen(["sleep", "30"])
    try:
        killed.kill()
        killed.wait(timeout=10)
        c = type("C", (), {"head_node": _Node("head", alive), "worker_nodes": []})()
        assert ray_local.lost_by_itself(c) == []
        c.worker_nodes = [_Node("n1", killed)]
        assert ray_local.lost_by_itself(c) == [f"node n1: raylet pid {killed.pid} exited with -9"]
        c.worker_nodes = []  # what Cluster.remove_node does with it
        assert ray_local.lost_by_itself(c) == []
    finally:
        alive.kill()
        alive.wait(timeout=10)
