"""Stage workers on a Ray cluster (issue 15): a local cluster of a head and one more node
process, each a datacenter (``dc:dc-0``, ``dc:dc-1``), all on 127.0.0.1, started and stopped by
this module."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES
from runtime_helpers import dmsc, make_plan, reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.launchers import WorkerStartError
from dmsc.runtime.control.launch.ray_launcher import RayLauncher, RayProcess
from dmsc.runtime.control.loop.snapshot import capacity
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.serving.elastic import ServingPool
from dmsc.runtime.transport.messages import TrainRequest
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model
from dmsc.testing.chaos import train_under_fault
from dmsc.testing.ray_local import (
    add_node,
    live_nodes,
    local_cluster,
    lost_by_itself,
    train_through_node_fault,
)

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)
RANGES = [("embedding", "block_1"), ("block_2", "head")]
# pp=2 x dp=2 across two datacenters: stage 0 in dc-0, stage 1 in dc-1
DCS = {(s, r): f"dc-{s}" for s in range(2) for r in range(2)}
STEPS, BATCH, MICRO = 8, 8, 2  # MICRO per replica: 4 micro-batches in all; a step after the kill
NODE_STEPS = 6  # the steps of a node-fault test
# One process of `pytest -n 2 --dist loadgroup` runs every test of this module (conftest's
# ONE_PROCESS): one cluster for them all rather than one per process.


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A cluster for this module's tests (``pytestmark`` keeps them on one test process): the
    head offers dc-0 and dc-2, one more node dc-1; a node that stops answering is declared dead
    in about 1.5 s."""
    head = {"dc:dc-0": 4, "dc:dc-2": 4}
    with local_cluster(head, [{"dc:dc-1": 4}]) as c:
        yield c


