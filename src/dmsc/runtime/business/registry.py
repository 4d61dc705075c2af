"""Service registration and discovery: who serves which stage, where, and is it alive.

A service registers (SID, kind, stage, replica, tp rank, model version, address, datacenter,
capacity) and heartbeats within its TTL; a lookup returns the live ones; ``watch`` returns the
services once the registry's version moves past the one the caller knows. The clock is
injected, so tests and the simulator can drive time. :func:`registry_methods` exposes it over
gRPC (JSON messages).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from dmsc.runtime.transport import messages as msg
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.messages import REGISTRY_SERVICE
from dmsc.runtime.transport.replies import HeartbeatReply, Registered
from dmsc.runtime.transport.rpc import message_handler

__all__ = ["REGISTRY_SERVICE", "Registry", "ServiceInfo", "registry_methods"]


@dataclass(frozen=True)
class ServiceInfo:
    """A registered service instance."""

    sid: str
    kind: str
    stage: int
    address: str
    replica: int = 0
    tp_rank: int = 0  # its rank in its replica's tensor-parallel group
    model_version: str = "0"
    datacenter: str = "local"
    capacity: float = 1.0
    epoch: int = 0  # the incarnation: a replacement registers the same SID with a higher one


class Registry:
    """Live services with a heartbeat TTL (thread-safe)."""

    def __init__(
        self,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        fences: tls.FenceFloors | None = None,
    ) -> None:
        """``fences`` (default: its own) follows every fence floor raised here: the registry's
        service refuses the certificates of fenced epochs, and its answers hand the floors to
        the workers (each deployment's registry has its own: SIDs are per deployment)."""
        self.ttl_s = ttl_s
        self.fences = fences if fences is not None else tls.FenceFloors()
        self.clock = clock
        self._services: dict[str, tuple[ServiceInfo, float]] = {}
        self._fence_floor: dict[str, int] = {}  # per SID: instances below this epoch are fenced
        self._version = 0
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def _changed(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def register(self, info: ServiceInfo) -> bool:
        """Record ``info``; False (fenced) when its SID is held by a newer epoch."""
        with self._cond:
            if self._fence_floor.get(info.sid, 0) > info.epoch:
                return False
            self._fence_floor[info.sid] = max(self._fence_floor.get(info.sid, 0), info.epoch)
            self.fences.raise_floor(info.sid, info.epoch)
            self._services[info.sid] = (info, self.clock())
            self._changed()
            return True

    def heartbeat(self, sid: str, epoch: int | None = None) -> bool:
        """False when the service is unknown (expired or never registered): register again."""
        with self._cond:
            self._expire()
            if sid not in self._services:
                return False
            info, _ = self._services[sid]
            if epoch is not None and epoch != info.epoch:
                return False
            self._services[sid] = (info, self.clock())
            return True

    def floors(self) -> dict[str, int]:
        """Per SID, the lowest epoch served (what a worker's servers refuse below)."""
        with self._cond:
            return dict(self._fence_floor)

    def fenced(self, sid: str, epoch: int) -> bool:
        """Whether an instance of ``sid`` at ``epoch`` has been replaced by a newer one."""
        with self._cond:
            return self._fence_floor.get(sid, 0) > epoch

    def fence(self, sid: str, epoch: int) -> None:
        """Refuse every instance of ``sid`` older than ``epoch`` from now on (the orchestrator
        calls this when it declares an instance failed, before its replacement registers)."""
        with self._cond:
            self._fence_floor[sid] = max(self._fence_floor.get(sid, 0), epoch)
            self.fences.raise_floor(sid, epoch)
            held = self._services.get(sid)
            if held is not None and held[0].epoch < epoch:
                del self._services[sid]
                self._changed()

    def heartbeat_age(self, sid: str) -> float | None:
        """Seconds since the service was last heard from (None if unknown)."""
        with self._cond:
            entry = self._services.get(sid)
            return None if entry is None else self.clock() - entry[1]

    def deregister(self, sid: str, epoch: int | None = None) -> None:
        """Remove ``sid`` (only the instance at ``epoch``, when given: a fenced instance on
        its way out must not remove its replacement)."""
        with self._cond:
            held = self._services.get(sid)
            if held is None or (epoch is not None and held[0].epoch != epoch):
                return
            del self._services[sid]
            self._changed()

    def _expire(self) -> None:
        now = self.clock()
        dead = [sid for sid, (_, seen) in self._services.items() if now - seen > self.ttl_s]
        for sid in dead:
            del self._services[sid]
        if dead:
            self._changed()

    def lookup(self, stage: int | None = None, kind: str | None = None) -> list[ServiceInfo]:
        with self._cond:
            self._expire()
            found = [
                info
                for info, _ in self._services.values()
                if (stage is None or info.stage == stage) and (kind is None or info.kind == kind)
            ]
        return sorted(found, key=lambda s: (s.stage, s.replica, s.sid))

    def watch(self, since: int, timeout_s: float) -> tuple[int, list[ServiceInfo]]:
        """Wait (wall time, at most ``timeout_s``) until the version passes ``since``."""
        with self._cond:
            self._cond.wait_for(lambda: self._version > since, timeout=timeout_s)
        return self._version, self.lookup()


def registry_methods(reg: Registry) -> dict[str, grpc.RpcMethodHandler]:
    """The ``dmsc.Registry`` service over ``reg``; every request is a typed message."""

    def register(m: msg.Register) -> dict[str, Any]:
        ok = reg.register(ServiceInfo(**m.model_dump()))
        return {"ok": ok, "fenced": not ok, "ttl_s": reg.ttl_s, "fences": reg.floors()}

    def heartbeat(m: msg.Heartbeat) -> dict[str, Any]:
        epoch = m.epoch if m.epoch is not None else 0
        known = reg.heartbeat(m.sid, epoch)
        return {"known": known, "fenced": reg.fenced(m.sid, epoch), "fences": reg.floors()}

    def deregister(m: msg.Deregister) -> dict[str, Any]:
        reg.deregister(m.sid, m.epoch)
        return {"ok": True}

    def lookup(m: msg.Lookup) -> dict[str, Any]:
        services = reg.lookup(m.stage, m.kind)
        return {"version": reg.version, "services": [asdict(s) for s in services]}

    def watch(m: msg.Watch) -> dict[str, Any]:
        version, services = reg.watch(m.since, m.timeout_s)
        return {"version": version, "services": [asdict(s) for s in services]}

    methods = {
        "Register": message_handler(msg.Register, register, reply=Registered),
        "Heartbeat": message_handler(msg.Heartbeat, heartbeat, reply=HeartbeatReply),
        "Deregister": message_handler(msg.Deregister, deregister),
        "Lookup": message_handler(msg.Lookup, lookup),
        "Watch": message_handler(msg.Watch, watch),
    }
    # over mutual TLS, a fenced epoch's certificate is refused by every method (.tls)
    return {name: tls.fence_checked(h, reg.fences) for name, h in methods.items()}
