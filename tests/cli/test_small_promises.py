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


@pytest.mark.parametrize(("given", "meant"), [("gpt-mnii", "gpt-mini"), ("llama3-8", "llama3-8b")])
def test_an_unknown_model_name_gets_a_did_you_mean(
    given: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "estimate", "--cluster", LOCAL, "--model", given)
    assert code == 2
    assert f"unknown model {given!r}; did you mean {meant}?" in " ".join(err.split())


def test_a_name_like_no_preset_lists_them_all(capsys: pytest.CaptureFixture[str]) -> None:
    from dmsc.spec import MODEL_PRESETS

    code, _, err = run(capsys, "estimate", "--cluster", LOCAL, "--model", "zzzz")
    line = " ".join(err.split())
    assert code == 2 and "did you mean" not in line
    assert all(name in line for name in MODEL_PRESETS)


@pytest.mark.parametrize(("kind", "seed"), [("full-mesh", 0), ("clustered", 0), ("star", 2)])
def test_topology_generate_prints_figures_as_written(
    kind: str, seed: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed ``km_total=59461.59999999999``, ``km_diameter=2864.6000000000004``: the
    float's noise, not the figure. The text has at most two decimals and the JSON's figures."""
    import json

    from dmsc.cli.app import console

    monkeypatch.setattr(console, "width", 80)  # puts it back after --wide
    args = ("topology", "generate", kind, "--seed", str(seed))
    _, text, _ = run(capsys, "--wide", *args)
    _, raw, _ = run(capsys, *args, "--json")
    figures = json.loads(raw)
    words = dict(w.split("=", 1) for w in re.findall(r'\w+=(?:"[^"]*"|\S+)', text))
    assert words["source"] == f'"{figures["source"]}"'  # its spaces inside quotes
    for key, value in figures.items():
        if isinstance(value, float):
            assert re.fullmatch(r"-?\d+(\.\d{1,2})?", words[key]), (key, words[key])
            assert float(words[key]) == pytest.approx(value, abs=0.005)
