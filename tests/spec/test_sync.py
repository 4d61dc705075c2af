"""The sync mode and compression of a job: the accepted forms, parsed where they enter."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dmsc.spec import Compression, JobSpec, SyncSpec, parse_compress, parse_sync


@pytest.mark.parametrize(
    ("text", "mode", "steps"),
    [
        ("every-step", "every-step", 1),
        ("diloco:50", "diloco", 50),
        ("fedavg:10", "fedavg", 10),
        (" fedprox:1 ", "fedprox", 1),
    ],
)
def test_parse_sync(text: str, mode: str, steps: int) -> None:
    sync = parse_sync(text)
    assert (sync.mode, sync.inner_steps, sync.compress) == (mode, steps, "none")


@pytest.mark.parametrize(
    "text",
    ["diloco", "diloco:0", "diloco:-3", "diloco:x", "every-step:5", "sgd:4", "", "diloco:2.5"],
)
def test_bad_sync_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="expected every-step, diloco:H, fedavg:H or fedprox:H"):
        parse_sync(text)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("none", Compression("none")),
        ("bf16", Compression("bf16")),
        ("int8", Compression("int8", block=256)),
        ("int8:64", Compression("int8", block=64)),
        ("topk:0.01", Compression("topk", fraction=0.01)),
        ("topk:1", Compression("topk", fraction=1.0)),
        ("powersgd:4", Compression("powersgd", rank=4)),
    ],
)
def test_parse_compress(text: str, parsed: Compression) -> None:
    assert parse_compress(text) == parsed


@pytest.mark.parametrize(
    "text",
    ["fp8", "topk", "topk:0", "topk:1.5", "topk:nan", "topk:x", "powersgd", "powersgd:0",
     "int8:0", "bf16:2", ""],
)  # fmt: skip
def test_bad_compress_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected none, bf16, int8, .* powersgd:R"):
        parse_compress(text)


def test_sync_spec_short_form_and_label() -> None:
    assert SyncSpec.model_validate("diloco:50") == SyncSpec(mode="diloco", inner_steps=50)
    sync = SyncSpec(mode="fedavg", inner_steps=8, compress="int8")
    assert sync.label == "fedavg:8, int8" and sync.local_steps
    assert SyncSpec().label == "every-step" and not SyncSpec().local_steps
    with pytest.raises(ValidationError, match="inner_steps: every-step"):
        SyncSpec(inner_steps=4)
    with pytest.raises(ValidationError, match="expected none, bf16"):
        SyncSpec(mode="diloco", inner_steps=4, compress="zip")


def test_job_defaults_to_every_step_uncompressed() -> None:
    job = JobSpec(global_batch=8)
    assert job.sync == SyncSpec() and job.sync.compression == Compression("none")
    job = JobSpec.model_validate({"global_batch": 8, "dp": 2, "sync": "diloco:50"})
    assert job.sync.inner_steps == 50


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero": 1, "sync": "diloco:4"}, "sync: diloco keeps a whole optimizer"),
        ({"mode": "infer", "sync": "fedavg:4"}, "sync: inference synchronises no gradients"),
        ({"sync": {"mode": "diloco", "inner_steps": 0}}, "greater than or equal to 1"),
    ],
)
def test_jobs_the_sync_mode_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate({"global_batch": 8, "dp": 2, **kwargs})


def test_the_leaders_rule_is_named_and_needs_the_leader() -> None:
    """``aggregator`` names the rule the stage leader combines with (the runtime's forms), is
    priced by the cost model, and means nothing by collective: a rule but the mean without
    ``via: leader`` is refused with the reason, as is a bad form."""
    sync = SyncSpec(via="leader", aggregator="krum:1")
    assert sync.label == "every-step, through the leader (krum:1)"
    assert SyncSpec(via="leader").label == "every-step, through the leader"
    with pytest.raises(ValidationError, match="combines the updates at the stage leader"):
        SyncSpec(aggregator="median")
    with pytest.raises(ValidationError, match="expected mean, median"):
        SyncSpec(via="leader", aggregator="mode")
    with pytest.raises(ValidationError, match="PowerSGD averages low-rank factors"):
        SyncSpec(via="leader", aggregator="median", compress="powersgd:4")
