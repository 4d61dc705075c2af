"""benchmarks/repredict_modes.py: stored parallel_modes rounds priced again by today's cost model.
Its stored figures (benchmarks/results/repredict_modes_cpu.json, which docs/runtime.md quotes)
are what the program gives on the stored runs now, on any machine (its stand-in devices are a
stored round's, not this machine's), and a set that kept its specs is given back its own
ratios by the model that stored them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    from repredict_modes import RESULTS, repredict, stand_in, summarise
finally:
    sys.path.remove(str(BENCH))


def test_the_stored_summary_is_what_the_program_gives_now() -> None:
    stored = json.loads(RESULTS.read_text())
    kept = json.loads((BENCH / "results" / "repredict_modes_cpu.json").read_text())
    got = summarise(stored, kept["sets"], stand_in(stored))
    assert got["summary"]["now"]["within_15pct"] == kept["summary"]["now"]["within_15pct"]
    assert got["summary"]["now"]["median_abs_log_ratio"] == pytest.approx(
        kept["summary"]["now"]["median_abs_log_ratio"], rel=1e-9
    )
    assert got["summary"]["stored"] == kept["summary"]["stored"]


def test_a_set_that_kept_its_specs_is_priced_from_them_whatever_the_stand_in() -> None:
    """The spun set was stored with each round's spec by the model of 5539cfe; of its modes,
    those this session's later changes did not move (the tensor-parallel calls and the
    pipeline-free ring) come back as stored, and the stand-in is not read."""
    stored = json.loads(RESULTS.read_text())
    (run,) = stored["rerun_2026_12_05_spun"]["runs"]
    got = repredict(run, {})  # no stand-in: a round's own spec is used
    for mode in ("tp2/tp", "dp2-ring/dp", "dp4-ring/dp"):
        assert got[mode]["now"] == pytest.approx(got[mode]["stored"], rel=1e-9), mode
    assert {"dp2-star/dp", "dp2-int8/dp"} <= set(got)  # every mode, the star's and int8's too


def test_a_set_stored_later_does_not_move_the_stand_in() -> None:
    """The stand-in was the newest stored set's first round: storing another set moved every
    figure priced on it, and the stored summary no longer held (2026-12-05)."""
    stored = json.loads(RESULTS.read_text())
    before = stand_in(stored)
    later = {"runs": [{"calibration": {"spec_by_round": [{"name": "a later set"}]}}]}
    assert stand_in({**stored, "reruns_later": later}) == before
    assert stand_in({"only": later}) == {"name": "a later set"}  # none named: the newest