@pytest.fixture(autouse=True)
def _said_when_a_node_is_lost_by_itself(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the module's cluster: a warning (in the failure report's captured
    log) naming any node whose raylet ended though no test removed it, with its exit code, so
    that a failure it causes here or in a later test says so (CI once saw a raylet of another
    test's cluster SIGKILLed from outside)."""
    yield
    if "cluster" in request.fixturenames:
        gone = lost_by_itself(request.getfixturevalue("cluster"))
        if gone:
            logging.getLogger(__name__).warning("a node was lost by itself: %s", gone)


@pytest.fixture(scope="module")
def corpora() -> tuple[Corpus, Corpus]:
    train_text, valid_text = stdlib_text(max_bytes=200_000)
    return Corpus(train_text, SPEC.seq, seed=1), Corpus(valid_text, SPEC.seq, seed=2)


@pytest.fixture(scope="module")
def node_fault_losses(corpora: tuple[Corpus, Corpus]) -> list[float]:
    """Single-process training's losses for the node-fault tests: NODE_STEPS steps of batch
    BATCH in 2 micro-batches (computed once: tens of seconds on a loaded machine)."""
    train_c, _ = corpora
    batches = [train_c.batch(s, BATCH) for s in range(NODE_STEPS)]
    return reference_losses(SPEC, 0, 1e-3, batches, 2)


def test_a_plan_across_two_ray_nodes_trains_as_one_process_through_a_killed_worker(
    cluster: Any, corpora: Any, tmp_path: Path
) -> None:
    """pp=2 x dp=2, stage 0 on the head (dc-0) and stage 1 on the other node (dc-1), each
    pipeline reserved as a placement group, with a warm spare in each datacenter. A worker of
    dc-1 killed (kill -9) while a step runs is seen at once, taken over by the dc-1 spare, and the
    run goes back to its checkpoint: the losses are those of single-process training."""
    import ray
    from ray.util import placement_group_table

    train_c, valid_c = corpora
    want = reference_losses(SPEC, 0, 1e-3, [train_c.batch(s, BATCH) for s in range(STEPS)], 4)
    layout = StageLayout(SPEC, RANGES, replicas=2, datacenters=DCS)
    launcher = RayLauncher(home=tmp_path)
    placed: dict[str, set[str]] = {}
    started: list[tuple[str, str]] = []
    groups: dict[int, dict[int, str]] = {}  # replica -> bundle index -> node
    real_start = launcher.start

    def start(cfg: Any, workdir: Path) -> Any:
        started.append((cfg.sid, cfg.datacenter))  # asked for, even if it then fails to start
        h = real_start(cfg, workdir)
        assert isinstance(h.process, RayProcess)
        placed.setdefault(cfg.datacenter, set()).add(h.process.node)
        for r, pg in launcher.groups.items():
            groups[r] = placement_group_table(pg)["bundles_to_node_id"]
        return h

    launcher.start = start  # type: ignore[method-assign]
    report, fr = train_under_fault(
        layout, train_c, valid_c, STEPS, BATCH, MICRO, "kill", stage=1, replica=1, at_step=6,
        checkpoint_every=4, launcher=launcher, spares=2,
    )  # fmt: skip
    assert len(report.recoveries) == 1 and report.recoveries[0].failed == ["stage1-r1"]
    assert max(abs(a - b) for a, b in zip(report.losses, want, strict=True)) < 1e-5
    assert fr.detected_after_s is not None and fr.detected_after_s < 3.0
    # each datacenter's workers (spares too) ran on that datacenter's node only
    heads = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("dc:dc-0")}
    assert len(placed["dc-0"]) == len(placed["dc-1"]) == 1
    assert placed["dc-0"] <= heads and not placed["dc-1"] & heads
    # the dc-1 spare took the stage over (no new stage1-r1 process); its refill was asked of
    # dc-1 (on a loaded machine it may not be up before the deployment stops)
    stages = sorted(sid for sid, _ in started if not sid.startswith("spare"))
    assert stages == ["stage0-r0", "stage0-r1", "stage1-r0", "stage1-r1"]
    spares = [(sid, dc) for sid, dc in started if sid.startswith("spare")]
    assert sorted(dc for _, dc in spares[:2]) == ["dc-0", "dc-1"] and spares[2:] == [
        ("spare-3", "dc-1")
    ]
    # one placement group per pipeline: stage 0's bundle on the head, stage 1's on the other
    assert sorted(groups) == [0, 1]
    for bundles in groups.values():
        assert bundles[0] in heads and bundles[1] in placed["dc-1"]
    assert not launcher.groups  # given back with the deployment
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())


def test_a_datacenter_no_node_offers_is_refused_before_anything_starts(
    cluster: Any, tmp_path: Path
) -> None:
    layout = StageLayout(SPEC, RANGES, datacenters={(0, 0): "dc-0", (1, 0): "dc-9"})
    dep = Deployment(layout, launcher=RayLauncher(home=tmp_path), home=tmp_path)
    try:
        with pytest.raises(ValueError, match=r"lacks dc:dc-9 \(the plan puts 1 worker"):
            dep.start()
        assert not dep.handles
    finally:
        dep.shutdown()


def test_pipelines_the_cluster_lacks_cpus_for_are_refused_at_once(
    cluster: Any, tmp_path: Path
) -> None:
    """Three pipelines of two stages on the head (dc-0 and dc-2 have 4 units each, but the head
    has 4 CPUs): refused before any placement group is asked for, naming what is short."""
    dcs = {(s, r): ("dc-0", "dc-2")[s] for s in range(2) for r in range(3)}
    layout = StageLayout(SPEC, RANGES, replicas=3, datacenters=dcs)
    launcher = RayLauncher(home=tmp_path, place_timeout_s=60)
    dep = Deployment(layout, launcher=launcher, home=tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match=r"datacenters dc-0, dc-2 need 6 CPUs, their nodes "
                           r"have 4"):  # fmt: skip
            dep.start()
        assert time.monotonic() - t0 < 10  # not the 60 s a placement group would wait
        assert not dep.handles and not launcher.groups
    finally:
        dep.shutdown()


