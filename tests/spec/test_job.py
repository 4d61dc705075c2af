from __future__ import annotations

import pytest
from pydantic import ValidationError

from dmsc.spec import JobSpec


def test_defaults_and_derived() -> None:
    job = JobSpec(global_batch=64, micro_batch=2, tp=2, pp=4, dp=2)
    assert job.devices == 16
    assert job.microbatches == 16
    assert job.chunks == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch": 10, "dp": 3}, "not divisible"),
        ({"global_batch": 8, "interleave": 2}, "interleaved"),
        ({"global_batch": 8, "schedule": "interleaved"}, "pp > 1"),
        ({"global_batch": 8, "dp": 4, "ep": 3}, "ep"),
        ({"global_batch": 8, "sequence_parallel": True}, "tp > 1"),
        ({"global_batch": 8, "zero": 4}, "less than or equal"),
        ({"global_batch": 8, "mode": "infer", "recompute": "full"}, "inference"),
        ({"global_batch": 8, "schedule": "zigzag"}, "gpipe"),
    ],
)
def test_invalid_jobs(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate(kwargs)
