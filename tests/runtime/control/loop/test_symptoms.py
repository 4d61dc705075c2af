"""Alerts from the logs (:mod:`dmsc.runtime.control.loop.symptoms`): the rule alone (raised once,
kept open while seen, resolved after the window), then on log files and a real database, the
control loop's own alert line written through the real file logger and read back on the next
tick without raising again."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dmsc.data.control_records import alerts
from dmsc.data.db import Database
from dmsc.runtime.control.launch.ray_logs import NodeTail
from dmsc.runtime.control.loop.symptoms import LogAlerts, Seen, judge
from dmsc.runtime.transport import logs
from dmsc.runtime.transport.log_search import Entry

T0 = 1_800_000_000.0


def _seen(name: str) -> Seen:
    return Seen(name, name, 1, ("sid-0",), "a line")


def test_a_symptom_is_raised_once_and_resolves_after_the_window() -> None:
    raised, resolved, open_ = judge([_seen("nccl")], {}, T0, window_s=300)
    assert [s.name for s in raised] == ["nccl"] and resolved == [] and open_ == {"nccl": T0}
    raised, resolved, open_ = judge([_seen("nccl"), _seen("gloo")], open_, T0 + 100, 300)
    assert [s.name for s in raised] == ["gloo"] and open_ == {"nccl": T0 + 100, "gloo": T0 + 100}
    raised, resolved, open_ = judge([], open_, T0 + 399, 300)
    assert raised == [] and resolved == []
    raised, resolved, open_ = judge([], open_, T0 + 400, 300)
    assert resolved == ["gloo", "nccl"] and open_ == {}


def test_a_workers_out_of_memory_raises_one_alert(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run("gpt-mini", "local-cpu", {}).id
    folder = logs.log_dir(tmp_path)
    log = logs.file_logger("test-symptoms", folder / "control.log")
    worker = folder / "sid-1-bbbb-r0.stderr"
    worker.write_text("RuntimeError: CUDA out of memory (before the loop: not new)\n")
    posted: list[int] = []
    watch = LogAlerts(folder, db, run, log, posted.append)
    assert watch.once(T0, 300) == []
    with worker.open("a") as f:
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    (alert,) = watch.once(T0 + 5, 300)
    (row,) = alerts(db, run)
    assert (row.id, row.slo, row.value, row.objective) == (alert, "log:out-of-memory", 2.0, 0.0)
    assert row.reason.startswith("2 log lines of sid-1-bbbb-r0 showed out of memory: torch.")
    assert posted == [alert] and row.webhook == "pending"
    # the loop's own warning quotes the line: written to control.log, read back, not raised
    last = json.loads((folder / "control.log").read_text().splitlines()[-1])
    assert last["msg"].startswith(f"alert {alert}: log:out-of-memory") and "CUDA" in last["msg"]
    assert watch.once(T0 + 10, 300) == [] and len(alerts(db, run)) == 1
    assert watch.once(T0 + 400, 300) == []  # not seen for the window: resolved
    (row,) = alerts(db, run)
    assert row.resolved_at is not None
    logging.getLogger("test-symptoms").handlers.clear()


def test_another_machines_symptom_lines_raise_an_alert_too(tmp_path: Path) -> None:
    """With workers on Ray, a node's host actor keeps its place in its node's logs
    (:class:`~dmsc.runtime.control.launch.ray_logs.NodeTail`, run here on a folder standing for
    that node's) and sends only its new lines that show a failure; the loop raises on them as
    on its own machine's."""
    node_home = tmp_path / "node"
    node_logs = logs.log_dir(node_home)
    worker = node_logs / "sid-2-cccc-r0.log"
    worker.write_text(json.dumps({"ts": "2027-01-15T08:00:00Z", "msg": "old: gloo error"}) + "\n")
    tail = NodeTail(node_home, T0 + 60)  # the control plane started after the old line
    assert tail.read()["entries"] == []
    with worker.open("a") as f:
        for msg in ("step done", "[gloo/transport/tcp/pair.cc] Connection closed by peer"):
            f.write(json.dumps({"ts": "2027-01-15T08:05:00Z", "msg": msg}) + "\n")
    got = tail.read()
    assert [line for _, _, line in got["entries"]] == [worker.read_text().splitlines()[-1]]
    assert tail.read()["entries"] == []  # nothing new
    db = Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}")
    run = db.new_run("gpt-mini", "local-cpu", {}).id
    folder = logs.log_dir(tmp_path / "here")
    log = logs.file_logger("test-symptoms-remote", folder / "control.log")
    far = [Entry(s, ts, line) for s, ts, line in got["entries"]]
    watch = LogAlerts(folder, db, run, log, remote=lambda: far)
    (alert,) = watch.once(T0 + 5, 300)
    (row,) = alerts(db, run)
    assert (row.id, row.slo) == (alert, "log:gloo")
    assert row.reason.startswith("1 log line of sid-2-cccc-r0 showed")
    logging.getLogger("test-symptoms-remote").handlers.clear()