def test_a_pipeline_whose_cpus_others_hold_is_refused_whole_after_the_wait(
    cluster: Any, tmp_path: Path
) -> None:
    """The cluster has the CPUs, but another job holds them: the placement group waits
    ``place_timeout_s``, then the start fails saying what the pipeline needs and what is free;
    nothing starts, and the groups reserved are given back."""
    import ray
    from ray.util import placement_group_table

    from dmsc.runtime.control.launch.ray_launcher import _remote_host

    holder = _remote_host().options(num_cpus=3, resources={"dc:dc-0": 1}).remote()
    ray.get(holder.__ray_ready__.remote(), timeout=60)  # 3 of the head's 4 CPUs held
    layout = StageLayout(SPEC, RANGES, datacenters={(0, 0): "dc-0", (1, 0): "dc-2"})
    launcher = RayLauncher(home=tmp_path, place_timeout_s=3)
    dep = Deployment(layout, launcher=launcher, home=tmp_path)
    try:
        want = r"could not reserve pipeline replica 0 within 3 s: its 2 stages need 2 CPU, "
        with pytest.raises(WorkerStartError, match=want + r".*free there now: 1 CPU"):
            dep.start()
        assert not dep.handles and not launcher.groups
        assert all(g["state"] == "REMOVED" for g in placement_group_table().values())
    finally:
        dep.shutdown()
        ray.kill(holder)


def test_a_worker_that_cannot_start_on_its_node_says_why(cluster: Any, tmp_path: Path) -> None:
    bad = SPEC.model_copy(update={"vocab": 0})
    layout = StageLayout(bad, RANGES, datacenters={(0, 0): "dc-0", (1, 0): "dc-1"})
    dep = Deployment(layout, launcher=RayLauncher(home=tmp_path), home=tmp_path)
    try:
        with pytest.raises(WorkerStartError, match=r"worker stage\d-r0 failed to start"):
            dep.start()
    finally:
        dep.shutdown()


