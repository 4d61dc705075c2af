"""The RMSA settings: bit-rate distributions, modulation tables, guard bands, the two blocking
figures; against closed forms (Erlang B) and the published table where one exists."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmsc.netmodel.optical import (
    MODULATION_TABLES,
    OPTICAL_RL_GYM,
    Modulation,
    ModulationTable,
    modulation_table,
)
from dmsc.sim import fragmentation
from dmsc.sim.fragmentation import external_fragmentation, spectrum_entropy
from dmsc.sim.network import OpticalNetwork
from dmsc.sim.rmsa import BitRates, erlang_b, simulate_lightpaths
from dmsc.sim.topologies import topology
from dmsc.spec import SpecError


def _one_link(slots: int, guard: int = 0) -> OpticalNetwork:
    return OpticalNetwork(
        sites=["a", "b"], link_ends=[("a", "b")], link_km=[100.0], n_slots=slots,
        slot_ghz=12.5, k_paths=1, dc_names=[], dc_sites=[], gpus_total=[], guard_band=guard,
    )  # fmt: skip


def test_bit_rates_parse_and_draw() -> None:
    rng = np.random.default_rng(0)
    uniform = BitRates.parse("uniform:25:100").draw(rng, 20_000)
    assert uniform.min() == 25 and uniform.max() == 100 and np.all(uniform == np.round(uniform))
    assert abs(uniform.mean() - 62.5) < 0.5
    weighted = BitRates.parse("100=1, 400=3").draw(rng, 20_000)
    assert set(np.unique(weighted)) == {100.0, 400.0}
    assert abs((weighted == 400).mean() - 0.75) < 0.02
    assert set(BitRates.parse("10,20").draw(rng, 100)) == {10.0, 20.0}
    for bad in ("uniform:5", "uniform:a:b", "uniform:9:3", "x=1", "10=-1", "", "-5"):
        with pytest.raises(ValueError):
            BitRates.parse(bad)


def test_the_optical_rl_gym_table() -> None:
    """BPSK 100,000 km, QPSK 2,000, 8QAM 1,000, 16QAM 500, 32QAM 250, 64QAM 125 (bits per
    symbol 1 to 6, 12.5 Gbit/s per bit per slot), as the issue quotes optical-rl-gym."""
    t = MODULATION_TABLES["optical-rl-gym"]
    picks = {km: (t.choose(km).name, t.gbit_s_per_slot(km)) for km in (100, 125, 126, 400, 900,
             1500, 2000, 2001, 99_000)}  # fmt: skip
    assert picks == {
        100: ("64QAM", 75.0), 125: ("64QAM", 75.0), 126: ("32QAM", 62.5), 400: ("16QAM", 50.0),
        900: ("8QAM", 37.5), 1500: ("QPSK", 25.0), 2000: ("QPSK", 25.0), 2001: ("BPSK", 12.5),
        99_000: ("BPSK", 12.5),
    }  # fmt: skip
    with pytest.raises(ValueError, match="beyond the reach"):
        t.choose(200_000)


def test_a_table_from_a_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "table.yaml"
    good.write_text(
        "name: short\nformats:\n  - {name: QPSK, bits_per_symbol: 2, max_km: 300}\n"
        "  - {name: 16QAM, bits_per_symbol: 4, max_km: 80}\n"
    )
    table = modulation_table(str(good))
    assert [m.name for m in table.formats] == ["16QAM", "QPSK"]  # most efficient first
    assert table.gbit_s_per_slot(50) == 50.0 and table.gbit_s_per_slot(200) == 25.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("formats:\n  - {name: QPSK, bits_per_symbol: 0, max_km: 300}\n")
    with pytest.raises(SpecError, match=r"bad.yaml: formats\[0\].bits_per_symbol"):
        modulation_table(str(bad))
    with pytest.raises(SpecError, match="neither a table"):
        modulation_table("nope")


def test_routes_beyond_every_reach_are_left_out() -> None:
    net = _one_link(10)
    net.link_km[0] = 600.0
    net.modulations = OPTICAL_RL_GYM
    assert [r.gbit_s_per_slot for r in net.routes("a", "b")] == [37.5]  # 8QAM to 1,000 km
    short = _one_link(10)
    short.link_km[0] = 3_000.0
    short.modulations = ModulationTable("metro", (Modulation("QPSK", 2, 2_000.0),))
    assert short.routes("a", "b") == ()  # no format reaches: every request is blocked
    r = simulate_lightpaths(short, 1.0, 200, gbit_s=(10.0,), pairs=[("a", "b")])
    assert r.blocking == 1.0


@pytest.mark.parametrize("load", [2.0, 4.0])
def test_a_guard_band_on_one_link_is_erlang_b_with_fewer_servers(load: float) -> None:
    """One 10-slot link, one slot per request and one guard slot each: five lightpaths fit, so
    blocking is Erlang B with 5 servers (the guard band's cost, in closed form)."""
    r = simulate_lightpaths(_one_link(10, guard=1), load, 40_000, seed=5, gbit_s=(12.5,),
                            pairs=[("a", "b")])  # fmt: skip
    expected = erlang_b(load, 5)
    se = math.sqrt(expected * (1 - expected) / r.requests)
    assert abs(r.blocking - expected) < 5 * se + 0.004
    assert r.bandwidth_blocking == pytest.approx(r.blocking)  # one bit rate: the same share


def test_bandwidth_blocking_weighs_large_requests_more() -> None:
    """With mixed sizes the large requests block more often, so the blocked share of Gbit/s
    exceeds the blocked share of requests; warm-up requests are not counted."""
    net = topology("nsfnet").network(100, 5, OPTICAL_RL_GYM, guard_band=1)
    r = simulate_lightpaths(net, 250, 6_000, seed=1, gbit_s=BitRates(uniform=(25, 100)),
                            warmup=2_000)  # fmt: skip
    assert r.requests == 4_000 and r.handled == 6_000
    assert 0 < r.blocking < r.bandwidth_blocking < 1
    assert r.us_per_request > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=100))
