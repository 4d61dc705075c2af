"""The CLI side of the runtime commands, in this process and without a deployment.

``dmsc up`` is checked against a stand-in for the control-plane process (``sys.executable``
replaced by a shell script): what it is told on its standard input, where its standard error
goes, and what the user reads when it starts or fails to. The real control plane is started by
the tests in tests/integration.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from dmsc.cli import main
from dmsc.planner.solve import plan_job
from dmsc.runtime.transport import logs
from dmsc.runtime.transport.messages import MAX_INFER_TOKENS, ControlSettings
from dmsc.spec import ClusterSpec, JobSpec, resolve_model


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def plan_file(tmp_path: Path, local_cpu: ClusterSpec) -> Path:
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    plan = plan_job(local_cpu, resolve_model("gpt-mini"), job, fixed=True).plan
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """Make ``sys.executable`` a script that saves its stdin and arguments, then runs ``body``."""
    script = tmp_path / "control-plane"
    script.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/argv\ncat > {tmp_path}/settings.json\n' + body
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(script))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_up_hands_the_settings_over_on_stdin(
    home: Path,
    plan_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stand_in(tmp_path, monkeypatch, 'echo "READY 127.0.0.1:4242"\n')
    code, out, err = run(
        capsys, "up", "--plan", str(plan_file), "--failure-timeout", "2.5", "--spares", "1"
    )
    assert code == 0, err
    assert (tmp_path / "argv").read_text().split() == ["-m", "dmsc.runtime.control.daemon"]
    settings = ControlSettings.model_validate_json((tmp_path / "settings.json").read_text())
    # the plan's cluster spec, found by its name, goes along (training tasks may change dp)
    cluster = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "local-cpu.yaml"
    assert settings == ControlSettings(
        plan=str(plan_file.resolve()),
        home=str(home.resolve()),
        failure_timeout_s=2.5,
        spares=1,
        cluster=str(cluster),
        data_roots=[str(Path.cwd().resolve())],  # tasks' data: where dmsc up was started
    )
    assert "control plane up at 127.0.0.1:4242" in out
    assert f"logs in {logs.log_dir(home.resolve())}" in out and "`dmsc logs`" in out


def test_a_failed_start_shows_the_end_of_the_control_planes_stderr(
    home: Path,
    plan_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stand_in(tmp_path, monkeypatch, 'echo "ValueError: the reason it died" >&2\nexit 3\n')
    code, out, err = run(capsys, "up", "--plan", str(plan_file))
    assert code == 2 and out == ""
    assert "the control plane failed to start" in err
    assert "ValueError: the reason it died" in err
    stderr = logs.stderr_file(home.resolve(), "control")
    assert str(stderr) in err and "the reason it died" in stderr.read_text()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--failure-timeout", "0"], "--failure-timeout: must be positive"),
        (["--failure-timeout", "5000"], "--failure-timeout: Input should be less than or equal"),
        (["--spares", "65"], "--spares: must be between 0 and 64"),
        (["--router", "magic"], "--router: unknown policy"),
        (["--gateway", "example.com"], "--gateway: expected HOST:PORT"),
        (["--gateway", "example.com:80"], "--gateway: plain HTTP on example.com would carry"),
        (["--gateway", "127.0.0.1:1", "--tls-cert", "c.pem"], "--tls-key: --tls-cert and --tls-k"),
        (["--gateway", "127.0.0.1:1", "--tls-cert", "no.pem", "--tls-key", "k"], "no.pem: no such"),
        (["--gateway", "127.0.0.1:1", "--tls", "--insecure"], "--insecure: plain HTTP or TLS"),
        (["--tls"], "--tls: only with --gateway HOST:PORT"),
        (["--device", "tpu"], "--device: String should match pattern"),
        (["--data-root", "/nowhere-at-all"], "--data-root: /nowhere-at-all: not a directory"),
    ],
)
def test_bad_up_flags_exit_2_before_starting_anything(
    home: Path,
    plan_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
) -> None:
    stand_in(tmp_path, monkeypatch, 'echo "READY 127.0.0.1:4242"\n')
    code, _, err = run(capsys, "up", "--plan", str(plan_file), *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "argv").exists()


@pytest.mark.parametrize("tokens", ["0", str(MAX_INFER_TOKENS + 1)])
def test_infer_tokens_are_limited(
    home: Path, capsys: pytest.CaptureFixture[str], tokens: str
) -> None:
    code, _, err = run(capsys, "infer", "--prompt", "x", "--tokens", tokens)
    assert code == 2
    assert "--tokens: Input should be" in err  # the reason of messages.InferRequest
    if tokens != "0":
        assert f"less than or equal to {MAX_INFER_TOKENS}" in err


def test_token_list_and_per_key_limits(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``dmsc token list`` shows what a revocation needs (never a key or its hash); a key's
    own rate limit is checked at the boundary."""
    code, out, err = run(capsys, "token", "create", "--tenant", "ann", "--scopes", "read")
    assert code == 0 and out.strip().startswith("dmsc_")
    key = out.strip()
    code, _, _ = run(
        capsys, "token", "create", "--tenant", "bob", "--scopes", "infer", "--rate", "2"
    )
    assert code == 0
    code, out, _ = run(capsys, "token", "list")
    assert code == 0 and "ann" in out and "bob" in out and key not in out
    bob = next(line for line in out.splitlines() if "bob" in line)
    assert " 2 " in bob  # its own rate
    code, _, err = run(
        capsys, "token", "create", "--tenant", "c", "--scopes", "read", "--rate", "0"
    )
    assert code == 2 and "--rate" in err