def test_a_replacement_whose_bundle_stays_held_goes_to_another_node_of_its_datacenter(
    cluster: Any, tmp_path: Path
) -> None:
    """A stage's bundle held past ``bundle_wait_s`` (as by an instance on a partitioned node
    that Ray has not yet declared dead): its replacement is placed outside the placement group,
    on a node of the same datacenter, rather than waiting for Ray's health check."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dmsc.runtime.control.launch.ray_launcher import _remote_host

    layout = StageLayout(SPEC, RANGES, datacenters={(0, 0): "dc-0", (1, 0): "dc-1"})
    launcher = RayLauncher(home=tmp_path, bundle_wait_s=1.0)
    dep = Deployment(layout, launcher=launcher, home=tmp_path)
    try:
        cfg = dep.config(1, 0)
        launcher.prepare([dep.config(0, 0), cfg])
        pg = launcher.groups[0]
        holder = _remote_host().options(
            num_cpus=1, resources={"dc:dc-1": 1},
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 1),
        ).remote()  # fmt: skip
        ray.get(holder.__ray_ready__.remote(), timeout=30)
        h = launcher.start(cfg, tmp_path)
        try:
            dc1 = {n.node_id for n in live_nodes(cluster, "dc:dc-1")}
            assert h.process.node in dc1  # type: ignore[attr-defined]
            assert h.process.in_bundle is False  # type: ignore[attr-defined]
        finally:
            launcher.stop(h)
            ray.kill(holder)
    finally:
        dep.shutdown()


def test_dmsc_up_with_the_ray_launcher_as_a_user_runs_it(cluster: Any, tmp_path: Path) -> None:
    """``dmsc plan --tp 2 --pp 2`` on two datacenters, ``dmsc up --launcher ray
    --ray-address``: each stage's two ranks share one placement-group bundle (one node) of its
    datacenter, ``status`` names each one's node, a worker killed by ``dmsc chaos`` is
    recovered, training and inference run as on one machine, ``down`` leaves no worker behind.
    Both ranks of a stage used to be sent to one 1-CPU bundle: the second waited 10 s for room,
    then was placed outside the group, on any node."""
    plan = tmp_path / "plan.json"
    res = dmsc(tmp_path, "plan", "--cluster", str(EXAMPLES / "two-sites-cpu.yaml"),
               "--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2",
               "--tp", "2", "--pp", "2", "--dp", "1", "--out", str(plan))  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(plan.read_text())
    for stage in doc["stages"]:  # the Ray cluster's datacenters
        for rep in stage["replicas"]:
            rep["datacenter"] = f"dc-{stage['index']}"
    plan.write_text(json.dumps(doc))
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--launcher", "ray",
               "--ray-address", cluster.address)  # fmt: skip
    assert res.returncode == 0, res.stderr
    try:
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert len(status["services"]) == 4
        assert all(s["health"] == "ok" for s in status["services"])
        assert [s["node"] for s in status["services"]] == ["127.0.0.1"] * 4
        # each worker's memory, and the node's totals under the Ray node's name
        assert all(s["rss_bytes"] > 50 << 20 for s in status["services"])
        assert [(n["node"], n["workers"]) for n in status["nodes"]] == [("127.0.0.1", 4)]
        # `dmsc chaos` reaches the worker through the control plane's launcher (Ray)
        res = dmsc(tmp_path, "chaos", "--kill-worker", "stage=1", "--watch", "60", "--json")
        assert res.returncode == 0, res.stderr
        chaos = json.loads(res.stdout)
        assert chaos["recovered"] and not _running(chaos["pid"])
        again = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert len(again["services"]) == 4
        assert all(s["health"] == "ok" for s in again["services"])
        res = dmsc(tmp_path, "train", "--steps", "2", "--json")
        assert res.returncode == 0, res.stderr
        res = dmsc(tmp_path, "infer", "--prompt", "def ", "--tokens", "4", "--json")
        assert res.returncode == 0 and len(json.loads(res.stdout)["token_ids"]) == 4
        _logs_come_from_the_ray_nodes(tmp_path, {s["sid"] for s in again["services"]})
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
    # the workers (processes of Ray actors on their nodes) are gone with the deployment
    pids = [s["pid"] for s in status["services"] + again["services"]]
    end = time.monotonic() + 30
    while any(_running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)
    # every rank started in its stage's bundle, none outside it (on a loaded machine a bundle's
    # actor may take more than bundle_wait_s to come up, and another is then placed outside the
    # group too: the first up is kept, and the log says so when it is the outside one)
    said = "".join(p.read_text() for p in (tmp_path / "logs").glob("control.*"))
    assert said and "started outside its bundle" not in said


def _logs_come_from_the_ray_nodes(home: Path, sids: set[str]) -> None:
    """The control plane's ``Logs`` call reads each worker's log on its Ray node, through the
    node's host actor. Asked for every node (these all share this machine's files), it finds the
    lines ``dmsc logs`` finds in the files here; ``dmsc logs --grep`` itself takes the local
    files once and asks for other machines' lines only, so no line comes twice."""
    from dmsc.runtime.control.client import ControlClient
    from dmsc.runtime.transport.log_calls import LogsRequest
    from dmsc.runtime.transport.log_search import search

    client = ControlClient.connect(home / "control.json")
    reply = client.logs(LogsRequest(pattern="step committed", everywhere=True))
    assert reply.launcher == "ray" and not reply.unreachable
    assert sids <= {service for service, _, _ in reply.entries}
    here = search(home / "logs", re.compile("step committed"), None, sorted(sids))
    assert {tuple(e) for e in reply.entries} <= {(e.service, e.ts, e.line) for e in here}
    assert not client.logs(LogsRequest(pattern="step committed")).entries  # one machine
    res = dmsc(home, "logs", "--grep", "step committed", "--lines", "0")
    assert res.returncode == 0, res.stderr
    printed = res.stdout.splitlines()
    assert len(printed) == len(set(printed)) >= len(reply.entries)


