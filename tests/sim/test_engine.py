from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dmsc.sim import SCHEDULERS, OpticalNetwork, build_profiles, load_scenario, run
from dmsc.sim.profile import JobProfile
from dmsc.sim.schedulers import RunningJob, Transfer, release
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from conftest import DmscRunner

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml"


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    scenario, cluster = load_scenario(SCENARIO)
    profiles = build_profiles(cluster, scenario.jobs)
    return scenario, cluster, profiles


def _factory(cluster, k):  # type: ignore[no-untyped-def]
    return lambda: OpticalNetwork.from_cluster(cluster, k)


def test_same_seed_same_numbers(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster, profiles = setup
    for name in SCHEDULERS:
        a = run(scenario, profiles, _factory(cluster, scenario.k_paths), name, arrivals=150, seed=4)
        b = run(scenario, profiles, _factory(cluster, scenario.k_paths), name, arrivals=150, seed=4)
        assert (a.blocked, a.iteration_times, a.spectrum_utilization) == (
            b.blocked,
            b.iteration_times,
            b.spectrum_utilization,
        )
    c = run(
        scenario, profiles, _factory(cluster, scenario.k_paths), "baseline", arrivals=150, seed=5
    )
    assert c.iteration_times != a.iteration_times or c.blocked != a.blocked


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_conformance(setup, name: str) -> None:  # type: ignore[no-untyped-def]
    """Admit until blocked, check every admitted job holds what it claims, release all."""
    scenario, cluster, profiles = setup
    net = OpticalNetwork.for_scenario(scenario, cluster)
    sched = SCHEDULERS[name](scenario)
    assert sched.name == name
    admitted: list[RunningJob] = []
    for i in range(12):
        adm = sched.admit(net, profiles[i % len(profiles)], i)
        assert adm.blocked_requests <= adm.requests
        if adm.job is None:
            assert adm.reason in ("gpu", "spectrum")
            continue
        job = adm.job
        assert len(job.dcs) == job.profile.pp and len(job.transfers) == job.profile.pp - 1
        for t in job.transfers:
            assert (t.src, t.dst) == (job.dcs[t.boundary], job.dcs[t.boundary + 1])
            assert (t.lightpath is None) == (t.src == t.dst)
        admitted.append(job)
        sched.update(net, admitted)
        net.grid.check()
    used = sum(j.profile.stage_gpus * j.profile.pp for j in admitted)
    assert sum(net.gpus_total) - sum(net.gpus_free) == used
    for job in admitted:
        release(net, job)
    assert net.gpus_free == net.gpus_total and net.grid.used_slots() == 0


def test_cb_labels_and_reprovisioning(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster, profiles = setup
    p: JobProfile = profiles[0]
    net = OpticalNetwork.for_scenario(scenario, cluster)
    job = RunningJob(0, p, [0, 1, 1, 1])
    t = Transfer(0, 0, 1)
    route = net.dc_routes(0, 1)[0]
    t.route, t.lightpath = route, net.grid.setup(route.links, 1)
    job.transfers = [t] + [Transfer(b, 1, 1) for b in (1, 2)]
    assert job.cb_labels() == [True, False, False]  # one slot cannot carry the boundary
    slow = job.iteration_s()
    SCHEDULERS["cba"](scenario).update(net, [job])
    assert t.lightpath is not None and t.lightpath.slots > 1
    assert job.cb_labels()[0] is False and job.iteration_s() < slow
    net.grid.check()


def test_iteration_model_by_hand(setup) -> None:  # type: ignore[no-untyped-def]
    p: JobProfile = setup[2][0]
    m, c = p.microbatches, p.compute_s
    x, d = [0.2, 0.01, 0.01], [0.012, 0.0, 0.0]
    expected = (
        (m - 1) * max(max(c), 0.2) + sum(c) + 2 * sum(a + b for a, b in zip(x, d, strict=True))
    )
    assert p.iteration_s(x, d) == pytest.approx(expected)


def test_cba_and_joint_beat_baseline(setup) -> None:  # type: ignore[no-untyped-def]
    scenario, cluster, profiles = setup
    res = {
        n: run(scenario, profiles, _factory(cluster, scenario.k_paths), n, arrivals=400)
        for n in SCHEDULERS
    }
    assert res["cba"].mean_iteration_time_s < res["baseline"].mean_iteration_time_s
    assert res["cba"].blocking_probability < res["baseline"].blocking_probability
    assert res["joint"].mean_iteration_time_s < res["cba"].mean_iteration_time_s


def test_bad_scenarios(tmp_path: Path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text(SCENARIO.read_text().replace("../clusters/nsfnet-4dc.yaml", "nope.yaml"))
    with pytest.raises(SpecError, match="cluster"):
        load_scenario(bad)
    bad.write_text(SCENARIO.read_text().replace("model: gpt3-13b", "model: gpt9"))
    (tmp_path / "clusters").mkdir()
    with pytest.raises(SpecError):
        load_scenario(bad)
    bad2 = tmp_path / "t.yaml"
    bad2.write_text(SCENARIO.read_text().replace("load_erlang: 2", "load_erlang: -1"))
    with pytest.raises(SpecError, match="load_erlang"):
        load_scenario(bad2)


@pytest.mark.integration
def test_simulate_command(tmp_path: Path, dmsc: DmscRunner) -> None:
    png, csv_path = tmp_path / "b.png", tmp_path / "r.csv"
    res = dmsc(
        "simulate",
        "--scenario",
        str(SCENARIO),
        "--compare",
        "baseline,cba",
        "--loads",
        "1,2",
        "--seeds",
        "2",
        "--arrivals",
        "120",
        "--plot",
        str(png),
        "--csv",
        str(csv_path),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for name in ("baseline", "cba"):
        for load in ("1", "2"):
            s = out["schedulers"][name][load]
            for key in (
                "blocking_probability",
                "mean_iteration_time_s",
                "p95_iteration_time_s",
                "spectrum_utilization",
                "gpu_utilization",
                "arrivals",
                "blocked",
                "wall_s",
            ):
                assert key in s
    assert "cba" in out["relative_to_baseline_pct"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(csv_path.read_text().splitlines()) == 1 + 2 * 2 * 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--scheduler", "magic"], "unknown scheduler"),
        (["--loads", "a,b"], "--loads"),
        (["--seeds", "0"], "--seeds"),
        (["--loads", "-1"], "--loads"),
    ],
)
@pytest.mark.integration
def test_simulate_bad_flags(args: list[str], needle: str, dmsc: DmscRunner) -> None:
    res = dmsc("simulate", "--scenario", str(SCENARIO), *args)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr
