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

Where the launcher places workers by datacenter (Ray: ``places_by_datacenter``), the spares are
spread over the plan's datacenters (each new one goes to the datacenter with the fewest) and a
stage is only taken over by a spare of its own datacenter: a spare elsewhere would move the stage
off the node the plan gave it.
"""

from __future__ import annotations

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
        return replace(self._config(f"spare-{n}"), datacenter=dc)

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

    def take(
        self, cfg: WorkerConfig, retire: Callable[[str, int], None] | None = None
    ) -> WorkerHandle | None:
        """A spare that has taken over ``cfg``'s stage, or None when no spare could; ``retire``
        (SID, epoch) refuses the spare's own instances below that epoch once it did."""
        stage = with_secrets(cfg)  # the stage's leaf, when this process issues them
        while True:
            with self._lock:
                fits = [
                    h
                    for h in self.handles
                    if not self.by_datacenter or h.config.datacenter == cfg.datacenter
                ]
                if not fits:
                    return None
                spare = fits[0]
                self.handles.remove(spare)
            self._gone(spare.config)
            client = Client(spare.address, STAGE_SERVICE, token=self.token)
            try:
                client.send("Assume", Assume(config=asdict(stage)), timeout_s=30)
            except grpc.RpcError:  # a dead spare: drop it, try the next
                self.dead.append(spare)
                continue
            finally:
                client.close()
            if retire is not None:
                retire(spare.config.sid, spare.config.epoch + 1)
            return WorkerHandle(cfg, spare.process, spare.address)

    def wait_refills(self, timeout_s: float = 60.0) -> None:
        """Let spares being started finish (one must not outlive the deployment)."""
        for fut in self._refills:
            try:
                fut.result(timeout=timeout_s)
            except Exception:  # a failed start leaves nothing to stop
                continue
