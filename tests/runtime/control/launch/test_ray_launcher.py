"""What the Ray launcher asks of a cluster before it reserves anything (issue 29, point 8), with
Ray replaced by a fake that knows the cluster's nodes; a real cluster is started in
tests/integration/test_ray.py."""

from __future__ import annotations

import importlib
import time
from typing import Any

import pytest

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.control.launch import ray_launcher
from dmsc.runtime.control.launch.ray_launcher import RayLauncher


class _Ray:
    """Ray as the launcher sees it: a connected driver and the cluster's alive nodes."""

    def __init__(self, nodes: list[dict[str, float]]) -> None:
        self._nodes = nodes
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: "127.0.0.1")})

    def is_initialized(self) -> bool:
        return True

    def nodes(self) -> list[dict[str, Any]]:
        return [{"Alive": True, "Resources": r} for r in self._nodes]

    def cluster_resources(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self._nodes:
            for k, v in r.items():
                out[k] = out.get(k, 0) + v
        return out

    def available_resources(self) -> dict[str, float]:
        return self.cluster_resources()


def _launcher(monkeypatch: pytest.MonkeyPatch, nodes: list[dict[str, float]]) -> RayLauncher:
    monkeypatch.setattr(ray_launcher, "ray_module", lambda: _Ray(nodes))

    def never(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a placement group was asked for")

    module = importlib.import_module("ray.util.placement_group")  # the function hides it
    monkeypatch.setattr(module, "placement_group", never)
    return RayLauncher(place_timeout_s=60)


def _cfgs(dcs: list[str], device: str = "cpu") -> list[WorkerConfig]:
    return [
        WorkerConfig(
            sid=f"stage{i}-r0",
            stage=i,
            stages=len(dcs),
            model={},
            first="embedding",
            last="head",
            registry="127.0.0.1:1",
            datacenter=dc,
            device=device,
        )
        for i, dc in enumerate(dcs)
    ]


def test_three_stages_on_a_two_cpu_cluster_are_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each stage worker holds a CPU: 3 stages on a cluster of 2 CPUs is refused before any
    placement group waits (it used to wait 60 s, then print Ray's free-resource dict)."""
    launcher = _launcher(monkeypatch, [{"CPU": 2, "dc:dc-0": 8}])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"needs 3 CPUs, the cluster has 2\b"):
        launcher.prepare(_cfgs(["dc-0"] * 3))
    assert time.monotonic() - t0 < 1.0


def test_cuda_stages_count_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher(monkeypatch, [{"CPU": 16, "GPU": 1, "dc:dc-0": 8}])
    with pytest.raises(ValueError, match=r"needs 2 GPUs, the cluster has 1\b"):
        launcher.prepare(_cfgs(["dc-0", "dc-0"], device="cuda:0"))


def test_a_datacenter_whose_nodes_lack_cpus_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough CPUs in the cluster, but not on the nodes of the datacenter the plan puts the
    workers in."""
    launcher = _launcher(monkeypatch, [{"CPU": 1, "dc:dc-0": 8}, {"CPU": 8, "dc:dc-1": 8}])
    with pytest.raises(ValueError, match=r"datacenter dc-0 needs 2 CPUs, its nodes have 1\b"):
        launcher.prepare(_cfgs(["dc-0", "dc-0", "dc-1"]))


def test_datacenters_that_share_nodes_are_counted_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """dc-0 and dc-2 are offered by the same 4-CPU node: 3 workers in each fit neither alone
    nor together (a third node, of dc-1, has CPUs to spare but cannot take them)."""
    nodes: list[dict[str, float]] = [
        {"CPU": 4, "dc:dc-0": 4, "dc:dc-2": 4},
        {"CPU": 4, "dc:dc-1": 4},
    ]
    launcher = _launcher(monkeypatch, nodes)
    with pytest.raises(ValueError, match=r"datacenters dc-0, dc-2 need 6 CPUs, their nodes have 4"):
        launcher.prepare(_cfgs(["dc-0"] * 3 + ["dc-2"] * 3))


def test_a_tensor_parallel_group_is_one_bundle_on_one_node() -> None:
    """tp = 2: each stage's bundle holds both ranks' units (a bundle lies on one node, so the
    group does); they used to get one bundle each under one (stage, replica) key, the second
    rank's overwriting the first's, so both were sent to the same 1-CPU bundle."""
    from dataclasses import replace

    from dmsc.runtime.control.launch.ray_checks import pipeline_bundles

    ranks = [
        replace(c, sid=f"{c.sid}-t{t}", tp=2, tp_rank=t)
        for t in (1, 0)
        for c in _cfgs(["dc-a", "dc-b"])
    ]
    bundles, index = pipeline_bundles(ranks)
    assert bundles == [{"CPU": 2, "dc:dc-a": 2}, {"CPU": 2, "dc:dc-b": 2}]
    assert index == {0: 0, 1: 1}
    assert pipeline_bundles(_cfgs(["dc-a", "dc-a"])) == (
        [{"CPU": 1, "dc:dc-a": 1}] * 2,
        {0: 0, 1: 1},
    )


class _Placing:
    """Ray as ``_place`` sees it: actors launched with their options; the first (in its bundle)
    is not up until a second is out, then ``up_first`` (a launch's index) comes up first."""

    class exceptions:  # ray.exceptions
        RayActorError = RuntimeError

    def __init__(self, up_first: int) -> None:
        self.launched: list[dict[str, Any]] = []
        self.killed: list[int] = []
        self.up_first = up_first  # which launch comes up first, once both are out

    def options(self, **opts: Any) -> Any:
        i = len(self.launched)
        self.launched.append(opts)

        class Actor:
            index = i

            class __ray_ready__:  # an actor's method
                @staticmethod
                def remote() -> int:
                    return i

            @staticmethod
            def remote() -> Any:
                return Actor

        return Actor

    def wait(self, refs: list[int], num_returns: int, timeout: float) -> tuple[list[int], list]:
        if len(self.launched) < 2:  # the bundle's actor alone: not up within the wait
            time.sleep(timeout)
            return [], refs
        return [self.up_first], [r for r in refs if r != self.up_first]

    def get(self, ref: int) -> int:
        return ref

    def kill(self, actor: Any) -> None:
        self.killed.append(actor.index)


@pytest.mark.parametrize("up_first", [0, 1])
def test_a_bundle_slow_to_come_up_gets_a_second_actor_outside_and_the_first_up_is_kept(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, up_first: int
) -> None:
    """The stage's bundle's actor not up within ``bundle_wait_s`` (a node Ray has not yet
    declared dead, or a slow start on a loaded machine): another is placed outside the group
    and the first up is kept, the other killed. Whether the kept one is in its bundle is the
    handle's to say (``in_bundle``), and the log says so only when it is the outside one: tests
    read the log's first warning as "placed outside", and failed on a loaded machine where the
    bundle's own actor came up first after all."""
    launcher = _launcher(monkeypatch, [{"CPU": 2, "dc:dc-0": 2}])
    launcher.place_timeout_s, launcher.bundle_wait_s = 5, 0.05
    fake = _Placing(up_first)
    monkeypatch.setattr(ray_launcher, "ray_module", lambda: fake)
    monkeypatch.setattr(ray_launcher, "_remote_host", lambda: fake)
    launcher.groups[0] = object()  # a placement group, as prepare() reserves it
    launcher._bundles[(0, 0)] = 0
    (cfg,) = _cfgs(["dc-0"])
    with caplog.at_level("WARNING", logger=ray_launcher.log.name):
        actor, in_bundle = launcher._place(cfg, gpu=False)
    assert actor.index == up_first and in_bundle is (up_first == 0)
    bound = ["scheduling_strategy" in opts for opts in fake.launched]
    assert bound == [True, False]  # the bundle's, then one outside the group
    assert fake.killed == [1 - up_first]
    assert "another is placed outside the group" in caplog.text
    assert ("started outside its bundle" in caplog.text) is (up_first == 1)
