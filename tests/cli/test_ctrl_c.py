"""Ctrl-C while ``dmsc train`` or ``dmsc infer --batch`` waits for a queued task: the CLI
cancels its call, and the control plane cancels the task with it
(:meth:`dmsc.runtime.control.tasks.door.Door.wait_for`), so the message says so (``dmsc
train``'s said that a task that started goes on)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


class _Rpc:
    def __init__(self) -> None:
        self.call = _Call()
        self.sent: list[Any] = []

    def send_future(self, method: str, msg: Any) -> _Call:
        self.sent.append((method, msg))
        return self.call


def test_ctrl_c_during_a_batch_cancels_the_call_and_says_the_task_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dmsc.cli import infer_batch

    rpc = _Rpc()
    monkeypatch.setattr(infer_batch, "control_client", lambda: SimpleNamespace(rpc=rpc))

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(infer_batch.time, "sleep", interrupt)
    f = tmp_path / "batch.jsonl"
    f.write_text('{"prompt": "x", "tokens": 2}\n')
    with pytest.raises(typer.Exit) as info:
        infer_batch.run_batch(f, priority=3, lane="sync", as_json=False)
    assert info.value.exit_code == 130
    assert rpc.sent[0][0] == "InferBatch" and rpc.sent[0][1].priority == 3
    assert rpc.call.cancelled
    assert "cancels its task" in " ".join(capsys.readouterr().err.split())
