"""The RMSA experiment (``dmsc simulate --lightpaths``) as a library call: its figures are those
of the runs made one by one, and a bad setting is named by its field."""

from __future__ import annotations

import pytest

from dmsc.netmodel.optical import modulation_table
from dmsc.sim.lightpath_experiment import (
    LightpathSettings,
    SettingInvalid,
    run_experiment,
)
from dmsc.sim.metrics import mean_ci
from dmsc.sim.rmsa import BitRates, simulate_lightpaths
from dmsc.sim.topologies import topology


def test_the_experiment_is_its_runs_made_one_by_one() -> None:
    s = LightpathSettings(
        loads=(150.0, 300.0), requests=400, warmup=100, seeds=2, fits=("first", "best")
    )
    seen: list[tuple[str, int]] = []
    got = run_experiment(s, lambda what, done: seen.append((what, done)))
    topo, table = topology("nsfnet"), modulation_table("dmsc")
    for fit in s.fits:
        for row, load in zip(got.figures["fits"][fit], s.loads, strict=True):
            alone = [
                simulate_lightpaths(
                    topo.network(100, 5, table, 1, seed), load, 500, seed=seed,
                    gbit_s=BitRates.parse(s.bitrate), fit=fit, warmup=100, sample_every=4,
                )
                for seed in range(2)
            ]  # fmt: skip
            assert (row["service_blocking"], row["ci95"]) == mean_ci([r.blocking for r in alone])
            assert row["requests"] == sum(r.requests for r in alone)
    assert got.figures["loads"] == got.figures["fits"]["first"]
    assert set(got.traces) == {"first", "best"} and got.snapshot is not None
    assert got.snapshot[:2] == ("first", 300.0) and got.snapshot_at == 100 + 200
    assert [d for w, d in seen if w] == list(range(8)) and seen[-1] == ("", 8)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"slots": 0}, "slots"),
        ({"guard_band": 100}, "guard_band"),
        ({"fits": ("worst",)}, "fits"),
        ({"bitrate": "nonsense"}, "bitrate"),
        ({"topology": "atlantis"}, "topology"),
        ({"snapshot_at": 10**9}, "snapshot_at"),
    ],
)
def test_a_bad_setting_is_named_by_its_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(SettingInvalid) as err:
        run_experiment(LightpathSettings(**change))  # type: ignore[arg-type]
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")
