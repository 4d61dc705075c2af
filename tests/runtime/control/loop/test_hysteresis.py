"""The moves' hysteresis (:mod:`dmsc.runtime.control.loop.hysteresis`): the flip-flop the loop
made when it acted by itself, reproduced with the real path optimisation on synthetic traces of
a slowed link (the move, then the way back on the old placement's traces), and each rule over
hand-built snapshots: confirmation over consecutive ticks against a noisy module, the cool-down,
and the round trip a move back must pay."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from modules_helpers import fill_run, make_plan, stand_in_plane

from dmsc.data.control_records import decisions
from dmsc.data.db import Database
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors import Measurements, MetricPoint, Proposal, TaskTimes
from dmsc.runtime.control.advisors.orchestrator import Decision
from dmsc.runtime.control.advisors.paths import PathOptimisation, replan
from dmsc.runtime.control.loop import runner
from dmsc.runtime.control.loop.hysteresis import Memory, after_move, cooled, parts
from dmsc.runtime.control.loop.objectives import Policy
from dmsc.runtime.control.loop.runner import ControlLoop
from dmsc.runtime.control.loop.snapshot import last_move_s
from dmsc.runtime.control.loop.tick import LoopConfig, LoopState, Snapshot, tick
from dmsc.runtime.control.training.resize import record_resize
from dmsc.spec import ClusterSpec, load_spec

ROOT = Path(__file__).resolve().parents[4]
NOW = 1_800_000_000.0


def three_sites() -> ClusterSpec:
    return load_spec(ClusterSpec, ROOT / "examples/clusters/three-sites-cpu.yaml")


def test_a_stage_moved_off_a_slow_link_is_not_moved_back_on_the_old_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sites, the direct link ten times slower: path optimisation moves stage 1 to
    site-c. Read against the new plan, the same traces put the slow gap on site-a - site-c, and
    it proposes the way back (the flip-flop); the loop holds it until a task runs there."""
    three = three_sites()
    plan = make_plan(three)
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run, task = fill_run(db, three, plan, steps=12, gap_scale={0: 10.0})
    cp = stand_in_plane(db, run, plan, three)
    moved: list[str] = []

    def relayout(c: Any, traces: Any, p: Proposal) -> dict[str, Any]:
        found = replan(c.plan, c.cluster, traces)
        assert not isinstance(found, str)
        c.plan = found.new_plan
        moved.append(p.target)
        return {"target": p.target, "move_s": 0.1}

    monkeypatch.setattr(runner, "apply_move", relayout)
    log = logging.getLogger("test-hysteresis")
    policy = Policy(confirm_ticks=1)  # the first reading applies: only the stale rule acts
    loop = ControlLoop(cp, LoopConfig(policy, "act"), 1.0, log, [PathOptimisation(three)])
    for _ in range(3):
        loop.once()
    assert moved == ["stage 1: site-b -> site-c"]
    rows = [d for d in decisions(db, run) if d.kind == "move-stage"]
    back = [d for d in rows if d.target == "stage 1: site-c -> site-b"]
    assert [d.verdict for d in back] == ["refuse"]
    assert f"measured on task {task}, which ran on the placement before" in back[0].reason
    # the memory: stage 1 moved, the task it was measured on stale, counts afresh
    assert loop.state.memory.placed_task == task
    assert loop.state.memory.moved["stage 1"].before == "site-b"


class Noisy:
    """A module whose proposal follows a sequence: a move (True) or nothing (False)."""

    name = "noisy"
    description = reads = proposes = "test"

    def __init__(self, seq: list[bool], gain: float = 0.5, cost: float = 1.0) -> None:
        self.seq, self.gain, self.cost = list(seq), gain, cost

    def propose(self, m: Measurements) -> list[Proposal]:
        if not self.seq.pop(0):
            return [Proposal(self.name, "keep", "placement", "nothing faster")]
        details = {"datacenters": {"current": ["a", "b"], "proposed": ["a", "c"]}}
        return [
            Proposal(self.name, "move-stage", "stage 1: b -> c", "faster", self.gain,
                     m.metrics[-1].step_s, self.cost, details)
        ]  # fmt: skip


def _snap(plan: Plan, steps: int, task: int = 1) -> Snapshot:
    metrics = tuple(MetricPoint(i, 3.0, 1.0, 100.0) for i in range(steps))
    tasks = (TaskTimes(task, "train", "running", "default", "sync", NOW - 100, NOW - 90, None),)
    return Snapshot(Measurements(1, plan, NOW + steps, task, metrics, (), tasks))


