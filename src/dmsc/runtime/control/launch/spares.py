"""Warm spares: worker processes started ahead of need, each able to take any stage over.

Replacing a failed worker by a new process costs a Python start, imports and a model build
(seconds on a loaded machine). A spare has done all of that already: on ``Assume`` it builds the
stage's layers, registers under the stage's SID and epoch and serves, in a fraction of the time.
The pool is refilled in the background after each use, so a second failure finds a spare too.
A spare that does not answer ``Assume`` is dropped (kept in ``dead`` to be reaped) and the next
one is tried; with none left the caller starts a process as before.

Under mutual TLS a spare starts with a leaf of its own SID (``spare-N@EPOCH``). ``Assume``
carries the stage's configuration with the leaf of the stage's SID and epoch
(:func:`~.launchers.with_secrets`, as a new process would be started with), which the spare
serves and calls with from then on; once it took over, ``retire`` (the registry's fence) raises
the spare SID's floor past its epoch, so that its old leaf is refused by every service.

At tp > 1 a spare starts as a whole stage (tp = 1: it joins no group while it waits) and takes
over one tensor-parallel rank. A replica is replaced whole (recovery replaces every rank: they
meet in a group of the new epoch), so its ranks are taken over together
(:meth:`SparePool.take_group`): one spare per rank, or none, and the ranks' ``Assume`` calls go
at once, since each rank waits in its group's rendezvous for the others. With too few spares for
the group, or one that does not answer, the group's ranks start as new processes (a spare that
answered is stopped first: it would wait in the rendezvous the new processes join).

Where the launcher places workers by datacenter (Ray: ``places_by_datacenter``), the spares are
spread over the plan's datacenters (each new one goes to the datacenter with the fewest) and a
stage is only taken over by a spare of its own datacenter: a spare elsewhere would move the stage
off the node the plan gave it. The spares taking a tensor-parallel group over are on one node
too (:func:`on_one_node`, by the node a Ray worker reports): a group's all-reduces run at every
layer, as the cost model prices them, over the links inside a node, and the launcher's own
replacements keep a group in its bundle, on one node; with no node holding enough spares, the
ranks start as new processes.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import grpc

from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch.launchers import Launcher, WorkerHandle, with_secrets
from dmsc.runtime.transport.messages import STAGE_SERVICE, Assume
from dmsc.runtime.transport.rpc import Client

# Assume builds the stage (at tp > 1 once every rank of its group joined): a spare that has not
# answered by then is taken as dead
ASSUME_TIMEOUT_S = 30.0


def on_one_node(
    spares: Sequence[WorkerHandle], count: int, datacenter: str | None
) -> list[WorkerHandle] | None:
    """``count`` of ``spares`` (of ``datacenter``, unless None) on one node, the first node in
    the pool's order that holds enough; None when none does. A worker's node is its process's
    ``node`` (a Ray worker's); processes without one (the local launcher's) share this machine."""
    by_node: dict[str | None, list[WorkerHandle]] = {}
    for h in spares:
        if datacenter is None or h.config.datacenter == datacenter:
            by_node.setdefault(getattr(h.process, "node", None), []).append(h)
    return next((hs[:count] for hs in by_node.values() if len(hs) >= count), None)


class SparePool:
    """The warm spares of one deployment: started, taken (``Assume``) and refilled."""

    def __init__(
        self,
        wanted: int,
        launcher: Launcher,
        workdir: Path,
        token: str,
        config: Callable[[str], WorkerConfig],
        datacenters: Sequence[str] = ("local",),
    ) -> None:
        self.wanted = wanted
        self.launcher = launcher
        self.datacenters = list(datacenters) or ["local"]
        self.by_datacenter = bool(getattr(launcher, "places_by_datacenter", False))
        self._held: Counter[str] = Counter()  # spares started or starting, by datacenter
        self.workdir = workdir
        self.token = token
        self._config = config  # a spare's configuration, given its SID
        self.handles: list[WorkerHandle] = []
        self.dead: list[WorkerHandle] = []  # spares that did not answer; reaped at shutdown
        self._lock = threading.Lock()
        self._count = 0
        self._refills: list[Future[None]] = []

    def new_config(self) -> WorkerConfig:
        """The configuration of the next spare: a fresh SID, in the datacenter with the fewest."""
        with self._lock:
            self._count += 1
            n = self._count
            dc = min(self.datacenters, key=lambda d: self._held[d])
            self._held[dc] += 1
        # whole (tp = 1) until it takes a rank over: a spare joins no tensor-parallel group
        return replace(self._config(f"spare-{n}"), datacenter=dc, tp=1, tp_rank=0)

    def _gone(self, spare: WorkerConfig) -> None:
        with self._lock:
            self._held[spare.datacenter] -= 1

    def add(self, h: WorkerHandle) -> None:
        with self._lock:
            self.handles.append(h)

    def _refill(self) -> None:
        while True:
            with self._lock:
                if len(self.handles) >= self.wanted:
                    return
            cfg = self.new_config()
            try:
                self.add(self.launcher.start(cfg, self.workdir))
            except Exception:
                self._gone(cfg)
                raise

    def refill(self, threads: ThreadPoolExecutor) -> None:
        """Start spares in the background until the pool holds ``wanted`` again."""
        if self.wanted:
            self._refills.append(threads.submit(self._refill))

    def _reserve(self, cfg: WorkerConfig) -> WorkerHandle | None:
        """Take a spare that may serve ``cfg`` out of the pool (None: none)."""
        with self._lock:
            fits = [
                h
                for h in self.handles
                if not self.by_datacenter or h.config.datacenter == cfg.datacenter
            ]
            if not fits:
                return None
            self.handles.remove(fits[0])
        self._gone(fits[0].config)
        return fits[0]

    def _assume(self, spare: WorkerHandle, cfg: WorkerConfig) -> bool:
        """Have ``spare`` take ``cfg``'s stage over; False (the spare kept in ``dead``) when it
        did not answer."""
        stage = with_secrets(cfg)  # the stage's leaf, when this process issues them
        client = Client(spare.address, STAGE_SERVICE, token=self.token)
        try:
            client.send("Assume", Assume(config=asdict(stage)), timeout_s=ASSUME_TIMEOUT_S)
        except grpc.RpcError:
            self.dead.append(spare)
            return False
        finally:
            client.close()
        return True

    def take(
        self, cfg: WorkerConfig, retire: Callable[[str, int], None] | None = None
    ) -> WorkerHandle | None:
        """A spare that has taken over ``cfg``'s stage, or None when no spare could; ``retire``
        (SID, epoch) refuses the spare's own instances below that epoch once it did."""
        while True:
            spare = self._reserve(cfg)
            if spare is None:
                return None
            if not self._assume(spare, cfg):  # a dead spare: dropped, try the next
                continue
            if retire is not None:
                retire(spare.config.sid, spare.config.epoch + 1)
            return WorkerHandle(cfg, spare.process, spare.address)

    def take_group(
        self,
        cfgs: Sequence[WorkerConfig],
        threads: ThreadPoolExecutor,
        retire: Callable[[str, int], None] | None = None,
    ) -> list[WorkerHandle] | None:
        """Spares that took over every one of ``cfgs`` (a replica's tensor-parallel ranks, in
        rank order) together, on one node, or None when they could not: too few spares on any
        node (none is taken), or one that did not answer (every spare of the group is
        stopped)."""
        if len(cfgs) == 1:
            one = self.take(cfgs[0], retire)
            return None if one is None else [one]
        where = cfgs[0].datacenter if self.by_datacenter else None  # a replica's ranks' one
        with self._lock:
            picked = on_one_node(self.handles, len(cfgs), where)
            if picked is None:
                return None
            for h in picked:
                self.handles.remove(h)
        for h in picked:
            self._gone(h.config)
        answered = list(threads.map(self._assume, picked, cfgs))
        if not all(answered):
            # the others wait in a rendezvous the new processes of their ranks will join
            for spare, ok in zip(picked, answered, strict=True):
                if ok:
                    self.dead.append(spare)
                with contextlib.suppress(Exception):
                    self.launcher.stop(spare)
            return None
        if retire is not None:
            for spare in picked:
                retire(spare.config.sid, spare.config.epoch + 1)
        return [WorkerHandle(c, s.process, s.address) for c, s in zip(cfgs, picked, strict=True)]

    def wait_refills(self, timeout_s: float = 60.0) -> None:
        """Let spares being started finish (one must not outlive the deployment)."""
        for fut in self._refills:
            try:
                fut.result(timeout=timeout_s)
            except Exception:  # a failed start leaves nothing to stop
                continue
