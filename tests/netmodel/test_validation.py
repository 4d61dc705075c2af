"""The cost model against published sets (issue 13, item 5): each set meets its target, and what
the calibration states about itself is what its validation computes."""

from __future__ import annotations

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION
from dmsc.netmodel.validation import (
    VALIDATION_SETS,
    megatron_core_bucket_bytes,
    read_table,
    summary,
    validate,
    validate_megatron,
)

# (mean, max) absolute error in percent each set must stay within. SC'21 and the H100 sets hold the
# issue's targets (3% mean; 5% mean and 10% max); the others are held where they stand today so
# that a change which makes them worse fails.
TARGETS = {
    "megatron-sc21": (3.0, 10.0),
    "korthikanti-mlsys23": (6.0, 10.0),
    "megatron-core-h100": (5.0, 10.0),
    "nemo-h100-fp8": (5.0, 10.0),
    "nemo-b200-fp8": (5.0, 10.0),
    "llama3-405b": (5.0, 10.0),
}


@pytest.mark.parametrize("name", list(VALIDATION_SETS))
def test_each_published_set_within_its_target(name: str) -> None:
    rows = validate(name)
    mean, worst = summary(rows)
    target_mean, target_max = TARGETS[name]
    assert mean <= target_mean, f"{name}: mean absolute error {mean:.2f}% > {target_mean}%"
    assert worst <= target_max, f"{name}: max absolute error {worst:.2f}% > {target_max}%"


def test_there_are_published_sets_beyond_table_1_on_a100_and_h100() -> None:
    devices = {s.generation for s in VALIDATION_SETS.values() if s.name != "megatron-sc21"}
    assert {"a100", "h100"} <= devices


def test_search_covers_the_unlisted_knobs() -> None:
    rows = validate_megatron()
    assert len(rows) == 10
    # Rows without pipelining have no interleaving; pipelined rows may pick any divisor.
    for r in rows:
        if r.pp == 1:
            assert r.interleave == 1
        assert r.global_batch % (r.micro_batch * r.dp) == 0


def test_the_calibration_states_the_error_its_validation_computes() -> None:
    """What ``dmsc estimate`` prints about its calibration (issue 13, item 6) is what each
    validation gives, to the printed digit, for every set of every generation."""
    stated = [v for g in DEFAULT_CALIBRATION.generations for v in g.validated]
    assert {v.set_name for v in stated} == set(VALIDATION_SETS)
    for v in stated:
        vs = VALIDATION_SETS[v.set_name]
        assert DEFAULT_CALIBRATION.generation(vs.generation).validated.count(v) == 1
        rows = validate(v.set_name)
        mean, worst = summary(rows)
        assert (v.rows, v.mean_abs_error_pct, v.max_abs_error_pct) == (
            len(rows),
            round(mean, 1),
            round(worst, 1),
        )


@pytest.mark.parametrize("name", ["megatron-core-h100", "nemo-h100-fp8", "nemo-b200-fp8"])
def test_megatron_core_sets_are_priced_with_its_buckets(name: str) -> None:
    """Megatron-Core (and NeMo on it) cuts its gradients into buckets of max(40e6, 1e6 x dp)
    parameters, not dmsc's 4 MiB: every candidate of its sets says so."""
    vs = VALIDATION_SETS[name]
    for row in read_table(vs.csv):
        for cand in vs.candidates(row):
            want = max(40_000_000, 1_000_000 * cand.job.dp) * 2  # bf16 gradients
            assert cand.job.dp_bucket_bytes == want == megatron_core_bucket_bytes(cand.job.dp)
    assert megatron_core_bucket_bytes(8) == 80_000_000
    assert megatron_core_bucket_bytes(64) == 128_000_000
