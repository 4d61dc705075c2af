"""Hysteresis for the loop's moves: a move is applied only when its measurements say so steadily,
and a stage just moved is not moved back on the next noisy reading.

Left to itself, the loop flip-flopped: on one machine whose "datacenters" share its cores, it
moved two stages one way and back six seconds later. Two causes, each with its rule here (pure
functions over the tick's decisions and :class:`Memory`, no clock: the snapshot's time is the
clock):

- **stale measurements**: after a move the snapshot still held the step traces of the task that
  ran on the old placement, and path optimisation read them against the new plan, so the slow
  link it had just left looked like the new one and it proposed the way back
  (tests/runtime/control/loop/test_hysteresis.py reproduces it with the real module). A move is
  judged only on a training task that started after the last move, the loop's or ``dmsc
  replan``'s (:func:`stale`);
- **noise**: a move must be the decision on ``confirm_ticks`` consecutive ticks on which the
  modules ran on new measurements (a new training task, or ``MODULE_STEPS`` more steps after
  the policy's ``replan_interval_s``: :func:`.tick.modules_due`), the same move (module, kind and
  target) each time; one tick that does not propose it starts the count again
  (:func:`confirmed`);
- **cool-down**: a stage (or a boundary's path) moved less than ``cooldown_s`` ago is not moved
  again; after it, a move that puts it back where it was must pay back the round trip, its own
  cost and that of the move it undoes, within the decision rule's horizon (:func:`cooled`).

Each rule turns an ``apply`` into a ``refuse`` with its reason; the decision rule's verdicts are
otherwise unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dmsc.runtime.control.advisors.base import MOVE_KINDS, Proposal
from dmsc.runtime.control.advisors.orchestrator import Decision

Signature = tuple[str, str, str]  # (module, kind, target): the same move


@dataclass(frozen=True)
class PartMove:
    """The last move of one part (a stage's datacenter, a boundary's path)."""

    before: str
    after: str
    at_s: float
    cost_s: float


@dataclass(frozen=True)
class Memory:
    """What the rules remember between ticks."""

    streaks: Mapping[Signature, int] = field(default_factory=dict)  # ticks a move held
    moved: Mapping[str, PartMove] = field(default_factory=dict)  # by part
    placed_task: int | None = None  # the measured training task when the last move was made


def signature(p: Proposal) -> Signature:
    return (p.module, p.kind, p.target)


def parts(p: Proposal) -> dict[str, tuple[str, str]]:
    """What ``p`` moves: ``{"stage S": (from, to)}`` for each stage that changes datacenter,
    ``{"boundary B": (from, to)}`` for each boundary whose path changes (the proposal's
    details, as path optimisation writes them), ``{"dp": (from, to)}`` for a resize,
    ``{"stage S replica R": ("node A", "node B")}`` for a ``move-node``; the target itself when
    it says nothing more."""
    out: dict[str, tuple[str, str]] = {}
    dcs = p.details.get("datacenters") or {}
    for s, (a, b) in enumerate(zip(dcs.get("current", []), dcs.get("proposed", []), strict=False)):
        if a != b:
            out[f"stage {s}"] = (str(a), str(b))
    node = p.details.get("node")
    if node:  # a stage replica to another node of its datacenter (.busy)
        part = f"stage {node['stage']} replica {node['replica']}"
        out[part] = (f"node {node['from']}", f"node {node['to']}")
    dp = p.details.get("dp")
    if dp:  # a resize: the data-parallel degree is the part it moves
        out["dp"] = (str(dp["current"]), str(dp["proposed"]))
    paths = p.details.get("paths") or {}
    now = {r["after_stage"]: r for r in paths.get("current", [])}
    for r in paths.get("proposed", []):
        old = now.get(r["after_stage"])
        if old != r and old is not None:
            out[f"boundary {r['after_stage']}"] = (_route(old), _route(r))
    return out or {p.target: ("", p.target)}


def _route(r: Mapping[str, Any]) -> str:
    return f"{'+'.join(str(x) for x in r.get('links') or [])} x{r.get('units')}"


def _refuse(d: Decision, why: str) -> Decision:
    return Decision(d.proposal, "refuse", f"{d.reason}; held: {why}")


def _applies(d: Decision) -> bool:
    """A move the rules judge: a resize forced by lost devices (:mod:`.resizing`) is not one."""
    forced = bool(d.proposal.details.get("forced"))
    return d.verdict == "apply" and d.proposal.kind in MOVE_KINDS and not forced


def stale(
    decisions: Sequence[Decision],
    memory: Memory,
    task_id: int | None,
    started_s: float | None = None,
    moved_s: float | None = None,
) -> list[Decision]:
    """Moves judged on a task that ran on the placement before the last move are refused: a
    task up to the one measured when the loop moved (``memory``), or one that started before
    the deployment's last move (``moved_s``, unix seconds: a move of ``dmsc replan`` too)."""
    placed = memory.placed_task
    old = placed is not None and task_id is not None and task_id <= placed
    old = old or (moved_s is not None and started_s is not None and started_s < moved_s)
    if not old:
        return list(decisions)
    why = (
        f"measured on task {task_id}, which ran on the placement before the last move: "
        "judged again on a training task that runs on the new one"
    )
    return [_refuse(d, why) if _applies(d) else d for d in decisions]


