"""Hardware telemetry of real workers: per step, in their metrics, in ``dmsc status``, ``dmsc
tasks show`` and the database, checked against ``/proc`` read for the same processes here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from runtime_helpers import dmsc, make_plan

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.data.db import Database
from dmsc.data.traces import step_traces
from dmsc.runtime.control import status
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import resolve_model

pytestmark = pytest.mark.integration

SPEC = resolve_model("gpt-mini")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")
SLACK = 16 << 20  # what a worker's RSS may move between its reading and ours


def rss_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def cpu_s_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def mem_total() -> int:
    line = Path("/proc/meminfo").read_text().splitlines()[0]
    assert line.startswith("MemTotal:")
    return int(line.split()[1]) * 1024


def test_workers_report_their_use_per_step_in_health_and_in_their_metrics(
    tmp_path: Path,
) -> None:
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, SPEC.seq, seed=1)
    ranges = [("embedding", "block_1"), ("block_2", "head")]
    with Deployment(StageLayout(SPEC, ranges), home=tmp_path) as dep:
        pids = {k: c.call("Health")["pid"] for k, c in dep.clients.items()}
        for step in range(3):
            before = {k: rss_of(p) for k, p in pids.items()}
            out = dep.train_step(step, *corpus.batch(step, 8), 4)
            assert set(out["telemetry"]) == set(dep.clients)  # every worker, every step
            for k, use in out["telemetry"].items():
                assert use["cpu_percent"] > 0 and use["gpu_peak_bytes"] is None
                # RSS at the end of RunStep, between ours before the step and after its Commit
                # (what the step allocates for a moment, and frees, may stand out of that range)
                low, high = sorted((before[k], rss_of(pids[k])))
                assert low - 4 * SLACK <= use["rss_bytes"] <= high + 4 * SLACK, (k, use, low, high)

        time.sleep(1.2)  # a window of the CPU percentages closed since the workers started
        for k, c in dep.clients.items():
            health = c.call("Health")
            scraped = httpx.get(f"http://{health['metrics']}/metrics", timeout=10).text
            ours_rss, ours_cpu = rss_of(pids[k]), cpu_s_of(pids[k])
            value = {
                s.name: s.value
                for fam in text_string_to_metric_families(scraped)
                for s in fam.samples
            }
            for name in (
                "dmsc_worker_cpu_percent",
                "dmsc_worker_memory_rss_bytes",
                "dmsc_node_cpu_percent",
                "dmsc_node_memory_used_bytes",
            ):
                assert f"# HELP {name} " in scraped and f"# TYPE {name} gauge" in scraped
            assert abs(value["dmsc_worker_memory_rss_bytes"] - ours_rss) < SLACK, (k, ours_rss)
            assert abs(value["dmsc_worker_cpu_seconds_total"] - ours_cpu) < 0.5, (k, ours_cpu)
            assert value["dmsc_node_memory_total_bytes"] == mem_total()
            assert 0 <= value["dmsc_node_cpu_percent"] <= 100
            assert "dmsc_worker_gpu_memory_allocated_bytes" not in value  # a CPU worker
            seen = health["telemetry"]
            assert abs(seen["process"]["rss_bytes"] - ours_rss) < SLACK, (k, seen, ours_rss)
            assert seen["node"]["memory_total_bytes"] == mem_total() and seen["gpus"] == []

        services, nodes = status.survey(dep)
        assert all(s["cpu_percent"] is not None for s in services)
        assert all(abs(s["rss_bytes"] - rss_of(s["pid"])) < SLACK for s in services)
        (node,) = nodes
        assert node["node"] == "local" and node["workers"] == 2
        assert node["workers_rss_bytes"] == sum(s["rss_bytes"] for s in services)
        assert node["memory_total_bytes"] == mem_total()


def test_a_training_run_keeps_each_workers_use_and_status_shows_it(tmp_path: Path) -> None:
    res = dmsc(tmp_path, "up", "--plan", str(make_plan(tmp_path)))
    assert res.returncode == 0, res.stderr
    try:
        res = dmsc(tmp_path, "train", "--steps", "3", "--json")
        assert res.returncode == 0, res.stderr
        db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
        task = db.tasks()[-1].id
        traces = step_traces(db, task)
        assert [(t.step, t.stage) for t in traces] == [(s, st) for s in range(3) for st in (0, 1)]
        assert all(t.cpu_percent is not None and t.cpu_percent > 0 for t in traces)
        assert all(t.rss_bytes is not None and t.rss_bytes > 50 << 20 for t in traces)

        shown = json.loads(dmsc(tmp_path, "tasks", "show", str(task), "--json").stdout)
        for key in ("0/0", "1/0"):
            mine = [t for t in traces if f"{t.stage}/{t.replica}" == key]
            u = shown["workers"][key]
            assert u["steps"] == 3 and u["rss_bytes_max"] == max(t.rss_bytes or 0 for t in mine)
            cpu = [t.cpu_percent or 0.0 for t in mine]
            assert abs(u["cpu_percent_mean"] - sum(cpu) / 3) < 1e-9
        text = dmsc(tmp_path, "tasks", "show", str(task)).stdout
        assert "worker 0/0" in text and "3 steps measured" in text

        time.sleep(1.2)  # a window of the CPU percentages closed
        now = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        for s in now["services"]:
            assert s["cpu_percent"] is not None and abs(s["rss_bytes"] - rss_of(s["pid"])) < SLACK
        (node,) = now["nodes"]
        assert node["workers"] == 2 and node["memory_total_bytes"] == mem_total()
        assert 0 <= node["cpu_percent"] <= 100
        table = dmsc(tmp_path, "status").stdout
        assert "CPU %" in table and "busy %" in table and "nodes" in table
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
