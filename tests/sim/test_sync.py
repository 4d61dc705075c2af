"""Jobs whose replicas synchronise once per round of local steps, in the simulator: placed as
islands of whole pipelines, the round's exchange their only traffic between datacenters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, build_layer_costs
from dmsc.netmodel.iteration import assign_stage_layers
from dmsc.netmodel.sync import HostSide, model_payload, work_s
from dmsc.sim import SCHEDULERS, OpticalNetwork, build_profiles, load_scenario, run
from dmsc.sim.profile import IslandProfile, JobProfile
from dmsc.sim.scenario import JobTypeSpec, ScenarioSpec, with_sync
from dmsc.sim.schedulers import release
from dmsc.spec import JobSpec, SyncSpec, parse_compress, resolve_model

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml"


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    return load_scenario(SCENARIO)


def _profile(setup, index: int, sync: str | None) -> JobProfile:  # type: ignore[no-untyped-def]
    scenario, cluster = setup
    jobs = scenario.jobs[index : index + 1]
    if sync is not None:
        jobs = with_sync(jobs, SyncSpec.model_validate(sync).model_dump())
    return build_profiles(cluster, jobs)[0]


def test_islands_of_a_diloco_job(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, _ = setup
    jt = scenario.jobs[3]  # llama3-70b, pp 8, tp 8, dp 4
    pipeline = _profile(setup, 3, None)
    islands = _profile(setup, 3, {"mode": "diloco", "inner_steps": 50, "compress": "int8"})
    assert isinstance(islands, IslandProfile) and not isinstance(pipeline, IslandProfile)
    assert islands.units == math.gcd(jt.dp, jt.pp) == 4
    assert islands.unit_gpus * islands.units == pipeline.stage_gpus * pipeline.pp
    assert islands.step_s == pipeline.nominal_s == islands.nominal_s
    model = resolve_model(jt.model)
    job = JobSpec(global_batch=jt.global_batch, tp=jt.tp, pp=jt.pp, dp=jt.dp)
    stages = assign_stage_layers(build_layer_costs(model, job), job)
    payload = model_payload(stages, 2, parse_compress("int8"), jt.tp)
    assert islands.boundary_bytes == payload
    assert payload == pytest.approx(70.6e9 * (1 + 4 / 256), rel=0.01)  # the whole model, int8


def test_an_island_exchange_carries_its_codecs_passes(setup) -> None:  # type: ignore[no-untyped-def]
    """The round's exchange between islands adds the codec's passes over one device's update
    (the largest stage's), as the estimate and the planner's island plans price them: int8's
    ring among the 4 islands of llama3-70b's diloco:50; nothing for updates sent as they are."""
    scenario, cluster = setup
    jt = scenario.jobs[3]
    sync = SyncSpec.model_validate({"mode": "diloco", "inner_steps": 50, "compress": "int8"})
    p = _profile(setup, 3, sync.model_dump())
    assert isinstance(p, IslandProfile)
    model = resolve_model(jt.model)
    job = JobSpec(global_batch=jt.global_batch, tp=jt.tp, pp=jt.pp, dp=jt.dp)
    stages = assign_stage_layers(build_layer_costs(model, job), job)
    elements = max(sum(lc.params_per_device for lc in ms) for ms in stages)
    device = next(iter(cluster.device_types.values()))
    assert device.runtime_device == "cuda"  # the codec runs on the host: its memory, its link
    dc = DEFAULT_CALIBRATION.for_device(device)
    host = HostSide(dc.host_memory_bytes_s, dc.host_copy_bytes_s)
    assert p.work_s == pytest.approx(work_s(sync, 4, elements, host)) and p.work_s > 0
    slow = p.bottleneck_s + 1.0
    assert p.iteration_s([slow], [0.002]) == pytest.approx(
        p.step_s + (slow + 2 * 0.002 + p.work_s - p.bottleneck_s) / 50
    )
    plain = _profile(setup, 3, "diloco:50")
    assert isinstance(plain, IslandProfile) and plain.work_s == 0.0


def test_island_iteration_by_hand(setup) -> None:  # type: ignore[no-untyped-def]
    p = _profile(setup, 0, "diloco:10")
    assert isinstance(p, IslandProfile)
    window = 10 * p.step_s
    assert p.bottleneck_s == window
    assert p.iteration_s([window / 2, 0.001], [0.003, 0.0]) == p.step_s  # hidden
    slow = window + 4.0
    assert p.iteration_s([slow, 1.0], [0.003, 0.0]) == pytest.approx(
        p.step_s + (slow + 2 * 0.003 - window) / 10
    )
    assert p.needed_gbit_s() == pytest.approx(p.boundary_bytes * 8 / window / 1e9)


def test_a_diloco_job_crossing_datacenters_needs_far_fewer_slots(setup) -> None:  # type: ignore[no-untyped-def]
    """The issue's check: gpt3-13b on 512 GPUs spans two datacenters. Every step, its pipeline
    boundary carries activations each micro-batch and the CBA policy gives it every slot it may
    take (still a bubble); with diloco:50 one slot carries the round's exchange, hidden."""
    scenario, cluster = setup
    used: dict[str, tuple[int, float, float]] = {}
    for sync in ("every-step", "diloco:50"):
        profile = _profile(setup, 1, sync)
        net = OpticalNetwork.for_scenario(scenario, cluster)
        sched = SCHEDULERS["cba"](scenario)
        adm = sched.admit(net, profile, 0)
        assert adm.job is not None
        crossing = [t for t in adm.job.transfers if t.src != t.dst]
        assert crossing  # 512 GPUs do not fit one datacenter of 256
        sched.update(net, [adm.job])
        used[sync] = (net.grid.used_slots(), adm.job.iteration_s(), profile.nominal_s)
        release(net, adm.job)
    slots_every, it_every, nominal_every = used["every-step"]
    slots_diloco, it_diloco, nominal_diloco = used["diloco:50"]
    assert slots_diloco * 10 <= slots_every
    assert it_every > nominal_every  # a DCI-induced bubble
    assert it_diloco == nominal_diloco == nominal_every  # none


def test_scenario_sync_goes_to_the_job_types_without_their_own() -> None:
    jobs = [
        {"model": "gpt3-13b", "pp": 8, "tp": 2, "dp": 32, "global_batch": 512, "iterations": 9},
        {"model": "llama3-8b", "pp": 8, "tp": 2, "dp": 32, "global_batch": 512, "iterations": 9,
         "sync": "every-step"},
    ]  # fmt: skip
    s = ScenarioSpec.model_validate(
        {"cluster": "x.yaml", "load_erlang": 1, "jobs": jobs, "sync": "fedavg:20"}
    )
    assert s.jobs[0].sync == SyncSpec(mode="fedavg", inner_steps=20)
    assert s.jobs[1].sync == SyncSpec()
    built = ScenarioSpec(
        cluster="x.yaml",
        load_erlang=1,
        jobs=[JobTypeSpec.model_validate(j) for j in jobs],
        sync=SyncSpec(mode="diloco", inner_steps=5),
    )
    assert [j.sync.label for j in built.jobs] == ["diloco:5", "every-step"]


def test_every_step_is_the_simulation_as_it_was(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster = setup
    explicit = scenario.model_copy(
        update={"jobs": with_sync(scenario.jobs, {"mode": "every-step"})}
    )
    for name in SCHEDULERS:
        a, b = (
            run(
                s,
                build_profiles(cluster, s.jobs),
                lambda s=s: OpticalNetwork.for_scenario(s, cluster),
                name,
                arrivals=120,
                seed=2,
            )
            for s in (scenario, explicit)
        )
        assert (a.blocked, a.iteration_times, a.spectrum_utilization) == (
            b.blocked,
            b.iteration_times,
            b.spectrum_utilization,
        )


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_hold_what_island_jobs_claim(setup, name: str) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster = setup
    jobs = with_sync(scenario.jobs, {"mode": "diloco", "inner_steps": 50})
    profiles = build_profiles(cluster, jobs)
    net = OpticalNetwork.for_scenario(scenario, cluster)
    sched = SCHEDULERS[name](scenario)
    admitted = []
    for i in range(12):
        adm = sched.admit(net, profiles[i % len(profiles)], i)
        if adm.job is None:
            continue
        job = adm.job
        assert len(job.dcs) == job.profile.units and len(job.transfers) == job.profile.units - 1
        if name != "joint":  # islands sorted: one crossing per datacenter changed
            assert job.dcs == sorted(job.dcs)
        admitted.append(job)
        sched.update(net, admitted)
        net.grid.check()
    assert admitted
    used = sum(j.profile.unit_gpus * j.profile.units for j in admitted)
    assert sum(net.gpus_total) - sum(net.gpus_free) == used
    for job in admitted:
        release(net, job)
    assert net.gpus_free == net.gpus_total and net.grid.used_slots() == 0


def test_diloco_jobs_block_less_and_wait_less(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster = setup
    local = scenario.model_copy(
        update={"jobs": with_sync(scenario.jobs, {"mode": "diloco", "inner_steps": 50})}
    )
    for name in ("baseline", "cba"):
        every, diloco = (
            run(
                s,
                build_profiles(cluster, s.jobs),
                lambda s=s: OpticalNetwork.for_scenario(s, cluster),
                name,
                arrivals=300,
                seed=1,
            )
            for s in (scenario, local)
        )
        assert diloco.mean_iteration_time_s < every.mean_iteration_time_s
        assert diloco.blocking_probability < every.blocking_probability
        assert diloco.bubble_ratio < every.bubble_ratio
