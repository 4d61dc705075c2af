"""A busy node: a stage's worker on a node whose CPU stays over the policy's threshold, found by
the tick and handed to path optimisation, which may move the stage away.

The node's CPU % (all its cores: another job on the machine counts, not only the workers) comes
with each training step's trace (:mod:`dmsc.runtime.compute.telemetry`), and the snapshot keeps
each worker's mean over its last steps (:func:`.snapshot.telemetry`). Pure functions here:

- :func:`datacenter_cpu`: each datacenter's busiest node among those its stage workers run on;
- :func:`watch`: a datacenter over ``busy.cpu_percent`` (the policy's,
  :class:`.objectives.BusyNode`) on ``busy.ticks`` ticks in a row is busy; the streaks are kept
  in the tick's state.

When one becomes busy the tick runs the modules (at once, then at the re-plan's own cadence:
:func:`.tick.modules_due`) with the busy datacenters in their measurements. Path optimisation
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

Not covered: a move to an idle node of the same datacenter (the planner places stages on
datacenters; the devices inside one are the layout's), so a datacenter of one busy node and one
idle node is busy only when the busiest node of its stage workers is.
"""

from __future__ import annotations

from collections.abc import Mapping

from dmsc.planner.plan import Plan
from dmsc.runtime.control.loop.objectives import BusyNode


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
