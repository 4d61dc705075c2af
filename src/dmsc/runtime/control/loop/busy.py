"""A busy node: a stage's worker on a node whose CPU stays over the policy's threshold, found by
the tick and handed to path optimisation, which may move the stage to another datacenter, and
moved by the loop itself to an idle node of its own datacenter where one has room.

The node's CPU % (all its cores, a cpuset's when the spec pins the node to some cores of a
shared machine: another job on them counts, not only the workers) comes
with each training step's trace (:mod:`dmsc.runtime.compute.telemetry`), and the snapshot keeps
each worker's mean over its last steps (:func:`.snapshot.telemetry`). Pure functions here:

- :func:`datacenter_cpu`: each datacenter's busiest node among those its stage workers run on;
- :func:`watch`: a datacenter over ``busy.cpu_percent`` (the policy's,
  :class:`.objectives.BusyNode`) on ``busy.ticks`` ticks in a row is busy; the streaks are kept
  in the tick's state.

When one becomes busy the tick runs the modules (at once, and at every tick while a datacenter
stays over the threshold, so that a move confirms from tick to tick: :func:`.tick.modules_due`)
with the busy datacenters in their measurements. Path optimisation
keeps a busy datacenter's measured speed for it, but no longer lends it to the datacenters of
the same device type that ran no stage (:func:`~..advisors.paths.device_speeds`). Without that,
the idle datacenters took the busy one's slowness as their device type's. A datacenter is then
a candidate when it is idle: measured under the threshold, or running none of the run's
workers (its load unknown: counted idle, as :func:`dmsc.planner.elastic.node_load` counts a
node with no measured worker) while a measured datacenter of its device type is idle, whose
speed it takes (with none idle, nothing says the slowness is the nodes' and not the devices':
the measured speeds stand, and a machine that all the datacenters share moves nothing). The
check is on when the policy sets ``busy`` (off by default). Whether the move
pays (its transfers to another datacenter, its one-off cost) is the cost model's and the
decision rule's: the move is path optimisation's own ``move-stage``, confirmed by the hysteresis
and applied by :func:`.moves.apply_move`, which re-plans with the same busy datacenters.

A busy datacenter with an idle node of its own (:func:`node_moves`): a stage replica on a node
over the threshold may move to a node of the same datacenter with free devices of its device
type, measured under the threshold or running none of the run's workers (the idlest, in the
bands of :data:`~dmsc.planner.elastic.IDLE_BAND`, then the fullest: packing, as a new replica
is placed). The planner places stages on datacenters, so path optimisation cannot propose it;
the loop does, as a ``move-node`` with its figures, through the same decision rule and
hysteresis, applied by :func:`.moves.apply_move` (:func:`dmsc.planner.elastic.move_replica`:
the plan's prediction and paths stand, priced per datacenter and device type). Its figures:

- the replica's compute per micro-batch as its step traces measured it (its spans, median over
  the steps that measured its node over the threshold, or over all when none did), against
  what it would be on an idle node: the median of the same stage's replicas
  on nodes under the threshold, else what the replica itself measured the last time its node
  was under it (:func:`idle_compute`, kept by the tick), else the plan's per-micro-batch time
  of the stage scaled by how the stages on idle nodes measured against theirs (this machine's
  speed against the cost model's). With none, nothing says what an idle node would do: no
  move, a note says so;
- the gain per step: the pipeline is paced by its slowest stage replica, so the micro-batches
  of a step times how much the slowest falls (the moved replica's new time or the next
  slowest, whichever is larger: nothing when another replica is as slow);
- the cost: :func:`~..advisors.move_cost.move_cost_s` of the stage's layers (a checkpoint written
  and read back and a restart; nothing crosses a datacenter).

Both kinds of move are proposed on the same tick; the decision rule applies the larger gain.
The nodes are those of the spec the deployed plan's devices are numbered on (:func:`numbered_on`:
after a shrink, the spec cut to the devices online, so that no lost node is proposed and no
node number is read on a spec where it names another node).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dmsc.data.traces import StepTrace
from dmsc.netmodel.topology import Topology
from dmsc.planner.elastic import IDLE_BAND, devices_in_use
from dmsc.planner.plan import Plan
from dmsc.runtime.control.advisors.base import FaultInfo, Proposal
from dmsc.runtime.control.advisors.move_cost import move_cost_s
from dmsc.runtime.control.loop.objectives import BusyNode
from dmsc.runtime.control.training.online import numbered_spec
from dmsc.spec import ClusterSpec

MODULE = "busy-node"  # the decision rows' module of a move to an idle node
Key = tuple[int, int]  # (stage, replica)
Baseline = tuple[int, int, str]  # (stage, replica, its layers as JSON)


def datacenter_cpu(
    telemetry: Mapping[str, Mapping[str, float | None]], plan: Plan
) -> dict[str, float]:
    """Each datacenter's busiest node CPU % as its workers measured it (``telemetry`` by
    ``"STAGE/REPLICA"``, the snapshot's); datacenters with no measure are left out."""
    out: dict[str, float] = {}
    for name, use in telemetry.items():
        cpu = use.get("node_cpu_percent")
        stage, _, replica = name.partition("/")
        if cpu is None or not stage.isdigit() or not replica.isdigit():
            continue
        s, r = int(stage), int(replica)
        if s >= len(plan.stages) or r >= len(plan.stages[s].replicas):
            continue
        dc = plan.stages[s].replicas[r].datacenter
        out[dc] = max(out.get(dc, 0.0), cpu)
    return out


