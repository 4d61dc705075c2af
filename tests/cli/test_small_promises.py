"""Small promises of the CLI's words (issue 29, point 9): an infeasible plan says what its
count counts, an unknown model name gets a "did you mean", and ``topology generate`` prints its
kilometres as a person would write them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dmsc.cli import main

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-cpu.yaml")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def test_no_strategy_fits_says_what_it_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "no strategy fits on 3 devices (memory: 48)": 48 of what?"""
    code, _, err = run(
        capsys, "plan", "--cluster", LOCAL, "--model", "gpt3-175b", "--global-batch", "8"
    )
    assert code == 1
    line = " ".join(err.split())
    m = re.search(r"no strategy fits on 3 devices: none of the (\d+) configurations tried", line)
    assert m is not None, line
    assert f"({m[1]} need more memory than a device has" in line
    leanest = re.search(
        r"the leanest: stage \d+ needs ([\d.]+) GiB per device, devices have (\d+)", line
    )
    assert leanest is not None, line
    assert float(leanest[1]) > float(leanest[2])