def cooled(
    decisions: Sequence[Decision], memory: Memory, now_s: float, cooldown_s: float, horizon: int
) -> list[Decision]:
    """Moves of a part moved within ``cooldown_s`` are refused; one that puts a part back where
    it was must pay back its cost and the undone move's within ``horizon`` steps."""
    out = []
    for d in decisions:
        if not _applies(d):
            out.append(d)
            continue
        p, why = d.proposal, ""
        for part, (_, to) in parts(p).items():
            last = memory.moved.get(part)
            if last is None:
                continue
            ago = now_s - last.at_s
            if ago < cooldown_s:
                why = f"{part} moved {ago:.0f} s ago, within the cool-down of {cooldown_s:g} s"
                break
            if to == last.before:
                trip = p.cost_s + last.cost_s
                gain = p.predicted_gain_s_per_step
                steps = trip / gain if gain > 0 else float("inf")
                if steps > horizon:
                    why = (
                        f"it moves {part} back: the round trip's cost of {trip:.1f} s is paid "
                        f"back in {steps:.0f} steps, beyond the horizon of {horizon} steps"
                    )
                    break
        out.append(_refuse(d, why) if why else d)
    return out


def confirmed(
    decisions: Sequence[Decision], memory: Memory, confirm_ticks: int
) -> tuple[list[Decision], dict[Signature, int]]:
    """Moves held until they were the decision on ``confirm_ticks`` consecutive ticks (those on
    which the modules ran); the streaks counted."""
    streaks: dict[Signature, int] = {}
    out = []
    for d in decisions:
        if not _applies(d):
            out.append(d)
            continue
        sig = signature(d.proposal)
        n = streaks[sig] = memory.streaks.get(sig, 0) + 1
        if n < confirm_ticks:
            d = _refuse(d, f"the same move on {n} of {confirm_ticks} consecutive ticks")
        out.append(d)
    return out, streaks


def steady(
    decisions: Sequence[Decision],
    memory: Memory,
    *,
    task_id: int | None,
    started_s: float | None = None,
    moved_s: float | None = None,
    now_s: float,
    confirm_ticks: int,
    cooldown_s: float,
    horizon: int,
) -> tuple[list[Decision], Memory]:
    """The three rules over the decisions of a tick on which the modules ran (module
    docstring), and the memory after it."""
    out = stale(decisions, memory, task_id, started_s, moved_s)
    out = cooled(out, memory, now_s, cooldown_s, horizon)
    out, streaks = confirmed(out, memory, confirm_ticks)
    return out, Memory(streaks, memory.moved, memory.placed_task)


def after_move(memory: Memory, p: Proposal, now_s: float, task_id: int | None) -> Memory:
    """The memory once ``p`` was applied at ``now_s`` after training task ``task_id``: its parts
    moved, the streaks counted afresh, the measurements before it stale."""
    moved = dict(memory.moved)
    for part, (before, after) in parts(p).items():
        moved[part] = PartMove(before, after, now_s, p.cost_s)
    placed = task_id if task_id is not None else memory.placed_task
    return Memory({}, moved, placed)
