"""``dmsc infer --batch FILE`` on a control plane with real workers: the file's requests run as
one queued ``infer`` task (``dmsc tasks`` see it), their answers are stored with the task and
printed in order; the gateway's ``POST /v1/tasks/infer`` queues the same batch, which the queue's
consumer runs to the same answers. A bad line is refused before anything is queued, naming the
file, the line and the field."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.cli import main
from dmsc.cli.infer_batch import one_line
from dmsc.data.db import TaskRecord
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.control.tasks import work_loop
from dmsc.runtime.transport.messages import CONTROL_SERVICE, InferBatch, InferRequest
from dmsc.runtime.transport.rpc import serve

LINES = [
    {"prompt": "def f(", "tokens": 3, "temperature": 0, "seed": 1},
    {"prompt": "import ", "tokens": 2, "seed": 7, "top_k": 5, "session": "s1"},
]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    home = tmp_path_factory.mktemp("home")
    mp = pytest.MonkeyPatch()
    mp.setenv("DMSC_HOME", str(home))
    with control_plane(local_plan(), home) as cp:
        cp.stopped.clear()  # no consumer runs: the call's thread works its lane
        server, port = serve(CONTROL_SERVICE, cp.methods())
        info = {"address": f"127.0.0.1:{port}", "pid": os.getpid()}
        (home / "control.json").write_text(json.dumps(info))
        try:
            yield cp
        finally:
            server.stop(grace=0)
            mp.undo()


def _dmsc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``dmsc ARGS`` in this process: exit code, standard output and error."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out = capsys.readouterr()
    return int(info.value.code or 0), out.out, out.err


def _batch(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_batch_runs_as_one_queued_task_and_prints_its_answers(
    plane: ControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cp = plane
    f = _batch(tmp_path / "batch.jsonl", [json.dumps(LINES[0]), "", json.dumps(LINES[1])])
    code, out, err = _dmsc(capsys, "infer", "--batch", str(f), "--json")
    assert code == 0, err
    printed = [json.loads(line) for line in out.splitlines()]
    assert [p["line"] for p in printed] == [1, 3]
    task = cp.db.tasks(cp.run.id)[-1]
    assert (task.kind, task.state, task.lane) == ("infer", "done", "sync")
    assert {p["task"] for p in printed} == {task.id}
    stored = json.loads(task.result_json)["answers"]
    assert [a["text"] for a in stored] == [p["text"] for p in printed]
    # each answer is the one the Infer call gives the same request (same weights and seed)
    for line, answer in zip(LINES, stored, strict=True):
        alone = cp.infer(InferRequest(**line))
        assert alone["text"] == answer["text"] and alone["seed"] == answer["seed"]
        assert len(answer["token_ids"]) == line["tokens"]
    code, out, err = _dmsc(capsys, "infer", "--batch", str(f))
    assert code == 0, err
    assert out.split("\n")[:-1] == [one_line(a["text"]) for a in stored]
    assert [json.loads(f'"{line}"') for line in out.split("\n")[:-1]] == [a["text"] for a in stored]
    code, out, err = _dmsc(capsys, "tasks", "show", str(task.id), "--json")
    assert code == 0 and json.loads(out)["result"]["answers"] == stored


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"prompt": "x", "tokens": 0}', "line 2: tokens: "),
        ('{"prompt": "x", "temprature": 0}', "line 2: temprature"),
        ("not json", "line 2: not JSON"),
        ('["x"]', "line 2: a request is a JSON object"),
        ('{"prompt": "x", "aggregate": "vote"}', "line 2: aggregate: "),  # the plane's check
        ('{"prompt": "x", "redundant": true}', "line 2: redundant: "),
    ],
)
def test_a_bad_line_names_the_file_line_and_field_and_queues_nothing(
    plane: ControlPlane,
    tmp_path: Path,
    line: str,
    said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cp = plane
    before = len(cp.db.tasks(cp.run.id))
    f = _batch(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', line])
    code, _, err = _dmsc(capsys, "infer", "--batch", str(f))
    assert code == 2, err
    assert str(f) in err and said in " ".join(err.split())
    assert "Traceback" not in err
    assert len(cp.db.tasks(cp.run.id)) == before


def test_the_gateway_queues_the_same_batch_and_the_consumer_runs_it(plane: ControlPlane) -> None:
    cp = plane
    gateway = TestClient(create_app(cp, cp.db, cp.queue))
    auth = {"Authorization": f"Bearer {create_key(cp.db, 'alice', ['submit', 'read'])[1]}"}
    r = gateway.post("/v1/tasks/infer", json={"requests": LINES}, headers=auth)
    assert r.status_code == 202, r.text
    task_id = r.json()["id"]
    assert work_loop.run_next(cp, cp.queue, "sync", "priority", cp.handoff)
    got = gateway.get(f"/v1/tasks/{task_id}", headers=auth).json()
    assert got["state"] == "done" and got["kind"] == "infer"
    texts = [cp.infer(InferRequest(**line))["text"] for line in LINES]
    assert [a["text"] for a in got["result"]["answers"]] == texts


def test_a_running_batch_cancelled_stops_and_keeps_the_answers_it_has(plane: ControlPlane) -> None:
    cp = plane
    long = [{"prompt": "def ", "tokens": 4}] + [{"prompt": "x", "tokens": 1024}] * 2
    task = cp.batches.submit(InferBatch(requests=[InferRequest(**r) for r in long]))
    runner = threading.Thread(
        target=work_loop.run_next, args=(cp, cp.queue, "sync", "priority", cp.handoff)
    )
    runner.start()

    def answered() -> int:
        with cp.db.sessions() as s:
            got = s.get(TaskRecord, task.id)
            return len(json.loads(got.result_json)["answers"]) if got and got.result_json else 0

    wait_for(answered, 60, "the batch's first answer")
    assert cp.queue.cancel(task.id) == "cancelling"
    runner.join(60)
    assert not runner.is_alive()
    ended = next(t for t in cp.db.tasks(cp.run.id) if t.id == task.id)
    assert ended.state == "cancelled"
    assert 1 <= len(json.loads(ended.result_json)["answers"]) < len(long)