def test_fragmentation_figures_against_a_plain_count(free: list[bool]) -> None:
    """External fragmentation and entropy from the bit mask against the slot list's runs."""
    n = len(free)
    mask = sum(1 << s for s, f in enumerate(free) if f)
    cuts = [len(list(group)) for _, group in itertools.groupby(free)]
    free_runs = [len(list(g)) for f, g in itertools.groupby(free) if f]
    want_frag = 1 - max(free_runs) / sum(free_runs) if free_runs else 0.0
    want_ent = -sum(c / n * math.log(c / n) for c in cuts if c < n)
    assert external_fragmentation(mask) == pytest.approx(want_frag)
    assert spectrum_entropy(mask, n) == pytest.approx(want_ent)


def test_samples_and_snapshot_of_a_run() -> None:
    net = topology("nsfnet").network(100, 5, OPTICAL_RL_GYM, guard_band=1)
    r = simulate_lightpaths(net, 200, 3_000, seed=2, gbit_s=BitRates(uniform=(25, 100)),
                            warmup=1_000, sample_every=100, snapshot_at=2_000)  # fmt: skip
    assert len(r.samples) == 20 and r.samples[0].request == 1_000
    assert all(0 <= x.external_fragmentation < 1 and x.entropy >= 0 for x in r.samples)
    assert len(r.link_utilization) == 22 and all(0 <= u <= 1 for u in r.link_utilization)
    assert r.snapshot is not None and r.snapshot.shape == (22, 100)
    # at the end, the network's utilisation is the mean of its fibers'
    assert net.grid.utilization() == pytest.approx(
        float(np.mean(fragmentation.link_utilization(net.grid)))
    )


def test_a_required_osnr_limits_a_format_before_its_reach(tmp_path: Path) -> None:
    """OSNR = 58 + 0 dBm - 16 dB (80 km at 0.2 dB/km) - 5 dB NF - 10 log10(spans): 37 dB for one
    span, so 30 dB allows 10^0.7 = 5.01 spans, i.e. 400 km, though the format reaches 5,000."""
    f = tmp_path / "osnr.yaml"
    f.write_text(
        "formats:\n  - {name: 16QAM, bits_per_symbol: 4, max_km: 5000, min_osnr_db: 30}\n"
        "  - {name: QPSK, bits_per_symbol: 2, max_km: 5000}\n"
    )
    table = modulation_table(str(f))
    assert table.osnr.osnr_db(80) == pytest.approx(37.0)
    assert table.choose(400).name == "16QAM" and table.choose(401).name == "QPSK"
    f.write_text("formats:\n  - {name: QPSK, bits_per_symbol: 2, max_km: 9000, min_osnr_db: 40}\n")
    with pytest.raises(ValueError, match=r"OSNR there 37\.0 dB"):
        modulation_table(str(f)).choose(10)
