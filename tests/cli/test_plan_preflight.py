"""``dmsc up`` refuses a plan the runtime cannot run as planned before anything starts: an
interleaved plan's stages hold several chunks of layers apart from one another, and the runtime
runs one contiguous range of layers per stage (it used to merge a stage's chunks into one range
over other stages' layers: gpt-mini pp=2 v=2 ran blocks 1 and 2 twice)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from dmsc.cli import main
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def _plan(tmp_path: Path, local_cpu: ClusterSpec, **job: object) -> Path:
    spec = JobSpec(global_batch=16, micro_batch=2, pp=2, **job)
    plan = plan_job(local_cpu, resolve_model("gpt-mini"), spec, fixed=True).plan
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def _up(
    tmp_path: Path, plan: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``dmsc up --plan PLAN`` with a stand-in control plane that records that it started."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    script = tmp_path / "control-plane"
    script.write_text(f'#!/bin/sh\ntouch {tmp_path}/started\necho "READY 127.0.0.1:4242"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(script))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--plan", str(plan)])
    return int(exit_.value.code or 0), capsys.readouterr().err


def test_an_interleaved_plan_is_refused_before_anything_starts(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _plan(tmp_path, local_cpu, schedule="interleaved", interleave=2)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{path}: stages[0].chunks:" in err
    assert "2 chunks" in err and "schedule interleaved" in err
    assert "one contiguous range of layers per stage" in err
    assert "Traceback" not in err and not (tmp_path / "started").exists()


def test_a_plan_of_one_chunk_per_stage_still_starts(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dmsc.planner.plan import Plan
    from dmsc.runtime.control.training.session import layout_from_plan

    path = _plan(tmp_path, local_cpu)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()
    plan = Plan.model_validate_json(path.read_text())
    assert plan.model_spec is not None
    ranges = layout_from_plan(plan, plan.model_spec).ranges  # type: ignore[arg-type]
    assert [tuple(r) for r in ranges] == [st.chunks[0] for st in plan.stages]
    assert ranges[0][0] == "embedding" and ranges[-1][1] == "head"