def watch(
    cpu: Mapping[str, float], streaks: Mapping[str, int], policy: BusyNode
) -> tuple[dict[str, int], dict[str, float], bool]:
    """The streaks after a tick that measured ``cpu`` (ticks in a row over the threshold, by
    datacenter), the busy datacenters with their CPU %, and whether one became busy now."""
    after = {dc: streaks.get(dc, 0) + 1 for dc, c in cpu.items() if c > policy.cpu_percent}
    busy = {dc: cpu[dc] for dc, n in after.items() if n >= policy.ticks}
    became = any(n == policy.ticks for n in after.values())
    return after, busy, became


@dataclass(frozen=True)
class Placed:
    """Where the plan's workers run on the cluster spec, and how busy each node measured."""

    topo: Topology
    node_of: dict[tuple[int, int], int]  # (stage, replica) -> the node of its first device
    cpu: dict[int, float]  # node -> its CPU % as its workers measured it (the busiest reading)


def numbered_on(cp: Any) -> ClusterSpec | None:
    """The cluster spec the deployed plan of control plane ``cp`` is numbered on: the spec cut
    to the devices online when a shrink or a resize placed it there (its ``resized_plans``,
    :class:`~..training.online.ResizedPlans`), else the plan's cluster spec. Its nodes are the
    ones the plan's devices are on, and none of them is a lost one."""
    return numbered_spec(cp, cp.plan)


def placed(
    plan: Plan, cluster: ClusterSpec, telemetry: Mapping[str, Mapping[str, float | None]]
) -> Placed | None:
    """The plan's workers on ``cluster``'s nodes (None when the plan's devices are not the
    spec's: another spec's numbering, :mod:`..training.online`)."""
    topo = Topology(cluster)
    node_of: dict[tuple[int, int], int] = {}
    for st in plan.stages:
        for r, rep in enumerate(st.replicas):
            if not rep.devices or max(rep.devices) >= len(topo.devices):
                return None
            dev = topo.devices[rep.devices[0]]
            if topo.dc_names[dev.dc] != rep.datacenter:
                return None
            node_of[(st.index, r)] = dev.node
    cpu: dict[int, float] = {}
    for name, use in telemetry.items():
        stage, _, replica = name.partition("/")
        node_cpu = use.get("node_cpu_percent")
        if node_cpu is None or not stage.isdigit() or not replica.isdigit():
            continue
        node = node_of.get((int(stage), int(replica)))
        if node is not None:
            cpu[node] = max(cpu.get(node, 0.0), node_cpu)
    return Placed(topo, node_of, cpu)


