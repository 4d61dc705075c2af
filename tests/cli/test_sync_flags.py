"""``--sync`` and ``--compress`` on ``dmsc estimate``, ``plan`` and ``simulate``: the saving shows,
and a bad value exits 2 naming the option and the forms it accepts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import DmscRunner

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NSFNET = str(ROOT / "examples" / "clusters" / "nsfnet-4dc.yaml")
SCENARIO = str(ROOT / "examples" / "scenarios" / "nsfnet-cba.yaml")
# llama3-8b on all 1024 GPUs of NSFNET: each data-parallel group spans the four datacenters
ESTIMATE = ["estimate", "--cluster", NSFNET, "--model", "llama3-8b", "--tp", "8", "--pp", "1",
            "--dp", "128", "--global-batch", "512", "--allreduce", "ring", "--json"]  # fmt: skip


def _json(res) -> dict:  # type: ignore[no-untyped-def]
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_estimate_shows_the_saving(dmsc: DmscRunner) -> None:
    every = _json(dmsc(*ESTIMATE))
    diloco = _json(dmsc(*ESTIMATE, "--sync", "diloco:50"))
    packed = _json(dmsc(*ESTIMATE, "--sync", "diloco:50", "--compress", "int8"))
    dp = every["traffic_bytes"]["dp"]
    assert diloco["traffic_bytes"]["dp"] == pytest.approx(dp / 50, rel=1e-9)
    assert packed["traffic_bytes"]["dp"] == pytest.approx(dp / 50 * (1 + 4 / 256) / 2, rel=1e-9)
    assert every["breakdown_s"]["dp_comm"] > 0.1
    # a round's exchange is exposed whole, a fiftieth of it an iteration (netmodel/sync.py)
    assert 0 < diloco["breakdown_s"]["dp_comm"] < every["breakdown_s"]["dp_comm"] / 10
    assert diloco["iteration_time_s"] < every["iteration_time_s"]
    kinds = "traffic_by_link_kind_bytes"
    assert packed[kinds]["interdc"] < every[kinds]["interdc"] / 50
    assert packed["job"]["sync"] == {
        "mode": "diloco",
        "inner_steps": 50,
        "compress": "int8",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }
    assert every["job"]["sync"] == {
        "mode": "every-step",
        "inner_steps": 1,
        "compress": "none",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }
    table = dmsc(*ESTIMATE[:-1], "--sync", "fedavg:8", "--compress", "powersgd:4")
    assert table.returncode == 0 and "sync fedavg:8, powersgd:4" in " ".join(table.stdout.split())


def test_compress_goes_over_the_job_file_s_sync(tmp_path: Path, dmsc: DmscRunner) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("global_batch: 512\ntp: 8\ndp: 128\nsync: diloco:10\n")
    base = ["estimate", "--cluster", NSFNET, "--model", "llama3-8b", "--job", str(job), "--json"]
    out = _json(dmsc(*base, "--compress", "int8"))
    assert out["job"]["sync"] == {
        "mode": "diloco",
        "inner_steps": 10,
        "compress": "int8",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }
    out = _json(dmsc(*base, "--sync", "fedprox:4"))
    assert out["job"]["sync"] == {
        "mode": "fedprox",
        "inner_steps": 4,
        "compress": "none",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }


def test_plan_shows_the_saving(dmsc: DmscRunner) -> None:
    args = ["plan", "--cluster", NSFNET, "--model", "llama3-8b", "--global-batch", "512",
            "--tp", "8", "--pp", "4", "--dp", "32", "--json"]  # fmt: skip
    every = _json(dmsc(*args))
    diloco = _json(dmsc(*args, "--sync", "diloco:50", "--compress", "int8"))
    # once per 50 iterations, in int8 (about half of bf16): the islands may cut the layers
    # otherwise (the largest stage's gradient is what travels), so not exactly 1/100
    assert diloco["traffic_bytes"]["dp"] < every["traffic_bytes"]["dp"] / 50
    assert diloco["sync"] == {
        "mode": "diloco",
        "inner_steps": 50,
        "compress": "int8",
        "via": "collective",
        "aggregator": "mean",
        "privacy": "none",
        "secure": False,
    }
    assert diloco["iteration_time_s"] <= every["iteration_time_s"]


def test_simulate_runs_diloco_jobs_as_islands(dmsc: DmscRunner) -> None:
    run = ["simulate", "--scenario", SCENARIO, "--arrivals", "150", "--json"]
    every = _json(dmsc(*run))
    diloco = _json(dmsc(*run, "--sync", "diloco:50", "--compress", "int8"))
    assert all(j["sync"] == "diloco:50, int8" for j in diloco["jobs"])
    assert all("sync" not in j for j in every["jobs"])
    a, b = every["schedulers"]["cba"], diloco["schedulers"]["cba"]
    assert b["mean_iteration_time_s"] < a["mean_iteration_time_s"]
    assert b["bubble_ratio"] < a["bubble_ratio"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([*ESTIMATE, "--sync", "diloco"], "--sync: expected every-step, diloco:H, fedavg:H or"),
        ([*ESTIMATE, "--sync", "local:5"], "--sync: expected every-step, diloco:H"),
        ([*ESTIMATE, "--compress", "zip"], "--compress: expected none, bf16, int8, int8:BLOCK"),
        ([*ESTIMATE, "--compress", "topk:2"], "topk:F (0 < F <= 1"),
        ([*ESTIMATE, "--zero", "1", "--sync", "diloco:4"], "--sync: diloco keeps a whole"),
        (["plan", "--cluster", NSFNET, "--model", "llama3-8b", "--global-batch", "64",
          "--sync", "fedavg:0"], "--sync: expected every-step"),
        (["simulate", "--scenario", SCENARIO, "--arrivals", "5", "--compress", "powersgd:x"],
         "--compress: expected none"),
        (["simulate", "--scenario", SCENARIO, "--arrivals", "5", "--sync", "every-step:3"],
         "--sync: expected every-step"),
    ],
)  # fmt: skip
def test_bad_values_exit_2_naming_the_option(
    args: list[str], needle: str, dmsc: DmscRunner
) -> None:
    res = dmsc(*args)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and needle in err and "Traceback" not in err, res.stderr
