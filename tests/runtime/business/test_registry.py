from __future__ import annotations

import threading

from dmsc.runtime.business.registry import Registry, ServiceInfo


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _svc(sid: str, stage: int, replica: int = 0) -> ServiceInfo:
    return ServiceInfo(sid, "stage", stage, f"127.0.0.1:{1000 + stage}", replica)


def test_ttl_expiry_with_an_injected_clock() -> None:
    clock = Clock()
    reg = Registry(ttl_s=10, clock=clock)
    reg.register(_svc("a", 0))
    reg.register(_svc("b", 1))
    clock.t = 6
    assert reg.heartbeat("a")
    clock.t = 12  # b last seen at 0: expired; a at 6: alive
    assert [s.sid for s in reg.lookup()] == ["a"]
    assert not reg.heartbeat("b")
    assert reg.heartbeat("a")  # seen again at 12
    clock.t = 17
    assert reg.lookup(stage=0)[0].sid == "a"
    clock.t = 16.0 + 10.5
    assert reg.lookup() == []


def test_lookup_and_deregister() -> None:
    reg = Registry(clock=Clock())
    for s in range(3):
        for r in range(2):
            reg.register(_svc(f"s{s}r{r}", s, r))
    assert [x.replica for x in reg.lookup(stage=1)] == [0, 1]
    v = reg.version
    reg.deregister("s1r0")
    assert reg.version == v + 1 and [x.sid for x in reg.lookup(stage=1)] == ["s1r1"]
    reg.deregister("missing")
    assert reg.version == v + 1


def test_watch_wakes_on_change() -> None:
    reg = Registry(clock=Clock())
    seen: list[int] = []

    def waiter() -> None:
        version, _ = reg.watch(reg.version, timeout_s=5)
        seen.append(version)

    t = threading.Thread(target=waiter)
    t.start()
    reg.register(_svc("x", 0))
    t.join(timeout=5)
    assert seen == [1]
    version, services = reg.watch(since=1, timeout_s=0.01)  # nothing new: returns on timeout
    assert version == 1 and len(services) == 1


def test_heartbeat_age() -> None:
    clock = Clock()
    reg = Registry(ttl_s=10, clock=clock)
    reg.register(_svc("a", 0))
    clock.t = 4
    assert reg.heartbeat_age("a") == 4
    assert reg.heartbeat_age("zzz") is None


def test_a_replacement_fences_the_older_instance_of_its_sid() -> None:
    reg = Registry(ttl_s=10.0, clock=lambda: 0.0)
    assert reg.register(_svc("s1", 1))
    newer = ServiceInfo("s1", "stage", 1, "127.0.0.1:2", epoch=1)
    assert reg.register(newer)
    assert reg.lookup(stage=1) == [newer]
    # The old instance (epoch 0) comes back: refused, its heartbeat says so, and leaving on its
    # way out does not remove the replacement.
    assert not reg.register(_svc("s1", 1))
    assert not reg.heartbeat("s1", 0) and reg.fenced("s1", 0)
    reg.deregister("s1", 0)
    assert reg.lookup(stage=1) == [newer] and reg.heartbeat("s1", 1)


def test_fence_removes_a_failed_instance_before_its_replacement_exists() -> None:
    reg = Registry(ttl_s=10.0, clock=lambda: 0.0)
    reg.register(_svc("s2", 2))
    reg.fence("s2", 1)
    assert reg.lookup(stage=2) == [] and not reg.register(_svc("s2", 2))
    assert reg.register(ServiceInfo("s2", "stage", 2, "127.0.0.1:3", epoch=1))
