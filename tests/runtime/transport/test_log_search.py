"""Searching every log of a deployment (:mod:`dmsc.runtime.transport.log_search`) on files
written here as the processes write them, and the failure symptoms found in lines copied from
what PyTorch, NCCL, gloo and this project's checkpoints write."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dmsc.runtime.transport import logs
from dmsc.runtime.transport.log_search import (
    LogTail,
    line_time,
    parse_since,
    search,
    symptom_of,
)

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def rec(t: float, msg: str, sid: str = "", level: str = "info") -> str:
    """A JSON log line at unix time ``t`` as JsonFormatter writes it."""
    import time

    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"
    out = {"ts": ts, "level": level, "logger": "dmsc", "msg": msg}
    if sid:
        out["sid"] = sid
    return json.dumps(out)


def test_durations() -> None:
    assert [parse_since(t) for t in ("90", "30s", "5m", "2h", "1d", "1.5h")] == [
        90.0, 30.0, 300.0, 7200.0, 86400.0, 5400.0,
    ]  # fmt: skip
    for bad in ("", "5 minutes", "-3s", "1w", "m"):
        with pytest.raises(ValueError, match="expected a duration"):
            parse_since(bad)


def test_every_log_merged_in_time_order_since_a_time_and_matching(tmp_path: Path) -> None:
    folder = logs.log_dir(tmp_path)
    a, b = "sid-0-aaaa-r0", "sid-1-bbbb-r0"
    # the control plane's log, rotated once: its older lines in control.log.1
    (folder / "control.log.1").write_text(rec(T0, "serving at 127.0.0.1:1") + "\n")
    (folder / "control.log").write_text(
        rec(T0 + 20, "task 3 started") + "\n" + rec(T0 + 40, "task 3 failed: NCCL error") + "\n"
    )
    (folder / f"{a}.log").write_text(
        rec(T0 + 10, "step 1", a) + "\n"
        + rec(T0 + 30, "stage failed", a, "error") + "\n"
        + "Traceback (most recent call last):\n  torch.OutOfMemoryError: CUDA out of memory\n"
    )  # fmt: skip
    (folder / f"{b}.log").write_text(rec(T0 + 25, "step 1", b) + "\n")
    (folder / f"{b}.stderr").write_text("UserWarning: something a library printed\n")
    every = search(folder)
    assert [(e.service, e.ts) for e in every if e.ts is not None and e.ts >= T0] == [
        ("control", T0),
        (a, T0 + 10),
        ("control", T0 + 20),
        (b, T0 + 25),
        (a, T0 + 30),
        (a, T0 + 30),
        (a, T0 + 30),
        ("control", T0 + 40),
    ]  # fmt: skip (the traceback's two lines take the time of the record above them)
    assert any(e.service == b and "UserWarning" in e.line for e in every)  # stderr: no time
    since = search(folder, since_s=T0 + 25)
    assert {e.service for e in since} == {a, b, "control"}
    assert all(e.ts is not None and e.ts >= T0 + 25 for e in since)  # no stderr: no time
    fails = search(folder, re.compile(r"failed|out of memory", re.IGNORECASE))
    ends = ["stage failed", "CUDA out of memory", "task 3 failed: NCCL error"]
    assert [e.service for e in fails] == [a, a, "control"]
    assert all(e.rendered().endswith(end) for e, end in zip(fails, ends, strict=True))
    # the pattern sees the rendered line: level and service id match too
    assert [e.service for e in search(folder, re.compile(r"ERROR"))] == [a]
    assert [e.service for e in search(folder, re.compile("step"), services=[b])] == [b]
    assert line_time("not json") is None and line_time(rec(T0, "x")) == T0


@pytest.mark.parametrize(
    ("line", "symptom"),
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
            "79.15 GiB total capacity)",
            "out-of-memory",
        ),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not "
            "enough memory: you tried to allocate 1073741824 bytes. MemoryError",
            "out-of-memory",
        ),
        ("OSError: [Errno 12] Cannot allocate memory", "out-of-memory"),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
            "unhandled system error, NCCL version 2.21.5",
            "nccl",
        ),
        ("node0:1234:1290 [0] NCCL WARN Net : Connection closed by remote peer", "nccl"),
        (
            "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, "
            "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out. "
            "ProcessGroupNCCL timeout",
            "nccl",
        ),
        (
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
            "closed by peer [127.0.0.1]:29500",
            "gloo",
        ),
        (
            "RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/"
            "tcp/pair.cc:144] no error",
            "gloo",
        ),
        ("checkpoint fails its hash: stage-1.pt", "checkpoint"),
        (
            "checkpoint skipped while resuming the run: checkpoint cannot be read (EOFError)",
            "checkpoint",
        ),
        ("none of task 4's checkpoints is usable", "checkpoint"),
    ],
)
def test_a_failure_line_shows_its_symptom(line: str, symptom: str) -> None:
    for written in (line, rec(T0, line, "sid-0-aaaa-r0", "error")):  # plain and JSON
        found = symptom_of(written)
        assert found is not None and found.name == symptom


@pytest.mark.parametrize(
    "line",
    [
        "step 12: loss 3.21, 0.41 s",
        "memory: 1.2 GiB of 16 GiB",  # the word alone is no symptom
        "a checkpoint of step 20 written (3 files)",
        "gloo process group formed over 2 ranks",
        "NCCL version 2.21.5+cuda12.4",
        # the loop's own alert line quotes the line it raised on: not a second symptom
        "alert 3: log:out-of-memory: 1 log line of sid-0 showed out of memory: CUDA out of memory",
    ],
)
def test_ordinary_lines_show_none(line: str) -> None:
    assert symptom_of(rec(T0, line)) is None


def test_the_tail_reads_what_was_appended_across_a_rotation(tmp_path: Path) -> None:
    folder = logs.log_dir(tmp_path)
    path = folder / "control.log"
    path.write_text(rec(T0, "before the loop") + "\n")
    tail = LogTail(folder)
    assert tail.read() == []  # what was there before is not new
    with path.open("a") as f:
        f.write(rec(T0 + 1, "one") + "\n" + rec(T0 + 2, "half"))  # a line still being written
    assert [json.loads(e.line)["msg"] for e in tail.read()] == ["one"]
    with path.open("a") as f:
        f.write("\n")
    assert [json.loads(e.line)["msg"] for e in tail.read()] == ["half"]
    path.rename(folder / "control.log.1")  # rotated: a new file under the name
    path.write_text(rec(T0 + 3, "after") + "\n")
    (folder / "sid-0-aaaa-r0.stderr").write_text("Traceback: CUDA out of memory\n")  # new file
    got = tail.read()
    assert [(e.service, e.line) for e in got] == [
        ("control", rec(T0 + 3, "after")),
        ("sid-0-aaaa-r0", "Traceback: CUDA out of memory"),
    ]
    assert tail.read() == []


def test_a_tail_since_a_time_keeps_what_the_process_logged_before_its_first_read(
    tmp_path: Path,
) -> None:
    folder = logs.log_dir(tmp_path)
    (folder / "control.log").write_text(
        rec(T0 - 60, "checkpoint cannot be read: an earlier control plane's") + "\n"
        + rec(T0 + 1, "checkpoint skipped while resuming the run: checkpoint fails its hash")
        + "\n  a traceback line of it\n"
    )  # fmt: skip
    (folder / "sid-0-aaaa-r0.stderr").write_text("an old traceback, no time\n")
    got = LogTail(folder, since_s=T0).read()
    assert [e.line for e in got] == [
        rec(T0 + 1, "checkpoint skipped while resuming the run: checkpoint fails its hash"),
        "  a traceback line of it",
    ]