def test_an_expert_parallel_plan_trains_on_ray_its_groups_met_at_the_control_plane(
    cluster: Any, tmp_path: Path
) -> None:
    """ep = 2 (dp = 2): replica 0 on the head (dc-0), replica 1 on the other node (dc-1), each
    holding two of moe-mini's four experts; they exchange tokens across the two nodes over a
    gloo group that meets at the control plane's store, as the tp groups do, and train to the
    losses of one process. ``dmsc up --launcher ray`` used to refuse ep > 1."""
    spec = resolve_model("moe-mini")
    assert isinstance(spec, TransformerSpec)
    spec = spec.model_copy(update={"layers": 2, "seq": 64})
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=1)
    batches = [corpus.batch(s, 2) for s in range(2)]
    want = reference_losses(spec, 0, 1e-3, batches, 2)
    dcs = {(0, 0): "dc-0", (0, 1): "dc-1"}
    layout = StageLayout(spec, [("embedding", "head")], replicas=2, ep=2, datacenters=dcs)
    with Deployment(layout, RayLauncher(home=tmp_path), home=tmp_path) as dep:
        nodes = {h.process.node for h in dep.handles}  # type: ignore[attr-defined]
        losses = [dep.train_step(s, *batches[s], 1)["loss"] for s in range(len(batches))]
    assert len(nodes) == 2
    assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 1e-4


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_names_the_datacenter_the_ray_cluster_lacks(cluster: Any, tmp_path: Path) -> None:
    c = cluster
    plan = make_plan(tmp_path, pp=2)
    doc = json.loads(plan.read_text())
    doc["stages"][1]["replicas"][0]["datacenter"] = "dc-9"
    plan.write_text(json.dumps(doc))
    res = dmsc(tmp_path, "up", "--plan", str(plan), "--launcher", "ray",
               "--ray-address", c.address)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "lacks dc:dc-9" in res.stderr and "Traceback" not in res.stderr.split("---")[0]


