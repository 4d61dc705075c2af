"""Output paths are checked before the work that writes them (``dmsc.cli.paths``): a plan, a
simulation or a calibration never runs to end in a traceback, and no directory is created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dmsc.cli import main
from dmsc.cli.paths import check_output
from dmsc.spec import SpecError

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-cpu.yaml")
SCENARIO = str(ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml")
PLAN = ["plan", "--cluster", LOCAL, "--model", "gpt-mini", "--global-batch", "8"]


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The planner, the simulation and the measurements fail the test if they start."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))

    def started(*_: Any, **__: Any) -> Any:
        raise AssertionError("the work started before its output path was checked")

    monkeypatch.setattr("dmsc.planner.solve.plan_job", started)
    monkeypatch.setattr("dmsc.cli.simulate.run_simulation", started)
    monkeypatch.setattr("dmsc.runtime.compute.calibrate.calibrate", started)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ([*PLAN, "--out"], "--out"),
        ([*PLAN, "--gantt"], "--gantt"),
        (["simulate", "--scenario", SCENARIO, "--plot"], "--plot"),
        (["simulate", "--scenario", SCENARIO, "--csv"], "--csv"),
        (["calibrate", "--out"], "--out"),
    ],
)
def test_a_missing_directory_is_bad_input_before_any_work(
    args: list[str],
    flag: str,
    tmp_path: Path,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "missing" / "result.png"
    code, out, err = run(capsys, *args, str(target))
    assert code == 2, (out, err)
    assert f"command line: {flag}: cannot write {target}" in err
    assert "does not exist" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not target.parent.exists()  # nothing created


def test_calibrate_itself_creates_no_directory(tmp_path: Path) -> None:
    from dmsc.runtime.compute.calibrate import calibrate

    target = tmp_path / "elsewhere" / "cluster.yaml"
    with pytest.raises(SpecError, match="does not exist"):
        calibrate(LOCAL, target)
    assert not target.parent.exists()


def test_check_output(tmp_path: Path) -> None:
    assert check_output(None, "--out") is None
    assert check_output(str(tmp_path / "plan.json"), "--out") == tmp_path / "plan.json"
    assert check_output("plan.json", "--out") == Path("plan.json")  # the working directory
    with pytest.raises(SpecError, match=r"--out: cannot write .*: it is a directory"):
        check_output(str(tmp_path), "--out")
    with pytest.raises(SpecError, match="--out: is empty"):
        check_output(" ", "--out")
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecError, match="is not a directory"):
        check_output(str(tmp_path / "file" / "plan.json"), "--out")
    assert check_output(str(tmp_path / "gantt.svg"), "--gantt", image=True) is not None
    assert check_output(str(tmp_path / "gantt"), "--gantt", image=True) is not None
    with pytest.raises(SpecError, match=r"--gantt: .*cannot draw a \.xyz file \(formats: .*png"):
        check_output(str(tmp_path / "gantt.xyz"), "--gantt", image=True)


def test_an_image_format_matplotlib_cannot_write_is_refused_first(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, *PLAN, "--gantt", str(tmp_path / "iteration.xyz"))
    assert code == 2 and "--gantt" in err and "cannot draw a .xyz file" in err