def _run(plan: Plan, policy: Policy, module: Noisy, ticks: int) -> list[str]:
    """The verdicts on the move, tick by tick, ten new steps each (the modules run each: no
    least interval between their runs)."""
    state, out = LoopState(), []
    policy = policy.model_copy(update={"replan_interval_s": 0.0})
    for i in range(ticks):
        res = tick(_snap(plan, 10 * (i + 1)), LoopConfig(policy), state, [module])
        state = res.state
        out += [d.verdict for d in res.decisions if d.proposal.kind == "move-stage"] or ["-"]
    return out


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan(three_sites())


def test_a_move_applies_after_it_held_on_consecutive_ticks(plan: Plan) -> None:
    steady = Noisy([True] * 4)
    assert _run(plan, Policy(confirm_ticks=3), steady, 4) == ["refuse", "refuse", "apply", "apply"]
    # noise: the move comes and goes; no three in a row, never applied (without: every other)
    noise = [True, True, False, True, False, True, True, False]
    assert "apply" not in _run(plan, Policy(confirm_ticks=3), Noisy(noise), len(noise))
    assert _run(plan, Policy(confirm_ticks=1), Noisy(noise), len(noise)).count("apply") == 5
    res = tick(_snap(plan, 10), LoopConfig(Policy()), LoopState(), [Noisy([True])])
    (d,) = res.decisions
    assert "held: the same move on 1 of 3 consecutive ticks" in d.reason  # the default: 3


def _decision(target: str, current: list[str], proposed: list[str], gain: float,
              cost: float) -> Decision:  # fmt: skip
    details = {"datacenters": {"current": current, "proposed": proposed}}
    p = Proposal("paths", "move-stage", target, "faster", gain, 1.0, cost, details)
    return Decision(p, "apply", "pays back")


def test_a_stage_just_moved_cools_down_and_a_move_back_pays_the_round_trip() -> None:
    forth = _decision("stage 1: b -> c", ["a", "b"], ["a", "c"], 0.5, 30.0)
    assert parts(forth.proposal) == {"stage 1": ("b", "c")}
    memory = after_move(Memory(), forth.proposal, NOW, task_id=4)
    back = _decision("stage 1: c -> b", ["a", "c"], ["a", "b"], 0.05, 30.0)
    (d,) = cooled([back], memory, NOW + 6, cooldown_s=600, horizon=1000)
    assert d.verdict == "refuse" and "stage 1 moved 6 s ago, within the cool-down" in d.reason
    # after the cool-down: 60 s of round trip over 0.05 s/step is 1200 steps, beyond 1000
    (d,) = cooled([back], memory, NOW + 601, cooldown_s=600, horizon=1000)
    assert d.verdict == "refuse" and "round trip's cost of 60.0 s" in d.reason
    (d,) = cooled([back], memory, NOW + 601, cooldown_s=600, horizon=2000)
    assert d.verdict == "apply"
    # another stage is free to move; a move elsewhere for stage 1 waits the cool-down too
    other = _decision("stage 0: a -> c", ["a", "c"], ["c", "c"], 0.5, 30.0)
    (d,) = cooled([other], memory, NOW + 6, cooldown_s=600, horizon=1000)
    assert d.verdict == "apply"


def test_a_task_that_started_before_any_move_is_stale(plan: Plan, tmp_path: Path) -> None:
    """A move of ``dmsc replan`` the loop did not make: the scale event it recorded dates it."""
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run(plan.model, plan.cluster, {}).id
    assert last_move_s(db, run) is None
    record_resize(db, run, "move", "stage 1: b -> c (dmsc replan)", plan)
    moved = last_move_s(db, run)
    assert moved is not None and abs(moved - time.time()) < 60
    cfg = LoopConfig(Policy(confirm_ticks=1))
    snap = _snap(plan, 10)  # its task started at NOW - 90
    before = tick(replace(snap, moved_s=NOW - 30), cfg, LoopState(), [Noisy([True])])
    (d,) = before.decisions
    assert d.verdict == "refuse" and "ran on the placement before the last move" in d.reason
    after = tick(replace(snap, moved_s=NOW - 120), cfg, LoopState(), [Noisy([True])])
    assert [d.verdict for d in after.decisions] == ["apply"]
