"""The schedulers x loads x seeds experiment (``dmsc simulate`` and the benchmarks) as a library
call: each of its runs is the run the engine gives alone for that scheduler, load and seed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dmsc.sim import OpticalNetwork, build_profiles, load_scenario, run, summarize
from dmsc.sim.sweep import ScenarioInvalid, sweep

SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "nsfnet-cba.yaml"


def _figures(r):  # type: ignore[no-untyped-def]
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "wall_s"}


def test_a_sweep_is_its_runs_made_one_by_one() -> None:
    scenario, cluster = load_scenario(SCENARIO)
    seen: list[tuple[str, int]] = []
    got = sweep(
        scenario,
        cluster,
        ["baseline", "cba"],
        [0.5 * scenario.load_erlang, scenario.load_erlang],
        seeds=2,
        arrivals=40,
        progress=lambda what, done: seen.append((what, done)),
    )
    profiles = build_profiles(cluster, scenario.jobs)
    for (name, load), runs in got.runs.items():
        alone = [
            run(
                scenario,
                profiles,
                lambda: OpticalNetwork.for_scenario(scenario, cluster),
                name,
                load,
                scenario.seed + k,
                40,
            )
            for k in range(2)
        ]
        assert [_figures(r) for r in runs] == [_figures(r) for r in alone]
        assert got.summaries[(name, load)]["blocked"] == summarize(alone)["blocked"]
    assert len(got.runs) == 4 and got.arrivals == 40
    # one description per run, then the arrivals done so far, up to all of them
    first = f"baseline at {0.5 * scenario.load_erlang:g} Erlang, seed 0"
    assert next(w for w, _ in seen if w) == first
    assert sum(1 for w, _ in seen if w) == 8 and max(d for _, d in seen) == 8 * 40
    out = got.to_dict()
    assert set(out["schedulers"]) == {"baseline", "cba"}
    assert set(out["relative_to_baseline_pct"]["cba"]) == {
        f"{0.5 * scenario.load_erlang:g}",
        f"{scenario.load_erlang:g}",
    }


def test_a_sweep_refuses_what_it_cannot_run() -> None:
    scenario, cluster = load_scenario(SCENARIO)
    with pytest.raises(ValueError, match="unknown scheduler 'nope'"):
        sweep(scenario, cluster, ["nope"])
    with pytest.raises(ValueError, match="positive"):
        sweep(scenario, cluster, ["baseline"], seeds=0)
    huge = scenario.jobs[0].model_copy(update={"pp": 10_000})
    too_big = scenario.model_copy(update={"jobs": [huge]})
    with pytest.raises(ScenarioInvalid, match=r"jobs\[0\]: .* does not fit the devices"):
        sweep(too_big, cluster, ["baseline"])
