"""``dmsc up --autoscale``: checked against the plan and its cluster before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dmsc.cli.autoscale_flag import autoscale_settings
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, SpecError, load_spec, resolve_model

if TYPE_CHECKING:
    from conftest import DmscRunner

ROOT = Path(__file__).resolve().parents[2]


def _plan(cluster: str, **job: int):  # type: ignore[no-untyped-def]
    spec = load_spec(ClusterSpec, ROOT / "examples/clusters" / cluster)
    return plan_job(
        spec, resolve_model("gpt-mini"), JobSpec(global_batch=8, micro_batch=2, **job), fixed=True
    ).plan


def test_the_flag_becomes_settings_and_the_cluster_is_found_by_name() -> None:
    settings, path = autoscale_settings(
        "infer:min=1,max=2", None, _plan("two-sites-cpu.yaml", pp=2)
    )
    assert settings is not None and settings.max == 2
    assert path is not None and Path(path).name == "two-sites-cpu.yaml"


@pytest.mark.parametrize(
    ("flag", "cluster", "job", "field", "reason"),
    [
        ("infer:min=3,max=2", "two-sites-cpu.yaml", {"pp": 2}, "--autoscale", "above max"),
        (
            "infer:max=1",
            "two-sites-cpu.yaml",
            {"pp": 2, "dp": 2},
            "--autoscale",
            "below the plan's 2",
        ),
        ("infer:max=3", "local-cpu.yaml", {"pp": 2}, "--autoscale", "no free devices"),
    ],
)
def test_a_flag_that_cannot_hold_is_refused_with_the_reason(
    flag, cluster, job, field, reason
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SpecError) as info:
        autoscale_settings(flag, None, _plan(cluster, **job))
    assert info.value.field == field and reason in info.value.reason


def test_without_autoscale_the_cluster_is_still_found_for_training_resizes() -> None:
    plan = _plan("two-sites-cpu.yaml", pp=2)
    settings, path = autoscale_settings(None, None, plan)
    assert settings is None and path is not None and Path(path).name == "two-sites-cpu.yaml"
    with pytest.raises(SpecError) as info:
        autoscale_settings(None, "missing.yaml", plan)
    assert info.value.field == "--cluster"
    unknown = plan.model_copy(update={"cluster": "nowhere"})
    assert autoscale_settings(None, None, unknown) == (None, None)


@pytest.mark.integration
def test_dmsc_up_refuses_a_bad_autoscale_before_it_starts(dmsc: DmscRunner, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    made = dmsc(
        "plan", "--cluster", str(ROOT / "examples/clusters/local-cpu.yaml"), "--model", "gpt-mini",
        "--global-batch", "8", "--micro-batch", "2", "--tp", "1", "--pp", "2", "--dp", "1",
        "--out", str(plan),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    out = dmsc("up", "--plan", str(plan), "--autoscale", "infer:max=2")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--autoscale" in out.stderr and "no free devices" in out.stderr
