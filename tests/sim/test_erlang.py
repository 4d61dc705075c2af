"""The optical layer against a closed form: one link, one slot per request -> Erlang B."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dmsc.sim.network import OpticalNetwork
from dmsc.sim.rmsa import erlang_b, simulate_lightpaths


@pytest.mark.parametrize("load", [4.0, 8.0, 12.0])
def test_single_link_matches_erlang_b(load: float) -> None:
    net = OpticalNetwork(
        sites=["a", "b"],
        link_ends=[("a", "b")],
        link_km=[100.0],
        n_slots=10,
        slot_ghz=12.5,
        k_paths=1,
        dc_names=[],
        dc_sites=[],
        gpus_total=[],
    )
    result = simulate_lightpaths(
        net, load, requests=40_000, seed=3, gbit_s=(12.5,), pairs=[("a", "b")]
    )
    expected = erlang_b(load, 10)
    # 40k requests: the estimate is within a few standard errors of the closed form.
    se = math.sqrt(expected * (1 - expected) / 36_000)
    assert abs(result.blocking - expected) < 5 * se + 0.004


def test_erlang_b_reference() -> None:
    assert erlang_b(10, 10) == pytest.approx(0.2146, abs=1e-4)  # standard table value
    assert np.isclose(erlang_b(1, 1), 0.5)
