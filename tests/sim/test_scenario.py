"""The job mix of a scenario as the command line picks it (``dmsc simulate --mix``)."""

from __future__ import annotations

import pytest

from dmsc.sim.scenario import JobTypeSpec, job_label, mix_jobs

JOBS = [
    JobTypeSpec(model="gpt3-6.7b", weight=0.3, pp=4, global_batch=512, iterations=10),
    JobTypeSpec(model="gpt3-13b", weight=0.3, pp=8, global_batch=512, iterations=10),
    JobTypeSpec(model="gpt3-13b", weight=0.4, pp=4, global_batch=512, iterations=10),
]


def test_pick_by_model_or_label_with_or_without_weight() -> None:
    mix = mix_jobs(JOBS, [("gpt3-13b/pp4", 2.0), ("gpt3-6.7b", None)])
    assert [(job_label(j), j.weight) for j in mix] == [
        ("gpt3-13b/pp4", 2.0),
        ("gpt3-6.7b/pp4", 0.3),
    ]
    assert mix[0].model_copy(update={"weight": 0.4}) == JOBS[2]  # nothing else changed


@pytest.mark.parametrize(
    ("picks", "needle"),
    [
        ([("gpt9", None)], "no job type 'gpt9'"),
        ([("gpt3-13b", None)], "gpt3-13b/pp8, gpt3-13b/pp4"),
        ([("gpt3-6.7b", 1.0), ("gpt3-6.7b/pp4", 2.0)], "named twice"),
        ([("gpt3-6.7b", 0.0)], "must be a positive number"),
        ([("gpt3-6.7b", float("inf"))], "must be a positive number"),
        ([], "no job type"),
    ],
)
def test_bad_picks_name_the_reason(picks: list[tuple[str, float | None]], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        mix_jobs(JOBS, picks)


def test_a_job_through_the_leader_is_refused_by_the_simulator() -> None:
    """The simulator's replicas exchange by collective: a job type whose sync says ``via:
    leader`` (which dmsc estimate and dmsc plan price) is refused, naming why, rather than
    simulated as a collective under a label that says otherwise."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="via: leader is not simulated"):
        JobTypeSpec(
            model="gpt3-6.7b", pp=4, global_batch=512, iterations=10, sync={"via": "leader"}
        )
