"""``dmsc train``'s sync flags: the settings they make, and a wrong one named before anything is
sent (exit 2, no traceback)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from dmsc.cli.train_sync import sync_settings, task_steps
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from conftest import DmscRunner


def _flags(sync: str = "every-step", **kw) -> SyncSettings:  # type: ignore[no-untyped-def]
    inner, local = kw.pop("inner_steps", None), kw.pop("local_steps", None)
    settings = sync_settings(sync, inner, local, **kw)
    assert settings is not None
    return settings


def test_no_sync_flag_leaves_the_choice_to_the_plan() -> None:
    assert sync_settings(None, None, None, compress="none", skew=0.0) is None
    said = sync_settings("every-step", None, None)
    assert said is not None and said.mode == "every-step"  # said: overrides the plan's
    only_compress = sync_settings(None, None, None, compress="int8")
    assert only_compress is not None and only_compress.compress == "int8"
    with pytest.raises(SpecError, match="rounds of what"):
        task_steps(100, 5, None)


def test_the_issue_commands_make_the_settings_they_say() -> None:
    s = _flags("diloco", inner_steps=50, outer_lr=0.7, compress="int8")
    assert (s.mode, s.inner_steps, s.outer_lr, s.compress) == ("diloco", 50, 0.7, "int8")
    f = _flags(
        "fedavg", local_steps=25, aggregator="trimmed-mean", privacy_clip=1.0, privacy_noise=0.8
    )
    assert (f.mode, f.inner_steps, f.round_rate) == ("fedavg", 25, 1.0)
    assert task_steps(2000, 20, f) == 500
    assert _flags("diloco:10").inner_steps == 10
    assert _flags("diloco").inner_steps == 50  # the default round


@pytest.mark.parametrize(
    ("sync", "kw", "flag", "reason"),
    [
        ("dilo", {}, "--sync", "expected every-step, diloco:H"),
        ("diloco:x", {}, "--sync", "expected every-step, diloco:H"),
        ("diloco:10", {"inner_steps": 20}, "--inner-steps", "disagree"),
        ("diloco", {"compress": "zip"}, "--compress", "powersgd:RANK"),
        ("diloco", {"aggregator": "krum:x"}, "--aggregator", "multi-krum"),
        ("fedavg", {"aggregator": "median", "secure": True}, "--aggregator", "only the sum"),
        ("every-step", {"privacy_noise": 1.0}, "--privacy-noise", "privacy_clip"),
        ("every-step", {"inner_steps": 5}, "--inner-steps", "one step"),
        ("diloco", {"outer_momentum": 1.0}, "--outer-momentum", "less than 1"),
        ("diloco:5", {"task_heads": True}, "--task-heads", "only every-step"),
    ],
)
def test_a_wrong_flag_is_named_with_the_reason(sync, kw, flag, reason) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError) as info:
        _flags(sync, **kw)
    assert info.value.field == flag and reason in info.value.reason


@pytest.mark.integration
def test_dmsc_train_refuses_a_bad_sync_flag_before_connecting(dmsc: DmscRunner) -> None:
    out = dmsc("train", "--sync", "fedavg", "--secure-aggregation", "--aggregator", "krum")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--aggregator" in out.stderr and "only the sum" in out.stderr


@pytest.mark.integration
def test_dmsc_infer_refuses_an_unknown_aggregation_before_connecting(dmsc: DmscRunner) -> None:
    out = dmsc("infer", "--prompt", "def ", "--aggregate", "average")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--aggregate" in out.stderr and "'vote', 'weighted' or 'attention'" in out.stderr
