"""``dmsc logs`` on log files written here, under a ``DMSC_HOME`` of the test's own.

The quick tests call the command in this process; following a file that grows and is rotated runs
the command as a process that the test interrupts, as a user would with Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmsc.cli import main
from dmsc.runtime.transport import logs

ROOT = Path(__file__).resolve().parents[2]


def record(msg: str, sid: str = "", level: str = "info") -> str:
    """One JSON log line as the processes write them."""
    rec = {"ts": "2025-01-01T00:00:00", "level": level, "msg": msg}
    if sid:
        rec["sid"] = sid
    return json.dumps(rec)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory with the logs of a control plane and two workers."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    logs.log_file(tmp_path, "control").write_text(
        "\n".join(record(f"control {i}") for i in range(100)) + "\n"
    )
    for sid in ("sid-0-aaaa-r0", "sid-1-bbbb-r0"):
        logs.log_file(tmp_path, sid).write_text(record(f"hello from {sid}", sid) + "\n")
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``dmsc ARGS`` in this process: exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(["logs", *args])
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_the_control_plane_by_default_rendered(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 50  # the last 50 by default
    assert lines[-1] == logs.render(record("control 99"))
    assert "INFO" in lines[-1] and "control 99" in lines[-1] and "{" not in lines[-1]
    assert run(capsys, "--control", "--lines", "3")[1].splitlines() == [
        logs.render(record(f"control {i}")) for i in (97, 98, 99)
    ]


def test_raw_prints_the_json_lines(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--raw", "-n", "2")
    assert code == 0
    assert [json.loads(line)["msg"] for line in out.splitlines()] == ["control 98", "control 99"]


def test_a_worker_by_sid_or_unique_prefix(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("sid-1-bbbb-r0", "sid-1"):
        code, out, _ = run(capsys, "--service", name)
        assert code == 0 and "hello from sid-1-bbbb-r0" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--service", "sid-9"], "no log of service 'sid-9'"),
        (["--service", "sid-"], "'sid-' matches sid-0-aaaa-r0, sid-1-bbbb-r0"),
        (["--service", "sid-0", "--control"], "not both"),
        (["--lines", "-1"], "--lines"),
    ],
)
def test_bad_choices_exit_2_in_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_a_service_without_a_log_lists_those_with_one(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.stderr_file(home, "sid-2-cccc-r0").write_text("Traceback ...\n")
    code, _, err = run(capsys, "--service", "sid-2-cccc-r0")
    assert code == 2
    assert "no log of service 'sid-2-cccc-r0'" in err
    assert "sid-2-cccc-r0.stderr" in err  # where its reason may be
    assert "control, sid-0-aaaa-r0, sid-1-bbbb-r0" in err


def test_grep_and_since_search_every_log(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())  # the fixture's lines are of 2025
    with logs.log_file(home, "sid-1-bbbb-r0").open("a") as f:
        f.write(json.dumps({"ts": now, "level": "error", "msg": "NCCL error: unhandled"}) + "\n")
    nccl = json.dumps({"ts": now, "level": "error", "msg": "NCCL error: unhandled"})
    code, out, _ = run(capsys, "--grep", "hello|NCCL")
    assert code == 0 and out.splitlines() == [
        f"sid-0-aaaa-r0  {logs.render(record('hello from sid-0-aaaa-r0', 'sid-0-aaaa-r0'))}",
        f"sid-1-bbbb-r0  {logs.render(record('hello from sid-1-bbbb-r0', 'sid-1-bbbb-r0'))}",
        f"sid-1-bbbb-r0  {logs.render(nccl)}",
    ]
    code, out, _ = run(capsys, "--since", "10m", "--raw")  # the new line alone, with its service
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == [
        {"service": "sid-1-bbbb-r0", "ts": now, "level": "error", "msg": "NCCL error: unhandled"}
    ]
    code, out, _ = run(capsys, "--grep", "control 9[89]", "--control")
    assert out.splitlines() == [f"control  {logs.render(record(f'control {i}'))}" for i in (98, 99)]
    assert run(capsys, "--grep", "hello", "--service", "sid-0")[1].count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--grep", "("], "--grep: '(' is not a regular expression"),
        (["--since", "5 minutes"], "--since: '5 minutes': expected a duration"),
        (["--since", "5m", "--follow"], "not with --follow"),
        (["--grep", "x", "--follow"], "name it with --service SID or --control"),
    ],
)
def test_bad_searches_exit_2_in_one_line(
    home: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_no_control_plane_log_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    code, _, err = run(capsys)
    assert code == 2 and "no log of the control plane (logs there: none yet)" in err


def _read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float = 60) -> list[str]:
    """Lines of ``proc``'s stdout up to the one containing ``needle``."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not printed; got {seen}")


@pytest.mark.integration
def test_follow_prints_appended_lines_across_rotation(home: Path) -> None:
    path = logs.log_file(home, "sid-0-aaaa-r0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dmsc", "logs", "--service", "sid-0", "--follow", "--raw"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "DMSC_HOME": str(home)},
    )
    try:
        assert "hello from" in _read_until(proc, "hello from")[-1]
        with path.open("a") as f:  # appended, in two writes of one line
            f.write(record("appended")[:10])
            f.flush()
            time.sleep(0.5)
            f.write(record("appended")[10:] + "\n")
        assert json.loads(_read_until(proc, "appended")[-1])["msg"] == "appended"
        # Rotated as RotatingFileHandler does: the file renamed, a new one under the name.
        with path.open("a") as f:
            f.write(record("last before rotation") + "\n")
        path.rename(path.with_name(path.name + ".1"))
        path.write_text(record("first after rotation") + "\n")
        got = _read_until(proc, "first after rotation")
        assert [json.loads(line)["msg"] for line in got] == [
            "last before rotation",
            "first after rotation",
        ]
        path.write_text(record("truncated") + "\n")  # the same file, shorter: read from the top
        assert "truncated" in _read_until(proc, "truncated")[-1]
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends a follow, quietly
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
