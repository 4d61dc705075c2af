"""The control-plane process's settings: one ControlSettings object on standard input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dmsc.runtime.control.daemon import main, read_settings
from dmsc.runtime.transport.rpc import BadRequest


def test_settings_on_one_line_with_the_pipe_left_open() -> None:
    stream = io.StringIO(json.dumps({"plan": "p.json", "home": "/h", "spares": 1}) + "\nlater\n")
    s = read_settings(stream)
    assert (s.plan, s.home, s.spares, s.failure_timeout_s, s.gateway) == (
        "p.json",
        "/h",
        1,
        10.0,
        None,
    )
    assert stream.readline() == "later\n"  # nothing read past the object


def test_settings_over_several_lines_or_without_a_newline() -> None:
    body = {"plan": "p.json", "home": "/h", "gateway": "127.0.0.1:8080"}
    assert read_settings(io.StringIO(json.dumps(body, indent=2))).gateway == "127.0.0.1:8080"
    assert read_settings(io.StringIO(json.dumps(body))).plan == "p.json"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"plan": "p.json", "home": "/h", "failure_timeout": 3}, "failure_timeout"),
        ({"plan": "p.json", "home": "/h", "spares": 100}, "spares"),
        ({"home": "/h"}, "plan"),
        ({"plan": "p.json", "home": "/h", "failure_timeout_s": 0}, "failure_timeout_s"),
    ],
)
def test_bad_settings_name_the_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(BadRequest, match=field):
        read_settings(io.StringIO(json.dumps(body)))


def test_no_settings_at_all() -> None:
    with pytest.raises(BadRequest, match="no settings"):
        read_settings(io.StringIO(""))
    with pytest.raises(BadRequest, match="ControlSettings"):
        read_settings(io.StringIO("{not json"))


def test_main_refuses_bad_settings_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(io.StringIO(json.dumps({"plan": "p.json", "home": "/h", "router": 3})))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "READY" not in out and "router" in err


def test_main_refuses_a_missing_plan_and_logs_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DMSC_HOME", "elsewhere")  # the settings' home wins (and is restored)
    missing = tmp_path / "missing.json"
    with pytest.raises(SystemExit) as info:
        main(io.StringIO(json.dumps({"plan": str(missing), "home": str(tmp_path)})))
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "READY" not in out and str(missing) in err
    assert str(missing) in (tmp_path / "logs" / "control.log").read_text()
