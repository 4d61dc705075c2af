"""The local launcher: worker logs a user can find, and a failed start that says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch.launchers import LocalLauncher, WorkerStartError
from dmsc.runtime.transport import logs


def test_a_worker_that_cannot_start_reports_its_last_log_lines(tmp_path: Path) -> None:
    home, workdir = tmp_path / "home", tmp_path / "work"
    workdir.mkdir()
    cfg = WorkerConfig(
        sid="broken-r0",
        stage=0,
        stages=1,
        model={"name": "no-such-model", "layers": "many"},  # not a TransformerSpec
        first="embedding",
        last="head",
        registry="127.0.0.1:9",
    )
    with pytest.raises(WorkerStartError) as info:
        LocalLauncher(home=home).start(cfg, workdir)
    msg = str(info.value)
    assert "broken-r0 failed to start" in msg
    stderr = logs.stderr_file(home, "broken-r0")
    assert str(stderr) in msg  # the file it came from, under $DMSC_HOME/logs
    assert logs.tail(stderr) and logs.tail(stderr)[-1] in msg  # and its last words
    assert "missing" in msg  # why: the model spec lacks its fields
    # its config (it holds the service credential) is removed once the start is over
    assert not (workdir / "broken-r0.json").exists()


def test_without_a_home_the_logs_go_under_the_workdir(tmp_path: Path) -> None:
    cfg = WorkerConfig(
        sid="broken-r1",
        stage=0,
        stages=1,
        model={},
        first="embedding",
        last="head",
        registry="127.0.0.1:9",
    )
    with pytest.raises(WorkerStartError):
        LocalLauncher().start(cfg, tmp_path)
    assert logs.stderr_file(tmp_path, "broken-r1").is_file()
    assert logs.stderr_file(tmp_path, "broken-r1").parent == tmp_path / "logs"
