"""``dmsc up --queue`` and ``dmsc token create --weight``: what reaches the control plane and the
database, and the bad values refused (exit 2, naming the flag)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from dmsc.cli import main
from dmsc.data.db import Database, TenantRecord
from dmsc.planner.solve import plan_job
from dmsc.runtime.transport.messages import ControlSettings
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


@pytest.mark.parametrize(("flag", "policy"), [([], "priority"), (["--queue", "fair"], "fair")])
def test_up_hands_the_queue_policy_over(
    home: Path,
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: list[str],
    policy: str,
) -> None:
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    plan = tmp_path / "plan.json"
    plan.write_text(
        plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True).plan.model_dump_json()
    )
    script = tmp_path / "control-plane"  # the control plane's stand-in: it keeps its settings
    script.write_text(f'#!/bin/sh\ncat > {tmp_path}/settings.json\necho "READY 127.0.0.1:1"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(script))
    code, _, err = run(capsys, "up", "--plan", str(plan), *flag)
    assert code == 0, err
    settings = ControlSettings.model_validate_json((tmp_path / "settings.json").read_text())
    assert settings.queue == policy
    (tmp_path / "settings.json").unlink()
    code, _, err = run(capsys, "up", "--plan", str(plan), "--queue", "magic")
    assert code == 2 and "--queue" in err and "fcfs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "settings.json").exists()


def test_token_create_sets_the_tenants_weight(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = ["token", "create", "--tenant", "ann", "--scopes", "submit"]
    assert run(capsys, *key, "--weight", "2.5")[0] == 0
    assert run(capsys, *key)[0] == 0  # another key of hers: her weight stays
    db = Database(f"sqlite:///{home / 'dmsc.sqlite'}")
    with db.sessions() as s:
        assert [(t.name, t.weight) for t in s.scalars(select(TenantRecord))] == [("ann", 2.5)]
    assert run(capsys, *key, "--weight", "4")[0] == 0  # a new weight replaces it
    with db.sessions() as s:
        assert s.get(TenantRecord, "ann").weight == 4.0  # type: ignore[union-attr]
    for bad in ("0", "-1", "nan", "inf"):
        code, out, err = run(
            capsys, "token", "create", "--tenant", "bo", "--scopes", "read", "--weight", bad
        )
        assert code == 2 and "--weight" in err and out == "" and "Traceback" not in err
    with db.sessions() as s:
        assert s.get(TenantRecord, "bo") is None