def replica_compute(traces: Sequence[StepTrace], microbatches: int) -> dict[tuple[int, int], float]:
    """Each stage replica's compute seconds per micro-batch (its forward and backward spans, or
    its ``compute_s`` without spans), median over its traced steps."""
    samples: dict[tuple[int, int], list[float]] = {}
    for t in traces:
        spent = sum(b - a for _, _, a, b in t.spans) if t.spans else t.compute_s
        if spent > 0:
            samples.setdefault((t.stage, t.replica), []).append(spent / max(1, microbatches))
    return {k: statistics.median(v) for k, v in samples.items()}


def _idle_node(where: Placed, plan: Plan, key: tuple[int, int], limit: float) -> int | None:
    """The idlest node of the replica's datacenter with room for it (module docstring)."""
    topo, busy_node = where.topo, where.node_of[key]
    rep = plan.stages[key[0]].replicas[key[1]]
    dev = topo.devices[rep.devices[0]]
    taken = devices_in_use(plan)
    fits = []
    for n in topo.nodes:
        if n.index == busy_node or n.dc != dev.dc:
            continue
        if topo.devices[n.first_device].type_name != dev.type_name:
            continue
        free = [d for d in range(n.first_device, n.first_device + n.devices) if d not in taken]
        load = where.cpu.get(n.index)
        if len(free) >= len(rep.devices) and (load is None or load <= limit):
            fits.append((int((load or 0.0) // IDLE_BAND), len(free), n.index))
    return min(fits)[2] if fits else None


def idle_compute(
    kept: Mapping[Baseline, float],
    plan: Plan,
    cluster: ClusterSpec,
    telemetry: Mapping[str, Mapping[str, float | None]],
    traces: Sequence[StepTrace],
    policy: BusyNode,
) -> dict[Baseline, float]:
    """``kept`` with the compute per micro-batch of each stage replica over its traced steps
    whose node CPU % was at or under ``policy``'s threshold (each step's own reading, so that
    the steps of a node turning busy are not counted idle): what it does on an idle node, the
    reference of a move once its node is busy, when no other replica of its stage is on an
    idle node to compare with. Kept by the replica and its layers (a re-cut starts afresh)."""
    out = dict(kept)
    if placed(plan, cluster, telemetry) is None:  # another spec's numbering: not this plan's
        return out
    limit = policy.cpu_percent
    calm = [t for t in traces if t.node_cpu_percent is not None and t.node_cpu_percent <= limit]
    for key, per_mb in replica_compute(calm, plan.job.microbatches).items():
        if key[0] < len(plan.stages) and key[1] < len(plan.stages[key[0]].replicas):
            out[_baseline_key(plan, key)] = per_mb
    return out


def _baseline_key(plan: Plan, key: Key) -> Baseline:
    return key[0], key[1], json.dumps(plan.stages[key[0]].chunks)


def _reference(
    plan: Plan,
    key: tuple[int, int],
    compute: Mapping[tuple[int, int], float],
    idle: set[Key],
    baseline: Mapping[Baseline, float],
) -> tuple[float, str] | None:
    """What the replica's compute per micro-batch would be on an idle node, and its basis
    (``idle``: the stage replicas on nodes measured under the threshold; ``baseline``: what
    each replica measured when its node was last idle, :func:`idle_compute`)."""
    stage = key[0]
    same = [t for k, t in compute.items() if k[0] == stage and k in idle]
    if same:
        return statistics.median(same), f"stage {stage}'s replicas on idle nodes"
    own = baseline.get(_baseline_key(plan, key))
    if own is not None:
        return own, "its own steps while its node was under the threshold"
    planned = plan.stages[stage].microbatch_s
    ratios = [
        t / plan.stages[k[0]].microbatch_s
        for k, t in compute.items()
        if k in idle and plan.stages[k[0]].microbatch_s > 0
    ]
    if not ratios or planned <= 0:
        return None
    ratio = statistics.median(ratios)
    basis = (
        f"the plan's {planned * 1e3:.1f} ms for the stage times {ratio:.2f}, as the stages on "
        "idle nodes measured against the plan"
    )
    return planned * ratio, basis


def node_moves(
    plan: Plan,
    cluster: ClusterSpec,
    telemetry: Mapping[str, Mapping[str, float | None]],
    busy: Mapping[str, float],
    policy: BusyNode,
    traces: Sequence[StepTrace],
    step_s: float | None,
    faults: tuple[FaultInfo, ...] = (),
    baseline: Mapping[Baseline, float] | None = None,
    start_s: float | None = None,
) -> list[Proposal]:
    """The ``move-node`` of each stage replica on a node over ``policy``'s threshold in a
    ``busy`` datacenter to the idlest node of that datacenter with room for it, with its gain
    per step on the measured ``traces`` and its cost (module docstring); a ``keep`` note when
    an idle node has room but nothing measured says what the replica would do there."""
    where = placed(plan, cluster, telemetry) if busy else None
    if where is None:
        return []
    limit, m = policy.cpu_percent, plan.job.microbatches
    compute = replica_compute(traces, m)
    # a replica's time on its busy node: its steps that measured the node over the threshold
    # (the window's earlier steps, before the node turned busy, would hide the slowdown)
    hot = [t for t in traces if t.node_cpu_percent is not None and t.node_cpu_percent > limit]
    on_busy = replica_compute(hot, m)
    idle = {k for k, n in where.node_of.items() if n in where.cpu and where.cpu[n] <= limit}
    out: list[Proposal] = []
    for key, node in sorted(where.node_of.items()):
        dc = plan.stages[key[0]].replicas[key[1]].datacenter
        if dc not in busy or where.cpu.get(node, 0.0) <= limit:
            continue
        to = _idle_node(where, plan, key, limit)
        if to is None:
            continue
        target = f"stage {key[0]} replica {key[1]}: node {node} -> node {to} in {dc}"
        at = f"node {node} of {dc} is busy ({where.cpu[node]:.0f}% CPU, over {limit:g}%)"
        there = where.cpu.get(to)
        idle_at = f"{there:.0f}% CPU" if there is not None else "none of the run's workers"
        ref = _reference(plan, key, compute, idle, baseline or {})
        if key not in compute or ref is None:
            lacks = (
                f"stage {key[0]} replica {key[1]}'s steps traced no compute"
                if key not in compute
                else "no idle node measured a stage to compare with"
            )
            why = f"{at}; node {to} is idle ({idle_at}), but {lacks}: not moved"
            out.append(Proposal(MODULE, "keep", target, why))
            continue
        now, (then, basis) = on_busy.get(key, compute[key]), ref
        others = max((t for k, t in compute.items() if k != key), default=0.0)
        gain = m * max(0.0, now - max(then, others))
        cost, parts = move_cost_s(plan, plan.stages[key[0]].layers, None, faults, start_s)
        current = step_s if step_s else m * max(compute.values())
        reason = (
            f"{at}: stage {key[0]} replica {key[1]} computes {now * 1e3:.1f} ms a micro-batch "
            f"there against {then * 1e3:.1f} ms on an idle node ({basis}); node {to} of {dc} "
            f"is idle ({idle_at}); the move costs {cost:.1f} s (checkpoint, restart)"
        )
        details = {
            "node": {"stage": key[0], "replica": key[1], "datacenter": dc, "from": node,
                     "to": to, "from_cpu_percent": where.cpu[node], "to_cpu_percent": there},
            "compute_s": {"now": now, "idle": then, "slowest_other": others},
            "cost_parts_s": parts,
            "busy": dict(busy),
        }  # fmt: skip
        out.append(Proposal(MODULE, "move-node", target, reason, gain, current, cost, details))
    return out
