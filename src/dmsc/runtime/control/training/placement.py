"""Where a plan's stage replicas run: the device and the cores of each (stage, replica).

Read of the plan alone (and of the cluster spec its nodes are numbered on), with nothing of
torch or of the deployment imported, so that ``dmsc up`` checks a plan's devices before it
starts anything at the cost of reading the plan (:func:`dmsc.cli.preflight.check_plan_devices`:
importing the training session for these took the command 3.3 s of CPU, torch's import).
"""

from __future__ import annotations

from dmsc.planner.plan import Plan
from dmsc.spec import ClusterSpec


def plan_devices(plan: Plan, device: str = "plan") -> dict[tuple[int, int], str]:
    """Where each (stage, replica) of ``plan`` runs: as the plan says (``plan``: its GPU on its
    node, or the CPU), all on the CPU (``cpu``), or all on one GPU (``cuda``, ``cuda:N``)."""
    return {
        (st.index, r): (rep.device if device == "plan" else device)
        for st in plan.stages
        for r, rep in enumerate(st.replicas)
    }


def plan_cpus(plan: Plan, spec: ClusterSpec | None) -> dict[tuple[int, int], list[int]]:
    """The cores each (stage, replica) of ``plan`` runs on: its nodes' ``cpus`` in ``spec``
    (the spec the plan's nodes are numbered on; :mod:`dmsc.runtime.compute.cpuset`), for the
    replicas whose nodes all have them."""
    if spec is None:
        return {}
    node_cpus = spec.node_cpus()
    out = {}
    for st in plan.stages:
        for r, rep in enumerate(st.replicas):
            sets = [node_cpus[n] if n < len(node_cpus) else None for n in rep.nodes]
            if sets and all(sets):
                out[(st.index, r)] = sorted({c for cpus in sets for c in cpus or ()})
    return out
