"""Bad input names the real problem: the flag that is wrong, not what an earlier check tripped on
(run in this process; every case exits 2 with one line on standard error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dmsc.cli import main
from dmsc.runtime.transport.messages import MAX_INFER_TOKENS

ROOT = Path(__file__).resolve().parents[2]
SELENE = str(ROOT / "examples" / "clusters" / "a100-selene.yaml")
LOCAL = str(ROOT / "examples" / "clusters" / "local-cpu.yaml")
VISION = str(ROOT / "examples" / "models" / "multitask-vision.yaml")
SCENARIO = str(ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def bad_input(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--cluster", LOCAL, "--model", "gpt-mini", "--tp", "0", "--pp", "1", "--dp", "1"],
        ["estimate", "--cluster", SELENE, "--model", "gpt3-1.3b", "--tp", "0"],
    ],
)
def test_tp_0_blames_tp_not_the_missing_global_batch(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = bad_input(capsys, *args)
    assert "command line: --tp: Input should be greater than 0" in err
    assert "--global-batch: is required" not in err


def test_a_missing_global_batch_alone_is_still_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = bad_input(capsys, "estimate", "--cluster", SELENE, "--model", "gpt3-1.3b")
    assert "command line: --global-batch: is required" in err


def test_a_misspelt_job_file_field_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("globl_batch: 64\ntp: 2\n")
    args = ["estimate", "--cluster", SELENE, "--model", "gpt3-1.3b", "--job", str(job)]
    err = bad_input(capsys, *args)
    assert f"{job}: globl_batch: unknown field; did you mean global_batch?" in err


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("gpt3-1.3b", ["--layers", "-1"]),
        (None, ["--layers", "-1", "--hidden", "64", "--heads", "4", "--seq", "8", "--vocab", "9"]),
    ],
)
def test_a_bad_shape_flag_blames_the_flag_not_the_preset(
    model: str | None, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    named = ["--model", model] if model else []
    err = bad_input(capsys, "estimate", "--cluster", SELENE, *named, *flags, "--global-batch", "8")
    assert "command line: --layers: Input should be greater than 0" in err
    assert "preset" not in err


@pytest.mark.parametrize(
    ("model", "flags", "line"),
    [
        (
            "gpt-mini",
            ["--heads", "7"],
            "command line: --heads: 7 does not divide the hidden size 128 of preset gpt-mini",
        ),
        (
            "gpt-mini",
            ["--hidden", "130"],
            "command line: --hidden: 130 is not divisible by the 4 heads of preset gpt-mini",
        ),
        (
            "gpt-mini",
            ["--hidden", "130", "--heads", "4"],
            "command line: --heads: 4 does not divide the hidden size 130 given by --hidden",
        ),
        (
            "llama3-8b",
            ["--heads", "4"],
            "command line: --heads: 4 is not a multiple of the 8 kv_heads of preset llama3-8b",
        ),
        (
            None,
            ["--layers", "2", "--hidden", "130", "--heads", "4", "--seq", "8", "--vocab", "9"],
            "command line: --heads: 4 does not divide the hidden size 130 given by --hidden",
        ),
    ],
)
def test_a_shape_flag_that_clashes_with_the_preset_is_blamed_not_the_preset(
    model: str | None, flags: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--heads 7`` on gpt-mini said ``preset gpt-mini: hidden: 128 is not divisible by
    heads=7``: the preset is fine, the flag is what to change."""
    named = ["--model", model] if model else []
    err = bad_input(capsys, "estimate", "--cluster", SELENE, *named, *flags, "--global-batch", "16")
    assert err.strip() == f"error: {line}"


def test_a_shape_flag_that_clashes_with_a_model_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "model.yaml"
    spec.write_text("layers: 2\nhidden: 256\nheads: 8\nkv_heads: 4\nseq: 64\nvocab: 100\n")
    args = ["estimate", "--cluster", SELENE, "--model", str(spec), "--global-batch", "16"]
    err = bad_input(capsys, *args, "--heads", "6")
    assert f"command line: --heads: 6 does not divide the hidden size 256 of {spec}" in err
    err = bad_input(capsys, *args, "--heads", "2")
    assert f"command line: --heads: 2 is not a multiple of the 4 kv_heads of {spec}" in err
    err = bad_input(capsys, *args, "--hidden", "260")
    assert f"command line: --hidden: 260 is not divisible by the 8 heads of {spec}" in err


@pytest.mark.parametrize("method", ["block", "business"])
def test_block_segmentation_of_a_preset_says_it_needs_a_block_graph(
    method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = bad_input(
        capsys, "segment", "--cluster", SELENE, "--model", "gpt3-1.3b", "--method", method
    )
    assert f"--method: {method} segmentation needs a block graph" in err
    assert "no such file" not in err


def test_layer_segmentation_of_a_block_graph_names_the_methods_that_cut_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = bad_input(capsys, "segment", "--cluster", SELENE, "--model", VISION)
    assert f"{VISION}: kind: a block graph is cut with --method block" in err


def test_compare_list_strips_spaces(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def fake(_: str, schedulers: list[str], loads: list[float] | None, *rest: Any) -> None:
        seen.update(schedulers=schedulers, loads=loads)

    monkeypatch.setattr("dmsc.cli.simulate.run_simulation", fake)
    args = ["simulate", "--scenario", SCENARIO, "--compare", "baseline, cba", "--loads", "1, 2"]
    code, _, err = run(capsys, *args)
    assert code == 0, err
    assert seen == {"schedulers": ["baseline", "cba"], "loads": [1.0, 2.0]}


def test_infer_tokens_name_the_flag_and_the_gateways_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = bad_input(capsys, "infer", "--prompt", "x", "--tokens", "100000")
    assert "command line: --tokens: Input should be less than or equal to " in err
    assert f"less than or equal to {MAX_INFER_TOKENS}" in err
