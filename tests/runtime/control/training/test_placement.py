"""Where a plan's workers run on this machine: packed onto the cores its cluster spec's devices
share (:func:`dmsc.runtime.control.training.placement.packed_cpus`), checked against every
assignment of the stages to the cores (brute force)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.compute import cpuset
from dmsc.runtime.control.training.placement import packed_cpus, plan_cpus
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[4]
LOCAL = ROOT / "examples" / "clusters" / "local-cpu.yaml"
MODEL = resolve_model("gpt-mini")


def demo_plan(spec: ClusterSpec | None = None) -> Plan:
    """The CPU demo's plan: gpt-mini, pp = 3, one replica a stage."""
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    return plan_job(spec or load_spec(ClusterSpec, LOCAL), MODEL, job, fixed=True).plan


def with_loads(plan: Plan, loads: list[float]) -> Plan:
    """``plan`` with its stages' predicted micro-batch times replaced, one stage per load."""
    base = plan.stages[0]
    stages = [
        base.model_copy(update={"index": i, "microbatch_s": load}) for i, load in enumerate(loads)
    ]
    return plan.model_copy(update={"stages": stages})


def makespan(plan: Plan, cpus: dict[tuple[int, int], list[int]], cores: list[int]) -> float:
    load = dict.fromkeys(cores, 0.0)
    for st in plan.stages:
        (core,) = cpus[(st.index, 0)]
        load[core] += st.microbatch_s
    return max(load.values())


def best(loads: list[float], cores: int) -> float:
    """The least busiest-core load over every assignment of the loads to the cores."""
    out = float("inf")
    for assign in itertools.product(range(cores), repeat=len(loads)):
        per = [0.0] * cores
        for load, c in zip(loads, assign, strict=True):
            per[c] += load
        out = min(out, max(per))
    return out


def test_the_demo_s_busiest_stage_gets_a_core_of_its_own_and_the_packing_is_the_best() -> None:
    plan = demo_plan()
    cpus = packed_cpus(plan, [0, 1])
    busiest = max(plan.stages, key=lambda st: st.microbatch_s).index
    assert set(cpus) == {(0, 0), (1, 0), (2, 0)}
    assert [k for k, v in cpus.items() if v == cpus[(busiest, 0)]] == [(busiest, 0)]
    loads = [st.microbatch_s for st in plan.stages]
    assert makespan(plan, cpus, [0, 1]) == pytest.approx(best(loads, 2))


@pytest.mark.parametrize(
    ("loads", "cores"),
    [([5, 4, 3, 3, 3], 2), ([7, 6, 5, 4, 3, 2], 3), ([1, 1, 1, 1, 1], 2), ([9, 1, 1, 1], 2)],
)
def test_the_packing_is_within_graham_s_bound_of_the_best_assignment(
    loads: list[float], cores: int
) -> None:
    """Longest first to the least loaded core is at most 4/3 - 1/(3 m) of the best (Graham,
    1969); the cores named are the ones used."""
    plan = with_loads(demo_plan(), loads)
    named = [5, 7, 9][:cores]
    cpus = packed_cpus(plan, named)
    assert {c for v in cpus.values() for c in v} <= set(named)
    bound = 4 / 3 - 1 / (3 * cores)
    assert makespan(plan, cpus, named) <= bound * best(loads, cores) + 1e-12


def test_nothing_is_packed_where_the_workers_fit_or_a_replica_is_not_one_cpu_process() -> None:
    plan = demo_plan()
    assert packed_cpus(plan, [0, 1, 2]) == {}  # a core each: the scheduler's
    assert packed_cpus(plan, []) == {}
    tp2 = plan.model_copy(update={"job": plan.job.model_copy(update={"tp": 2})})
    assert packed_cpus(tp2, [0, 1]) == {}  # a replica's ranks would share one core
    st = plan.stages[1]
    on_gpu = st.model_copy(
        update={"replicas": [st.replicas[0].model_copy(update={"device": "cuda:0"})]}
    )
    gpu = plan.model_copy(update={"stages": [plan.stages[0], on_gpu, plan.stages[2]]})
    assert packed_cpus(gpu, [0, 1]) == {}


def test_plan_cpus_packs_only_for_workers_on_this_machine_on_a_spec_of_shared_cores() -> None:
    spec = load_spec(ClusterSpec, LOCAL)
    shared = spec.model_copy(update={"shared_cores": 1})
    plan = demo_plan(spec)
    mine = sorted(cpuset.available() or [])
    assert plan_cpus(plan, spec, pack=True) == {}  # not a spec of shared cores
    assert plan_cpus(plan, shared, pack=False) == {}  # another machine's launcher
    # this machine's cores, whatever the spec's count (a spec of a smaller machine confines
    # nothing): packed where the three workers outnumber them
    assert plan_cpus(plan, shared, pack=True) == packed_cpus(plan, mine)
    # a spec that pins its nodes keeps its own cores
    doc = shared.model_dump(exclude_none=True)
    for dc in doc["datacenters"]:
        dc["nodes"][0]["cpus"] = [0]
    pinned = ClusterSpec.model_validate(doc)
    assert plan_cpus(plan, pinned, pack=True) == {(s, 0): [0] for s in range(3)}