def test_tasks_list_show_cancel(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``dmsc tasks``: what is queued or running, one task's detail, and cancelling it."""
    import json

    from dmsc.data.db import Database
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

    db = Database()
    run_id = db.new_run("gpt-mini", "c", {}).id
    queue = TaskQueue(db, run_id)
    queued = queue.submit("train", {"steps": 30}, tenant="ann")
    running = queue.submit("train", {"steps": 40}, tenant="bob")
    with db.sessions() as s, s.begin():  # as the control plane's claim leaves it
        s.get(type(running), running.id).state = "running"  # type: ignore[union-attr]
    code, out, _ = run(capsys, "tasks", "list", "--json")
    assert code == 0 and [t["id"] for t in json.loads(out)] == [running.id, queued.id]
    code, out, _ = run(capsys, "tasks", "list", "--tenant", "ann", "--json")
    assert [t["tenant"] for t in json.loads(out)] == ["ann"]
    code, out, _ = run(capsys, "tasks", "show", str(queued.id), "--json")
    assert code == 0 and json.loads(out)["params"] == {"steps": 30}
    assert run(capsys, "tasks", "cancel", str(queued.id))[1].strip().endswith("cancelled")
    assert run(capsys, "tasks", "cancel", str(running.id))[1].strip().endswith("cancelling")
    code, _, err = run(capsys, "tasks", "cancel", str(queued.id))
    assert code == 2 and "cancelled" in err
    code, _, err = run(capsys, "tasks", "show", "999")
    assert code == 2 and "no task 999" in err
    code, out, _ = run(capsys, "tasks", "list", "--state", "cancelled", "--json")
    assert [t["id"] for t in json.loads(out)] == [queued.id]
    code, _, err = run(capsys, "tasks", "list", "--state", "bogus")  # exited 0, empty table
    assert code == 2 and "--state" in err and "queued, running" in err


def test_status_keeps_sids_and_addresses_whole_at_80_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    from rich.console import Console

    from dmsc.cli import runtime
    from dmsc.runtime.transport.replies import StatusReply

    sids = [f"sid-{s}-{'0123456789abcdef' * 2}" for s in range(3)]
    answer = {
        "run": 12,
        "epoch": 0,
        "replicas_down": [],
        "spares": [],
        "model": "gpt-mini",
        "steps": 40,
        "services": [
            {
                "sid": sid,
                "stage": s,
                "replica": 0,
                "address": f"127.0.0.1:{50000 + s}",
                "health": "ok",
                "registered": True,
                "heartbeat_age_s": 0.4,
                "pid": 123456 + s,
            }
            for s, sid in enumerate(sids)
        ],
        "tasks": [{"id": 1, "kind": "train", "state": "running"}],
        "faults": [
            {
                "id": 1,
                "kind": "crash",
                "task": 1,
                "services": sids[1],
                "reason": "worker exited with code -9 " + "and a long explanation " * 6 + "END",
                "detected_at": 1.0,
                "recovered_at": 3.5,
                "checkpoint_step": 30,
                "steps_lost": 0,
                "epoch": 0,
            }
        ],
    }

    class Client:
        def status(self) -> StatusReply:
            return StatusReply.model_validate(answer)

    buf = io.StringIO()
    monkeypatch.setattr(runtime, "console", Console(file=buf, width=80, force_terminal=False))
    monkeypatch.setattr(runtime, "control_client", Client)
    runtime.status(as_json=False)
    text = buf.getvalue()
    assert "…" not in text
    for s, sid in enumerate(sids):
        assert sid in text
        assert f"127.0.0.1:{50000 + s}" in text
    assert "END" in text  # the fault's reason is not cut


def test_token_and_task_tables_cut_nothing_at_80_columns(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``token list`` showed ``infer,submit,re…``: cells wrap instead."""
    import importlib

    monkeypatch.setattr(importlib.import_module("dmsc.cli.app").console, "width", 80)
    scopes = "admin,infer,read,submit"
    assert (
        run(capsys, "token", "create", "--tenant", "a-long-tenant-name", "--scopes", scopes)[0] == 0
    )
    code, out, _ = run(capsys, "token", "list")
    assert code == 0 and "…" not in out
    assert all(part in out for part in ("admin", "infer", "read", "submit", "-name"))


@pytest.mark.parametrize("how", ["--wide", "DMSC_WIDE=1"])
def test_wide_keeps_every_table_row_on_one_line(
    how: str, home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dmsc --wide`` (or DMSC_WIDE=1) lays tables out for no width limit: a long tenant name
    and its scopes stay on the key's row, which takes several lines at 80 columns without it
    (a pipe is 80 columns to rich)."""
    import importlib

    console = importlib.import_module("dmsc.cli.app").console
    monkeypatch.setattr(console, "width", 80)  # also puts the width back after --wide
    monkeypatch.delenv("DMSC_WIDE", raising=False)
    tenant = "a-tenant-whose-name-is-far-too-long-for-one-column-at-80"
    scopes = "admin,infer,read,submit"
    assert run(capsys, "token", "create", "--tenant", tenant, "--scopes", scopes)[0] == 0

    def key_rows(out: str) -> list[str]:
        return [line for line in out.splitlines() if line.startswith("│")]

    code, out, _ = run(capsys, "token", "list")
    assert code == 0 and tenant in out  # whole at 80, but not on one line with the scopes
    assert not any(tenant in line and scopes in line for line in out.splitlines())
    if how == "--wide":
        code, out, _ = run(capsys, "--wide", "token", "list")
    else:
        monkeypatch.setenv("DMSC_WIDE", "1")
        code, out, _ = run(capsys, "token", "list")
    assert code == 0
    [row] = key_rows(out)
    assert tenant in row and scopes in row and len(row) > 80


def test_a_plan_for_gpus_is_refused_on_a_machine_without_them(
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 14, item 3: the plan puts each replica on its GPU (cuda:N); where this machine has
    none, ``dmsc up`` says so before starting anything, and ``--device cpu`` runs it anyway."""
    import torch

    from dmsc.spec import load_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cluster = load_spec(ClusterSpec, Path(__file__).parents[2] / "examples/clusters/one-h100.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, pp=1)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    assert [r.device for st in plan.stages for r in st.replicas] == ["cuda:0"]
    path = tmp_path / "gpu-plan.json"
    path.write_text(plan.model_dump_json())
    stand_in(tmp_path, monkeypatch, 'echo "READY 127.0.0.1:4242"\n')
    code, _, err = run(capsys, "up", "--plan", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "stages[0].replicas[0].device" in err and "no CUDA device" in err
    assert "--device cpu" in err and not (tmp_path / "argv").exists()
    code, _, err = run(capsys, "up", "--plan", str(path), "--device", "cuda:1")
    assert code == 2 and "--device" in err and "no CUDA device" in err
    code, _, err = run(capsys, "up", "--plan", str(path), "--device", "cpu")
    assert code == 0, err
    settings = ControlSettings.model_validate_json((tmp_path / "settings.json").read_text())
    assert settings.device == "cpu"


def test_down_returns_once_the_control_plane_has_exited(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control plane removes its control file before it has finished exiting (stopping its
    workers, closing its database): ``dmsc down`` waits for its process too, so that "down" is
    true when it says so (CI once found the process still running right after)."""
    import json
    import subprocess

    from dmsc.cli import runtime
    from dmsc.data.db import control_file
    from dmsc.runtime.transport.processes import alive

    # a stand-in control plane: it removes its file at once and exits a moment later
    plane = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])
    home.mkdir(parents=True, exist_ok=True)
    control_file().write_text(json.dumps({"pid": plane.pid}))

    class Client:
        def down(self) -> None:
            control_file().unlink()

    monkeypatch.setattr(runtime, "control_client", Client)
    try:
        runtime.down()
        assert not alive(plane.pid)
        assert f"control plane down (pid {plane.pid})" in capsys.readouterr().out
    finally:
        plane.kill()
        plane.wait()
