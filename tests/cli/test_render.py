"""The figures the CLI prints: units that keep their digits, and which way a miss goes."""

from __future__ import annotations

import pytest

from dmsc.cli.render import human_flops, human_gib, measured_vs_predicted


@pytest.mark.parametrize(
    ("measured", "predicted", "words"),
    [
        (0.112, 0.100, "measured 12.0% slower than predicted"),
        (0.088, 0.100, "measured 12.0% faster than predicted"),
        (0.100, 0.100, "measured as predicted"),
    ],
)
def test_a_miss_says_which_way_it_goes(measured: float, predicted: float, words: str) -> None:
    assert measured_vs_predicted(measured, predicted) == words


@pytest.mark.parametrize(
    ("flop_s", "text"),
    [(2.5e13, "25.0 TFLOP/s"), (2.1e10, "21.0 GFLOP/s"), (1.5e15, "1.5 PFLOP/s")],
)
def test_flops_keep_their_digits(flop_s: float, text: str) -> None:
    assert human_flops(flop_s) == text


def test_memory_below_a_gib_is_in_mib() -> None:
    assert human_gib(0.01) == "10.2 MiB"
    assert human_gib(12.34) == "12.3 GiB"