def test_training_resizes_dp_and_serving_replicas_scale_out_on_ray(
    cluster: Any, tmp_path: Path
) -> None:
    """A control plane whose workers run on Ray (dc-0 and dc-1 of the cluster spec): the devices
    online are read from the Ray nodes; a serving replica starts with a Ray launcher of its own
    and is removed again; a training task at dp 2 resizes the deployment on Ray (the placement
    groups given back with the old workers and reserved for the new ones) and trains. Both were
    refused with "the local launcher only"."""
    text = (EXAMPLES / "two-sites-cpu.yaml").read_text()
    (tmp_path / "two-dcs.yaml").write_text(text.replace("site-a", "dc-0").replace("site-b", "dc-1"))
    spec = load_spec(ClusterSpec, tmp_path / "two-dcs.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=1, dp=1)  # one worker a replica: short
    plan = plan_job(spec, SPEC, job, fixed=True).plan
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    cp = ControlPlane(plan, db, home=tmp_path, launcher=RayLauncher(home=tmp_path), cluster=spec)
    pool = ServingPool(
        plan, SPEC, spec, db, cp.run.id, tmp_path, cp.log, cp.inference.in_flight,
        launcher=lambda: RayLauncher(home=tmp_path),
    )  # fmt: skip
    try:
        cp.start()
        # two devices a datacenter in the spec, and Ray's nodes offer them
        assert capacity(cp, spec) == ({"dc-0": 2, "dc-1": 2}, "the Ray cluster's nodes")
        name = pool.scale_out("the test asks")
        assert name is not None, [e.reason for e in db.scale_events(cp.run.id)]
        assert all(isinstance(h.process, RayProcess) for h in pool.get(name).dep.handles)
        pool.scale_in(name, "the test is done with it")
        assert cp.train(TrainRequest(steps=2, dp=2))["state"] == "done"
        dep = cp.deployment
        assert dep.layout.replicas == 2 and len(dep.handles) == 2
        assert all(isinstance(h.process, RayProcess) for h in dep.handles)
        events = [(e.action, e.replicas_after) for e in db.scale_events(cp.run.id)]
        assert events == [("out", 2), ("in", 1), ("train-dp", 2)]
    finally:
        pool.shutdown()
        cp.stopped.set()
        cp.deployment.shutdown()


def test_a_partitioned_ray_node_is_recovered_from_and_fenced_when_it_comes_back(
    cluster: Any, corpora: Any, node_fault_losses: list[float], tmp_path: Path
) -> None:
    """The node running stage 1 (dc-1) stops answering mid-training (every process of it
    frozen: to the rest of the cluster, a network partition). Ray declares the node dead; the
    stage is replaced on the other dc-1 node, the run goes back to its checkpoint with the losses
    of single-process training. When the partition heals, the old worker does not serve again:
    it is gone, and the registry holds the replacement only."""
    c = cluster
    add_node(c, {"dc:dc-1": 4})
    train_c, valid_c = corpora
    steps, want = NODE_STEPS, node_fault_losses
    layout = StageLayout(SPEC, RANGES, datacenters={(0, 0): "dc-0", (1, 0): "dc-1"})
    seen: dict[str, Any] = {}

    def after(dep: Deployment, _node: Any) -> None:
        old = next(h for h in dep.abandoned if h.config.sid == "stage1-r0").process.pid
        end = time.monotonic() + 30
        while _running(old) and time.monotonic() < end:
            time.sleep(0.2)
        seen["old_gone"] = not _running(old)  # once the partition healed, not at shutdown
        new = dep.handle((1, 0))
        seen["registered"] = [s.address for s in dep.registry.lookup(stage=1)]
        seen["address"] = new.address
        seen["tokens"] = len(dep.generate(b"def ", 2, step_base=9_000_000))

    # partitioned after step 2, between checkpoints (every 2): at step 3 a partition would
    # meet a Save, whose call to the frozen worker is waited out (120 s) before the rollback
    report, fr = train_through_node_fault(
        c, layout, train_c, valid_c, steps, BATCH, 2, "partition", at_step=2, home=tmp_path,
        after=after,
    )  # fmt: skip
    assert len(report.recoveries) == 1, report.recoveries
    assert fr.extra["node_after"] != fr.extra["node_before"]
    assert max(abs(a - b) for a, b in zip(report.losses, want, strict=True)) < 1e-5
    assert seen["old_gone"]
    assert seen["registered"] == [seen["address"]] and seen["tokens"] == 2


def test_a_lost_ray_node_re_forms_the_tensor_parallel_group_it_held_on_another_node(
    cluster: Any,
    corpora: Any,
    node_fault_losses: list[float],
    tmp_path: Path,
) -> None:
    """tp = 2: stage 1's two ranks share one bundle on a dc-1 node, and that node goes away
    mid-training. The whole group is replaced (both ranks, not only the one the loss was seen
    on), in the stage's bundle, which Ray has placed again on the other dc-1 node; the ranks meet
    afresh under the new epoch, as do stage 0's, and the run goes back to its checkpoint with the
    losses of single-process training. Stage 0's group used to be kept: a frame of the broken
    step taken by one of its ranks and refused by the other left them in each other's
    collectives, 120 s, then every step failed. With the last dc-1 node gone too, the next
    replacement fails naming the datacenter and what it lacks. (Last in this module: it removes
    every dc-1 node. A pp stage without tp lost with its node is this same path, one rank.)"""
    import ray
    from ray.util import placement_group_table

    from dmsc.runtime.control.launch.recovery import replace

    c = cluster
    add_node(c, {"dc:dc-1": 4})
    train_c, valid_c = corpora
    steps = 4
    want = node_fault_losses[:steps]  # the first steps of a longer run
    layout = StageLayout(SPEC, RANGES, tp=2, datacenters={(0, 0): "dc-0", (1, 0): "dc-1"})
    launcher = RayLauncher(home=tmp_path)
    seen: dict[str, Any] = {}

    def after(dep: Deployment, _node: Any) -> None:
        # stage 0's group, on the head, restarted too: its ranks may disagree about the step
        # the loss broke, and would wait in each other's collectives (120 s, then fail)
        stage0 = [dep.handle((0, 0)), *(h for h in dep.tp.handles if h.config.stage == 0)]
        seen["stage0"] = {h.config.epoch for h in stage0}
        ranks = [dep.handle((1, 0)), *(h for h in dep.tp.handles if h.config.stage == 1)]
        seen["sids"] = sorted(h.config.sid for h in ranks)
        seen["epochs"] = {h.config.epoch for h in ranks}
        seen["nodes"] = {h.process.node for h in ranks}  # type: ignore[attr-defined]
        bundles = placement_group_table(launcher.groups[0])["bundles_to_node_id"]
        seen["bundle_node"] = bundles[launcher._bundles[(1, 0)]]
        gone = [h for h in dep.abandoned if h.config.stage == 1]
        seen["gone"] = sorted((h.config.sid, h.config.epoch) for h in gone)
        seen["registered"] = sorted(s.address for s in dep.registry.lookup(stage=1))
        seen["addresses"] = sorted(h.address for h in ranks)
        seen["in_bundle"] = {h.process.in_bundle for h in ranks}  # type: ignore[attr-defined]
        seen["dc1"] = {
            n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("dc:dc-1")
        }
        # the last dc-1 node goes too: the group is seen lost, and no node can take it
        (kept,) = live_nodes(c, "dc:dc-1")
        assert kept.node_id == seen["bundle_node"]
        c.remove_node(kept, allow_graceful=False)
        end = time.monotonic() + 30
        while any(dep.launcher.alive(h) for h in ranks) and time.monotonic() < end:
            time.sleep(0.1)
        seen["exit"] = dep.launcher.exit_reason(ranks[0])
        launcher.place_timeout_s, launcher.bundle_wait_s = 4, 2  # no dc-1 node will come
        with pytest.raises(WorkerStartError) as refused:
            replace(dep, [(1, 0)])  # what a recovery or the watchdog does next
        seen["refused"] = str(refused.value)

    report, fr = train_through_node_fault(
        c, layout, train_c, valid_c, steps, BATCH, 2, "lose", at_step=2, launcher=launcher,
        home=tmp_path, after=after,
    )  # fmt: skip
    assert len(report.recoveries) == 1, report.recoveries
    assert report.recoveries[0].failed == ["stage1-r0-t0", "stage1-r0-t1"]
    assert max(abs(a - b) for a, b in zip(report.losses, want, strict=True)) < 1e-5
    # both ranks anew, at the new epoch, together in the stage's bundle on the other dc-1 node
    assert seen["sids"] == ["stage1-r0-t0", "stage1-r0-t1"] and seen["epochs"] == {1}
    assert seen["stage0"] == {1}
    assert seen["gone"] == [("stage1-r0-t0", 0), ("stage1-r0-t1", 0)]
    assert seen["nodes"] == {fr.extra["node_after"]} != {fr.extra["node_before"]}
    assert seen["bundle_node"] == fr.extra["node_after"]
    assert seen["in_bundle"] == {True}  # each rank in the bundle, none placed outside it
    assert fr.extra["node_after"] in seen["dc1"]
    assert seen["registered"] == seen["addresses"]
    assert "lost with its Ray node" in seen["exit"]
    assert re.search(r"no Ray node of datacenter dc-1 .*dc:dc-1: 0", seen["refused"]), seen
