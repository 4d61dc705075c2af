"""``dmsc train``'s Ctrl-C before its task shows (queued, or not yet found): the CLI cancels its
Train call, and the control plane cancels the task with it (:meth:`.tasks.door.Door.wait`), so
the message says so, not that the task goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from dmsc.cli import progress


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True


def test_ctrl_c_before_the_task_starts_cancels_the_call_and_says_the_task_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(progress.time, "sleep", interrupt)
    call = _Call()
    with pytest.raises(typer.Exit) as info:
        progress.follow(call, steps=3, as_json=True)  # type: ignore[arg-type]
    assert info.value.exit_code == 130
    said = " ".join(capsys.readouterr().err.split())
    assert call.cancelled
    assert "goes on" not in said
    assert "cancels the task" in said
