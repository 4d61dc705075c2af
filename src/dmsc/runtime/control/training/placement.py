"""Where a plan's stage replicas run: the device and the cores of each (stage, replica).

Read of the plan alone (and of the cluster spec its nodes are numbered on), with nothing of
torch or of the deployment imported, so that ``dmsc up`` checks a plan's devices before it
starts anything at the cost of reading the plan (:func:`dmsc.cli.preflight.check_plan_devices`:
importing the training session for these took the command 3.3 s of CPU, torch's import).
"""

from __future__ import annotations

from dmsc.planner.plan import Plan
from dmsc.runtime.compute import cpuset
from dmsc.spec import ClusterSpec


def plan_devices(plan: Plan, device: str = "plan") -> dict[tuple[int, int], str]:
    """Where each (stage, replica) of ``plan`` runs: as the plan says (``plan``: its GPU on its
    node, or the CPU), all on the CPU (``cpu``), or all on one GPU (``cuda``, ``cuda:N``)."""
    return {
        (st.index, r): (rep.device if device == "plan" else device)
        for st in plan.stages
        for r, rep in enumerate(st.replicas)
    }


def plan_cpus(
    plan: Plan, spec: ClusterSpec | None, pack: bool = False
) -> dict[tuple[int, int], list[int]]:
    """The cores each (stage, replica) of ``plan`` runs on: its nodes' ``cpus`` in ``spec``
    (the spec the plan's nodes are numbered on; :mod:`dmsc.runtime.compute.cpuset`), for the
    replicas whose nodes all have them. With ``pack`` (the local launcher: the workers run on
    this machine), a spec whose devices share one machine's cores (``shared_cores``) and pins
    no node has its workers packed onto the cores this process may run on, this machine's
    (:func:`packed_cpus`; not the spec's count: a spec calibrated on a smaller machine does not
    confine a larger one)."""
    if spec is None:
        return {}
    node_cpus = spec.node_cpus()
    if pack and spec.shared_cores and not any(node_cpus):
        mine = cpuset.available()
        return packed_cpus(plan, sorted(mine) if mine else [])
    out = {}
    for st in plan.stages:
        for r, rep in enumerate(st.replicas):
            sets = [node_cpus[n] if n < len(node_cpus) else None for n in rep.nodes]
            if sets and all(sets):
                out[(st.index, r)] = sorted({c for cpus in sets for c in cpus or ()})
    return out


def packed_cpus(plan: Plan, cores: list[int]) -> dict[tuple[int, int], list[int]]:
    """Each (stage, replica) of ``plan`` on one of ``cores`` when its workers outnumber them
    (empty: they do not, or a replica has several tensor-parallel ranks or is not on the CPU).

    Longest first, each to the least loaded core (its stage's predicted micro-batch time), ties
    to the lower stage and core: a worker process per core-share, as a cpuset would hold it.
    Measured on the CPU demo's plan (three stages on this project's two cores): left to the
    scheduler, the busiest stage was preempted by its neighbours and its spans grew by up to 8%
    from one deployment to the next (131-143 ms a step over six 200-step tasks); packed, it has
    a core of its own (124-131 ms, by hand and by this function)."""
    workers = [(st, r) for st in plan.stages for r in range(len(st.replicas))]
    if (
        not cores
        or len(workers) <= len(cores)
        or plan.job.tp > 1
        or any(rep.device != "cpu" for st in plan.stages for rep in st.replicas)
    ):
        return {}
    load = [0.0] * len(cores)
    out = {}
    for st, r in sorted(workers, key=lambda w: (-w[0].microbatch_s, w[0].index, w[1])):
        core = min(range(len(cores)), key=lambda c: (load[c], c))
        load[core] += st.microbatch_s
        out[(st.index, r)] = [cores[core]]
    return out
