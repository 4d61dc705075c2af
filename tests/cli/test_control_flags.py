"""``dmsc up``'s control-loop flags: what reaches the control plane (interval, mode, the policy
file with ``--slo`` and ``--alert-webhook`` over it), and a wrong policy refused before anything
starts (file, field and reason; exit 2)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from dmsc.cli import main
from dmsc.planner.solve import plan_job
from dmsc.runtime.transport.messages import ControlSettings
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    return int(exit_.value.code or 0), capsys.readouterr().err


def test_up_hands_the_loop_and_its_policy_over(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    plan = tmp_path / "plan.json"
    plan.write_text(
        plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True).plan.model_dump_json()
    )
    script = tmp_path / "control-plane"  # the control plane's stand-in: it keeps its settings
    script.write_text(f'#!/bin/sh\ncat > {tmp_path}/settings.json\necho "READY 127.0.0.1:1"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(script))
    policy = tmp_path / "policy.yaml"
    policy.write_text("slos:\n  step_time_s: 0.5\n  queue_wait_s: {max: 60}\nwindow_s: 120\n")
    flags = ["--policy", str(policy), "--slo", "step_time_s=0.2:move", "--control", "advise"]
    code, err = run(capsys, "up", "--plan", str(plan), *flags, "--control-interval", "2")
    assert code == 0, err
    settings = ControlSettings.model_validate_json((tmp_path / "settings.json").read_text())
    assert (settings.control_interval_s, settings.control) == (2.0, "advise")
    assert settings.policy is not None and settings.policy["window_s"] == 120
    assert settings.policy["slos"]["step_time_s"] == {"max": 0.2, "action": "move"}
    assert settings.policy["slos"]["queue_wait_s"] == {"max": 60.0, "action": "alert"}
    (tmp_path / "settings.json").unlink()
    code, err = run(capsys, "up", "--plan", str(plan))  # the defaults: on, act, no policy
    settings = ControlSettings.model_validate_json((tmp_path / "settings.json").read_text())
    assert (settings.control_interval_s, settings.control, settings.policy) == (5.0, "act", None)
    (tmp_path / "settings.json").unlink()
    for bad, where in (
        ("slos:\n  queue_wait_s: -3\n", f"{policy}: slos.queue_wait_s"),
        ("slos:\n  error_rate: 2\n", f"{policy}: slos"),
        ("webhook: ftp://x\n", f"{policy}: webhook"),
    ):
        policy.write_text(bad)
        code, err = run(capsys, "up", "--plan", str(plan), "--policy", str(policy))
        assert code == 2 and where in err and "Traceback" not in err, err
    for flag in (["--slo", "p50=3"], ["--control", "maybe"], ["--control-interval", "-1"]):
        code, err = run(capsys, "up", "--plan", str(plan), *flag)
        assert code == 2 and flag[0] in err, err
    assert not (tmp_path / "settings.json").exists()
