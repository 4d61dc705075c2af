"""Stage workers on a Ray cluster: datacenters are Ray nodes, Ray places and starts the processes.

A plan's datacenter ``NAME`` is the Ray custom resource ``dc:NAME``: a node started with
``ray start --resources '{"dc:dc-a": 8}'`` offers 8 devices of datacenter ``dc-a``. Each stage
replica becomes a small Ray actor (:class:`WorkerHost`) that asks for one unit of its
datacenter's resource and one CPU (one GPU for a ``cuda`` stage, whose worker then sees that GPU
as ``cuda:0``), and that starts the usual worker process (``python -m
dmsc.runtime.compute.worker``) on its node. The worker binds the node's address, registers in the
control plane's registry with its SID and reaches its peers directly, as with the local launcher:
Ray places, starts and stops processes; dmsc keeps the registry, heartbeats and fencing by epoch
(the actors are never restarted by Ray: ``max_restarts=0``).

The stages of one pipeline replica are reserved together, before any starts, as one Ray
placement group (strategy ``PACK``): one bundle per stage, holding its datacenter's unit and its
CPU (or GPU), for each of its tensor-parallel ranks (a bundle lies on one node: so does the
stage's tp group, whose ranks meet through the control plane's store). Ray reserves all of a
pipeline's bundles or none (no half-started pipeline holds devices another needs), packs the
stages the plan puts in one datacenter onto as few of its nodes as it can, and, when a node is
lost, places that node's bundles again on other nodes with room. A replacement goes into its
stage's bundle, after the failed instance's actor there is killed. Warm spares are placed
outside the groups, spread over the plan's datacenters, and a tp group is taken over by spares
of one node only (see :mod:`dmsc.runtime.control.launch.spares`: each reports its node).
:meth:`RayLauncher.close` gives the groups back.

A worker's exit is seen without polling: each host keeps one call open that returns when its
process ends (or fails when its node is lost), and :meth:`RayLauncher.alive` only asks Ray
whether that call has finished. Logs stay on the worker's node, in the same places as the local
launcher's (``<home>/logs/<SID>.log`` and ``.stderr``); on one machine they are the same files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.control.launch.launchers import WorkerHandle, WorkerStartError, with_secrets
from dmsc.runtime.control.launch.ray_checks import free_on, on_loopback, pipeline_bundles, shortfall
from dmsc.runtime.transport import logs

log = logging.getLogger(__name__)
LOST = -1000  # the exit code a worker gets when its Ray node is gone


class WorkerHost:
    """A Ray actor that runs one stage worker process on its node (its class is made remote
    in :func:`_remote_host`, so that importing this module does not import Ray)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.tails: dict[str, Any] = {}  # home -> its NodeTail (:meth:`symptom_lines`)

    def start(
        self, cfg: dict[str, Any], home: str, ready_timeout_s: float, host: str | None = None
    ) -> dict[str, Any]:
        """Start the worker, serving on ``host`` (default: its node's address in Ray)."""
        ray = ray_module()
        host = host or ray.util.get_node_ip_address()
        config = WorkerConfig(**cfg)
        log_file = str(logs.log_file(Path(home), config.sid))
        # The worker asks to be killed when this actor dies: one whose actor went with its node
        # must not serve on as an orphan (on one machine running several Ray nodes it would).
        config = replace(config, host=host, log_file=log_file, die_with_parent=os.getpid())
        if config.device.startswith("cuda"):
            config = replace(config, device="cuda:0")  # the GPU Ray gave this actor
        fd, path = tempfile.mkstemp(prefix=f"{config.sid}-", suffix=".json")
        with os.fdopen(fd, "w") as fh:  # owner-only (mkstemp): it holds the credential
            fh.write(json.dumps(asdict(config)))
        stderr = logs.open_stderr(Path(home), config.sid)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dmsc.runtime.compute.worker", "--config", path],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        finally:
            os.close(stderr)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        Path(path).unlink(missing_ok=True)
        if not line.startswith("READY "):
            self.proc.kill()
            self.proc.wait(timeout=10)
            return {"error": line.strip(), "words": logs.last_words(Path(home), config.sid)}
        node = ray.get_runtime_context().get_node_id()
        return {"address": line.split()[1], "pid": self.proc.pid, "node": node, "ip": host}

    def wait_exit(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def log_entries(
        self, home: str, pattern: str | None, since_s: float | None, services: list[str] | None
    ) -> dict[str, Any]:
        """The lines of this node's logs that ``dmsc logs --grep`` asks for (:mod:`.ray_logs`)."""
        from dmsc.runtime.control.launch.ray_logs import node_entries

        return node_entries(Path(home), pattern, since_s, services)

    def symptom_lines(self, home: str, since_s: float) -> dict[str, Any]:
        """The new lines of this node's logs that show a failure (:mod:`.ray_logs`)."""
        from dmsc.runtime.control.launch.ray_logs import NodeTail

        if home not in self.tails:
            self.tails[home] = NodeTail(Path(home), since_s)
        return self.tails[home].read()  # type: ignore[no-any-return]

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


_REMOTE: Any = None


def ray_module() -> Any:
    """The ``ray`` module, imported on first use (the local launcher never needs it); typed as
    Any because Ray's annotations are partial."""
    import importlib

    return importlib.import_module("ray")


def _remote_host() -> Any:
    global _REMOTE
    if _REMOTE is None:
        ray = ray_module()
        _REMOTE = ray.remote(max_restarts=0, max_concurrency=4)(WorkerHost)
    return _REMOTE


class RayProcess:
    """The worker process behind a :class:`WorkerHost`, seen as a local process is: ``pid``,
    ``poll``, ``wait``, ``kill``, ``terminate``, ``send_signal``."""

    def __init__(
        self, actor: Any, pid: int, node: str, ip: str, in_bundle: bool | None = None
    ) -> None:
        self.actor, self.pid, self.node, self.ip = actor, pid, node, ip
        # in its stage's placement-group bundle (True), outside it after the bundle's actor
        # was slow to come up (False), or placed with no bundle (None: a spare)
        self.in_bundle = in_bundle
        self.exit = actor.wait_exit.remote()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ray = ray_module()
            done, _ = ray.wait([self.exit], timeout=0)
            if done:
                try:
                    self.returncode = int(ray.get(self.exit))
                except Exception:  # the actor died with its node
                    self.returncode = LOST
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("ray worker", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        ray = ray_module()
        if self.poll() is None:
            with contextlib.suppress(Exception):  # gone meanwhile
                ray.get(self.actor.send.remote(sig), timeout=10)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RayLauncher:
    """Worker processes on the nodes of a Ray cluster, by the plan's datacenters."""

    places_by_datacenter = True  # a spare takes over stages of its own datacenter only

    def __init__(
        self,
        address: str | None = None,
        ready_timeout_s: float = 120.0,
        home: Path | None = None,
        place_timeout_s: float = 60.0,
        bundle_wait_s: float = 10.0,
    ) -> None:
        """Join the Ray cluster whose head is at ``address`` (HOST:PORT), or use the one this
        process is connected to already (``address`` None: :func:`.ray_private.private_cluster`,
        or a test's)."""
        ray = ray_module()
        if not ray.is_initialized():
            if address is None or address == "auto":  # auto: whichever cluster /tmp/ray names
                raise ValueError("no Ray cluster to join: give its head's address, HOST:PORT")
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        self.ready_timeout_s = ready_timeout_s
        self.place_timeout_s = place_timeout_s  # for Ray to find a node with room
        self.bundle_wait_s = bundle_wait_s  # for a replacement's bundle, before any node will do
        self.home = home
        # where workers on other nodes reach this process's registry: its node's address
        self.control_host = ray.util.get_node_ip_address()
        # A head joined on a loopback address, every node on this machine: the user wants
        # 127.0.0.1 (``ray start --node-ip-address 127.0.0.1``), which Ray itself replaces
        # with the machine's address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0. The registry
        # and the workers serve on 127.0.0.1 then, not on the machine's network.
        self.worker_host: str | None = None
        if address is not None and on_loopback(address, self.control_host):
            self.control_host = self.worker_host = "127.0.0.1"
        self.groups: dict[int, Any] = {}  # replica -> its pipeline's placement group
        self._bundles: dict[tuple[int, int], int] = {}  # (stage, replica) -> bundle index
        # (stage, replica, tp rank) -> its actor in the stage's bundle
        self._occupant: dict[tuple[int, int, int], Any] = {}

    def prepare(self, cfgs: list[WorkerConfig]) -> None:
        """Refuse (ValueError, naming the resource) a deployment that puts more workers in a
        datacenter than the cluster's nodes offer units of its ``dc:NAME`` resource."""
        ray = ray_module()
        wanted: dict[str, int] = {}
        for cfg in cfgs:
            wanted[cfg.datacenter] = wanted.get(cfg.datacenter, 0) + 1
        offered = ray.cluster_resources()
        short = [
            f"dc:{dc} (the plan puts {n} worker(s) there, the cluster offers "
            f"{int(offered.get(f'dc:{dc}', 0))})"
            for dc, n in sorted(wanted.items())
            if offered.get(f"dc:{dc}", 0) < n
        ]
        if short:
            raise ValueError(
                "the Ray cluster lacks " + "; ".join(short) + ": start a node of each with "
                "`ray start --address HEAD:6379 --resources '{\"dc:NAME\": DEVICES}'`"
            )
        lacking = shortfall(cfgs, offered, [n["Resources"] for n in ray.nodes() if n["Alive"]])
        if lacking:
            raise ValueError(lacking)
        self._reserve([c for c in cfgs if not c.spare])

    def _reserve(self, cfgs: list[WorkerConfig]) -> None:
        """A placement group per pipeline replica, every bundle placed (WorkerStartError, with
        the groups given back, when Ray cannot place them within ``place_timeout_s``)."""
        from ray.util.placement_group import placement_group

        by_replica: dict[int, list[WorkerConfig]] = {}
        for cfg in sorted(cfgs, key=lambda c: (c.replica, c.stage)):
            by_replica.setdefault(cfg.replica, []).append(cfg)
        wanted: dict[int, list[dict[str, float]]] = {}
        for r, group in by_replica.items():
            wanted[r], index = pipeline_bundles(group)
            self.groups[r] = placement_group(wanted[r], strategy="PACK")
            for stage, i in index.items():
                self._bundles[(stage, r)] = i
        end = time.monotonic() + self.place_timeout_s
        for r, pg in self.groups.items():
            if not pg.wait(timeout_seconds=max(0.1, end - time.monotonic())):
                want = wanted[r]
                keys = sorted({k for b in want for k in b})
                free = free_on([k for k in keys if k.startswith("dc:")])
                self.close()
                raise WorkerStartError(
                    f"the Ray cluster could not reserve pipeline replica {r} within "
                    f"{self.place_timeout_s:g} s: its {len(want)} stages need "
                    + ", ".join(f"{sum(b.get(k, 0) for b in want):g} {k}" for k in keys)
                    + " on the nodes of their datacenters; free there now: "
                    + ", ".join(f"{free.get(k, 0):g} {k}" for k in keys)
                    + " (the rest is held by other pipelines or jobs)"
                )

    def capacity(self) -> dict[str, int]:
        """The devices online by datacenter: the ``dc:NAME`` units of the cluster's alive nodes
        (a lost node's go with it; the control loop shrinks dp when they fall short:
        :mod:`dmsc.runtime.control.loop.resizing`)."""
        offered = ray_module().cluster_resources()
        return {k[3:]: int(v) for k, v in offered.items() if k.startswith("dc:")}

    def close(self) -> None:
        """Give the placement groups back (the deployment has stopped its workers); the
        launcher starts and reserves again for the next deployment (a resize's)."""
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            with contextlib.suppress(Exception):  # the cluster is gone too
                remove_placement_group(pg)
        self.groups.clear()
        self._bundles.clear()
        self._occupant.clear()

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle:
        ray = ray_module()
        home = self.home if self.home is not None else workdir
        gpu = cfg.device.startswith("cuda")
        actor, in_bundle = self._place(cfg, gpu)
        if not cfg.spare:
            self._occupant[(cfg.stage, cfg.replica, cfg.tp_rank)] = actor
        # the config (its leaf's key with it) travels inline in the actor call, never ray.put
        cfg = with_secrets(cfg)
        ref = actor.start.remote(asdict(cfg), str(home), self.ready_timeout_s, self.worker_host)
        try:
            out = ray.get(ref, timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise WorkerStartError(
                f"worker {cfg.sid} did not start within {self.ready_timeout_s:g} s on its node"
            ) from None
        except ray.exceptions.RayActorError:
            raise WorkerStartError(
                f"worker {cfg.sid}: its Ray node (datacenter {cfg.datacenter}) was lost while "
                "it started"
            ) from None
        if "error" in out:
            ray.kill(actor)
            said = f" (it said {out['error']!r})" if out["error"] else ""
            raise WorkerStartError(
                f"worker {cfg.sid} failed to start{said}; its last log lines:\n"
                + (out["words"] or "(none)")
            )
        proc = RayProcess(actor, out["pid"], out["node"], out["ip"], in_bundle)
        return WorkerHandle(cfg, proc, out["address"])

    def _place(self, cfg: WorkerConfig, gpu: bool) -> tuple[Any, bool | None]:
        """A :class:`WorkerHost` actor on a node of ``cfg``'s datacenter, up and running, and
        whether it is in its stage's bundle (None: it has none). An actor that dies before it
        runs (Ray placed it on a node that was being lost) is placed again; no node with room
        within ``place_timeout_s`` is a :class:`WorkerStartError`."""
        ray = ray_module()
        key = (cfg.stage, cfg.replica)
        options: dict[str, Any] = {
            "num_cpus": 0 if gpu else 1,
            "num_gpus": 1 if gpu else 0,
            "resources": {f"dc:{cfg.datacenter}": 1},
        }
        if not cfg.spare and key in self._bundles:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            before = self._occupant.pop((*key, cfg.tp_rank), None)
            if before is not None:  # a failed instance (fenced) holds the bundle: free it
                with contextlib.suppress(Exception):
                    ray.kill(before)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.groups[cfg.replica], placement_group_bundle_index=self._bundles[key]
            )
        end = time.monotonic() + self.place_timeout_s
        bound = "scheduling_strategy" in options
        fallback_at = time.monotonic() + self.bundle_wait_s if bound else None
        waiting: dict[Any, tuple[Any, dict[str, Any]]] = {}  # ready ref -> (actor, options)

        def launch(opts: dict[str, Any]) -> None:
            actor = _remote_host().options(**opts).remote()
            waiting[actor.__ray_ready__.remote()] = (actor, opts)

        launch(options)
        try:
            while True:
                now = time.monotonic()
                if fallback_at is not None and now >= fallback_at:
                    # The bundle's actor is not up yet: its node may be one Ray has not yet
                    # declared dead (a partition lasts Ray's health check), or it may only be
                    # slow to start. Keep it, and place another outside the group, on any node
                    # of the datacenter with room: the first up is kept.
                    fallback_at = None
                    log.warning(
                        "%s: its bundle's actor is not up after %g s; another is placed outside "
                        "the group, the first up is kept",
                        cfg.sid,
                        self.bundle_wait_s,
                    )
                    launch({k: v for k, v in options.items() if k != "scheduling_strategy"})
                    continue
                if now >= end:
                    break
                until = end if fallback_at is None else min(end, fallback_at)
                done, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.05, until - now))
                for ref in done:
                    actor, opts = waiting.pop(ref)
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError:  # its node died under it: again
                        time.sleep(0.2)
                        launch(opts)
                        continue
                    if not bound:
                        return actor, None
                    if "scheduling_strategy" not in opts:
                        log.warning("%s: started outside its bundle", cfg.sid)
                    return actor, "scheduling_strategy" in opts
        finally:
            for actor, _ in waiting.values():  # the others, placed or not
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        raise WorkerStartError(
            f"worker {cfg.sid}: no Ray node of datacenter {cfg.datacenter} took it within "
            f"{self.place_timeout_s:g} s (free dc:{cfg.datacenter}: "
            f"{ray.available_resources().get(f'dc:{cfg.datacenter}', 0):g}, and a "
            f"{'GPU' if gpu else 'CPU'} beside it)"
        )

    def stop(self, handle: WorkerHandle) -> None:
        ray = ray_module()
        proc = handle.process
        assert isinstance(proc, RayProcess)
        with contextlib.suppress(Exception):  # its node is gone: nothing left to stop
            ray.get(proc.actor.stop.remote(), timeout=30)
        ray.kill(proc.actor)

    def alive(self, handle: WorkerHandle) -> bool:
        return handle.process.poll() is None

    def exit_reason(self, handle: WorkerHandle) -> str:
        code = handle.process.poll()
        if code == LOST:
            proc = handle.process
            assert isinstance(proc, RayProcess)
            return f"lost with its Ray node {proc.node[:12]} ({proc.ip})"
        return f"exited (signal {-code})" if code is not None and code < 0 else f"exited ({code})"
