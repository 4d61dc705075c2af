"""The autoscaler's rule (pure) and its loop against a scripted pool."""

from __future__ import annotations

import logging
import threading

import pytest

from dmsc.runtime.control.serving.autoscale import ScalePolicy, parse_autoscale
from dmsc.runtime.control.serving.elastic import autoscale_loop
from dmsc.runtime.transport.messages import AutoscaleSettings


def test_the_flag_is_parsed_with_its_defaults() -> None:
    s = parse_autoscale("infer:min=1,max=4")
    assert (s.min, s.max, s.target, s.cooldown_s, s.window_s) == (1, 4, 2.0, 10.0, 5.0)
    s = parse_autoscale("infer:max=3,target=1.5,cooldown=0,window=2")
    assert (s.max, s.target, s.cooldown_s, s.window_s) == (3, 1.5, 0.0, 2.0)
    assert parse_autoscale("infer:") == AutoscaleSettings()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("train:min=1", "only inference replicas scale"),
        ("infer:min=1,max", "expected KEY=VALUE"),
        ("infer:replicas=2", "KEY one of min, max"),
        ("infer:min=3,max=2", "min: 3 is above max (2)"),
        ("infer:max=x", "max: Input should be a valid integer"),
        ("infer:target=0", "target: Input should be greater than 0"),
    ],
)
def test_a_bad_flag_says_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_autoscale(text)


def _policy(**kw: float) -> ScalePolicy:
    return ScalePolicy(
        AutoscaleSettings(
            **{"min": 1, "max": 4, "target": 2, "cooldown_s": 10, "window_s": 5, **kw}
        )
    )


def test_load_above_the_target_adds_one_replica_at_a_time_with_a_cooldown() -> None:
    p = _policy()
    assert p.observe(0.0, 7, 1) == 2  # ceil(7 / 2) = 4 wanted: one more
    p.changed(0.0)
    assert p.observe(5.0, 7, 2) == 2  # cooldown
    assert p.observe(10.0, 7, 2) == 3
    p.changed(10.0)
    assert p.observe(20.0, 20, 3) == 4
    p.changed(20.0)
    assert p.observe(30.0, 20, 4) == 4  # at max


def test_a_replica_goes_only_when_the_whole_window_fits_in_one_fewer() -> None:
    p = _policy(cooldown_s=0)  # window 5 s: the scale-in window is 12 of them, a minute
    for t in range(6):
        assert p.observe(float(t), 6, 3) == 3  # 6 in flight: 3 wanted
    assert p.observe(6.0, 0, 3) == 3  # the window still holds 6s: 3 would be needed
    for t in range(7, 65):
        assert p.observe(float(t), 2, 3) == 3  # the scale-in window still holds 6s
    assert p.observe(66.0, 2, 3) == 2  # a minute of 2 at most: one replica fewer
    assert p.observe(66.5, 2, 2) == 1


def test_below_the_minimum_it_grows_whatever_the_load() -> None:
    p = _policy(min=2, cooldown_s=100)
    assert p.observe(0.0, 0, 1) == 2
    p.changed(0.0)
    assert p.observe(1.0, 0, 2) == 2


class ScriptedPool:
    """What autoscale_loop drives, without processes: it counts what it was asked."""

    def __init__(self, base: int, room: int) -> None:
        self.base, self.room = base, room
        self.serving: list[str] = []
        self.log = logging.getLogger("test")
        self.added = self.removed = 0

    def count(self) -> int:
        return self.base + len(self.serving)

    def scale_out(self, reason: str, in_flight: float = 0.0) -> str | None:
        if len(self.serving) >= self.room:
            return None
        self.serving.append(f"serve-{len(self.serving) + 1}")
        self.added += 1
        return self.serving[-1]

    def newest(self) -> str | None:
        return self.serving[-1] if self.serving else None

    def scale_in(self, name: str, reason: str, in_flight: float = 0.0) -> None:
        self.serving.remove(name)
        self.removed += 1


def test_the_loop_follows_the_load_up_and_down_within_the_room_it_has() -> None:
    pool = ScriptedPool(base=1, room=2)
    load = {"n": 8}
    stop = threading.Event()
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        if t[0] > 12:
            load["n"] = 0
        if t[0] > 100:  # a replica goes after the scale-in window (12 x 3 s) of no load
            stop.set()
        return t[0]

    settings = AutoscaleSettings(min=1, max=4, target=2, cooldown_s=2, window_s=3)
    autoscale_loop(pool, ScalePolicy(settings), lambda: load["n"], stop, 0.0, clock)  # type: ignore[arg-type]
    assert pool.added == 2  # 8 in flight wants 4; the cluster had room for 2 more
    assert pool.count() == 1 and pool.removed == 2  # back to the minimum once the load went
