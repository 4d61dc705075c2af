"""The gateway over HTTP (FastAPI's TestClient), with a scripted backend and a real database."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi.testclient import TestClient
from https_helpers import https_client, https_server

from dmsc.data.db import Database
from dmsc.runtime.business.auth import PrincipalCache, create_key, revoke, revoke_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.business.https import HSTS
from dmsc.runtime.control.tasks.task_queue import TaskQueue
from dmsc.runtime.transport.messages import Sampling, TrainRequest
from dmsc.runtime.transport.rpc import BadRequest


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Backend:
    """Two pipeline replicas; ``broken`` ones raise."""

    def __init__(self) -> None:
        self.broken: set[str] = set()
        self.calls: list[str] = []
        self.sampling: list[Sampling | None] = []

    def replicas(self) -> list[str]:
        return ["replica-0", "replica-1"]

    def infer_on(
        self,
        replica: str,
        prompt: str,
        tokens: int,
        cancel: threading.Event | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        sampling: Sampling | None = None,
    ) -> str:
        self.calls.append(replica)
        self.sampling.append(sampling)
        if replica in self.broken:
            raise ConnectionError(f"{replica} is down")
        return "x" * tokens

    def services(self) -> list[dict[str, Any]]:
        return [{"sid": r} for r in self.replicas()]

    def stage_count(self) -> int:
        return 2


@pytest.fixture(scope="module")
def https(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One HTTPS server for the module's tests over HTTPS (each sets its app)."""
    with https_server(tmp_path_factory.mktemp("https")) as holder:
        yield holder


@pytest.fixture(params=["http", "https"])
def env(tmp_path: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The gateway app and its client: in process (TestClient), or over HTTPS as ``dmsc up
    --tls`` serves it (the same tests, each answer also checked for HSTS)."""
    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    clock = Clock()
    backend = Backend()
    app = create_app(
        backend,
        db,
        TaskQueue(db, run.id),
        principals=PrincipalCache(db, ttl_s=0.5),
        rate=2,
        burst=4,
        max_body_bytes=2000,
        router="round_robin",
        breaker_threshold=2,
        breaker_reset_s=10,
        clock=clock,
    )
    keys = {
        name: create_key(db, tenant, scopes)
        for name, tenant, scopes in [
            ("alice", "alice", ["infer", "submit", "read"]),
            ("reader", "alice", ["read"]),
            ("bob", "bob", ["infer", "submit", "read"]),
        ]
    }
    app.state.principals = app.user_middleware[0].kwargs["principals"]
    if request.param == "http":
        yield TestClient(app), db, clock, backend, keys
        return
    client = https_client(request.getfixturevalue("https"), app)

    def strict(response: httpx.Response) -> None:
        assert response.headers["strict-transport-security"] == HSTS

    client.event_hooks["response"].append(strict)
    yield client, db, clock, backend, keys
    client.close()


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_auth_outcomes(env) -> None:  # type: ignore[no-untyped-def]
    client, db, _clock, _backend, keys = env
    body = {"prompt": "def ", "tokens": 3}
    assert client.post("/v1/infer", json=body).status_code == 401
    assert client.post("/v1/infer", json=body, headers=_h("nope")).status_code == 401
    assert client.post("/v1/infer", json=body, headers=_h(keys["reader"][1])).status_code == 403
    r = client.post("/v1/infer", json=body, headers=_h(keys["alice"][1]))
    assert r.status_code == 200 and r.json()["text"] == "xxx"
    revoke(db, keys["alice"][0], client.app.state.principals)  # type: ignore[attr-defined]
    assert client.post("/v1/infer", json=body, headers=_h(keys["alice"][1])).status_code == 401
    assert client.get("/v1/health").status_code == 200  # no key needed


def test_a_key_revoked_in_the_database_alone_is_refused_once_the_cache_lapses(env) -> None:  # type: ignore[no-untyped-def]
    client, db, _clock, _backend, keys = env
    h = _h(keys["bob"][1])
    assert client.get("/v1/models", headers=h).status_code == 200  # cached now
    revoke_key(db, keys["bob"][0])  # by another process: the gateway's cache is not told
    time.sleep(0.6)  # the cache's lifetime in this app
    assert client.get("/v1/models", headers=h).status_code == 401


def test_rate_limit_and_body_limit(env) -> None:  # type: ignore[no-untyped-def]
    client, _db, clock, _backend, keys = env
    body = {"prompt": "a", "tokens": 1}
    codes = [
        client.post("/v1/infer", json=body, headers=_h(keys["bob"][1])).status_code
        for _ in range(6)
    ]
    assert codes == [200] * 4 + [429] * 2
    r = client.post("/v1/infer", json=body, headers=_h(keys["bob"][1]))
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert client.post("/v1/infer", json=body, headers=_h(keys["alice"][1])).status_code == 200
    clock.t = 1.0  # two tokens back
    assert client.post("/v1/infer", json=body, headers=_h(keys["bob"][1])).status_code == 200
    big = {"prompt": "a" * 5000, "tokens": 1}
    assert client.post("/v1/infer", json=big, headers=_h(keys["alice"][1])).status_code == 413
    bad = client.post("/v1/infer", json={"prompt": "", "tokens": 0}, headers=_h(keys["alice"][1]))
    assert bad.status_code == 422


def test_failover_and_circuit_breaker(env) -> None:  # type: ignore[no-untyped-def]
    client, _db, clock, backend, keys = env
    backend.broken = {"replica-0"}
    for _ in range(2):
        clock.t += 1
        r = client.post(
            "/v1/infer", json={"prompt": "a", "tokens": 1}, headers=_h(keys["alice"][1])
        )
        assert r.status_code == 200 and r.json()["replica"] == "replica-1"
    # replica-0 failed twice: its breaker is open, so it is no longer even tried.
    backend.calls.clear()
    clock.t += 1
    client.post("/v1/infer", json={"prompt": "a", "tokens": 1}, headers=_h(keys["alice"][1]))
    clock.t += 1
    client.post("/v1/infer", json={"prompt": "a", "tokens": 1}, headers=_h(keys["alice"][1]))
    assert backend.calls == ["replica-1", "replica-1"]
    backend.broken = {"replica-0", "replica-1"}
    clock.t += 20
    r = client.post("/v1/infer", json={"prompt": "a", "tokens": 1}, headers=_h(keys["alice"][1]))
    assert r.status_code == 502 and "failed" in r.json()["detail"]


def test_tasks_and_metrics(env) -> None:  # type: ignore[no-untyped-def]
    client, _db, clock, _backend, keys = env
    r = client.post("/v1/tasks", json={"steps": 10, "priority": 5}, headers=_h(keys["alice"][1]))
    assert r.status_code == 202 and r.json()["state"] == "queued"
    tid = r.json()["id"]
    assert client.get(f"/v1/tasks/{tid}", headers=_h(keys["reader"][1])).json()["priority"] == 5
    assert client.get(f"/v1/tasks/{tid}", headers=_h(keys["bob"][1])).status_code == 404
    assert (
        client.delete(f"/v1/tasks/{tid}", headers=_h(keys["alice"][1])).json()["state"]
        == "cancelled"
    )
    assert client.delete(f"/v1/tasks/{tid}", headers=_h(keys["alice"][1])).status_code == 409
    clock.t += 10  # alice spent her burst above
    assert client.get("/v1/services", headers=_h(keys["reader"][1])).json()[0]["sid"] == "replica-0"
    text = client.get("/metrics").text
    assert "dmsc_gateway_requests_total" in text and 'status="202"' in text
    assert client.get("/openapi.json").json()["info"]["title"] == "dmsc gateway"


def test_a_stuck_replica_times_out_and_fails_over(tmp_path: Path) -> None:
    import time as _time

    class Slow(Backend):
        def infer_on(self, replica: str, prompt: str, tokens: int, **_: Any) -> str:
            if replica == "replica-0":
                _time.sleep(1.0)
            return super().infer_on(replica, prompt, tokens)

    db = Database(f"sqlite:///{tmp_path / 's.sqlite'}")
    run = db.new_run("m", "c", {})
    app = create_app(Slow(), db, TaskQueue(db, run.id), router="round_robin", backend_timeout_s=0.2)
    _, key = create_key(db, "t", ["infer"])
    r = TestClient(app).post("/v1/infer", json={"prompt": "a", "tokens": 1}, headers=_h(key))
    assert r.status_code == 200 and r.json()["replica"] == "replica-1"


def test_redundant_execution_takes_the_first_answer_and_cancels_the_other(tmp_path: Path) -> None:
    import time as _time

    class Race(Backend):
        cancelled: ClassVar[list[str]] = []
        slow_s = 30.0  # how long the slow copy takes unless cancelled

        def infer_on(
            self,
            replica: str,
            prompt: str,
            tokens: int,
            cancel: threading.Event | None = None,
            **_: Any,
        ) -> str:
            if replica == "replica-0":  # slow, token by token, until cancelled (30 s at most:
                # the test's outcome never depends on how fast a loaded machine runs the other)
                until = _time.monotonic() + self.slow_s
                while _time.monotonic() < until:
                    if cancel is not None and cancel.is_set():
                        self.cancelled.append(replica)
                        raise RuntimeError("cancelled")
                    _time.sleep(0.02)
            return super().infer_on(replica, prompt, tokens, cancel)

    db = Database(f"sqlite:///{tmp_path / 'r.sqlite'}")
    run = db.new_run("m", "c", {})
    backend = Race()
    app = create_app(backend, db, TaskQueue(db, run.id), router="round_robin")
    _, key = create_key(db, "t", ["infer"])
    client = TestClient(app)
    t0 = _time.perf_counter()
    body = {"prompt": "a", "tokens": 2, "redundant": True}
    r = client.post("/v1/infer", json=body, headers=_h(key))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["replica"] == "replica-1" and sorted(out["raced"]) == ["replica-0", "replica-1"]
    assert _time.perf_counter() - t0 < 15  # did not wait for the slow copy (30 s)
    for _ in range(500):
        if backend.cancelled:
            break
        _time.sleep(0.02)
    assert backend.cancelled == ["replica-0"]
    # One copy fails outright: the other answers.
    backend.broken, backend.slow_s = {"replica-1"}, 0.5
    r = client.post("/v1/infer", json=body, headers=_h(key))
    assert r.status_code == 200 and r.json()["replica"] == "replica-0"
    # Both fail: a 502 that says which.
    backend.broken = {"replica-0", "replica-1"}
    r = client.post(
        "/v1/infer", json={"prompt": "a", "tokens": 1, "redundant": True}, headers=_h(key)
    )
    assert r.status_code == 502 and "is down" in r.json()["detail"]


def test_models_exceptions_and_admin_requeue(env) -> None:  # type: ignore[no-untyped-def]
    from dmsc.data.db import ModelVersionRecord
    from dmsc.runtime.control.serving.model_store import promote

    client, db, clock, _, keys = env
    run_id = db.tasks()[0].run_id if db.tasks() else 1
    v = db.add(ModelVersionRecord(run_id=run_id, step=5, path="/x", sha256="a" * 64))
    promote(db, v.id)
    assert (
        client.get("/v1/models", headers=_h(keys["reader"][1])).json()[0]["status"] == "production"
    )
    clock.t += 10
    tid = client.post("/v1/tasks", json={"steps": 1}, headers=_h(keys["alice"][1])).json()["id"]
    from dmsc.runtime.control.tasks.task_queue import TaskQueue

    q = TaskQueue(db, run_id)
    task = q.claim("fcfs", lane="async")
    assert task is not None and task.id == tid
    for _ in range(3):
        q.fail(tid, RuntimeError("boom"))
        q.claim("fcfs", lane="async")
    clock.t += 10
    parked = client.get("/v1/exceptions", headers=_h(keys["reader"][1])).json()
    assert [p["id"] for p in parked] == [tid] and parked[0]["exception_type"] == "RuntimeError"
    assert client.post(f"/v1/tasks/{tid}/requeue", headers=_h(keys["alice"][1])).status_code == 403
    admin = create_key(db, "ops", ["admin"])[1]
    assert client.post(f"/v1/tasks/{tid}/requeue", headers=_h(admin)).json()["state"] == "queued"
    assert client.post(f"/v1/tasks/{tid}/requeue", headers=_h(admin)).status_code == 409


def test_queued_work_past_the_tenants_quota_is_429_and_running_tasks_cancel(
    tmp_path: Path,
) -> None:
    """A fuzzing tenant cannot fill the queue (it queued 101 tasks, 11.2 M steps); a running
    task is asked to stop (``cancelling``) instead of refused."""
    db = Database(f"sqlite:///{tmp_path / 'q.sqlite'}")
    run = db.new_run("m", "c", {})
    queue = TaskQueue(db, run.id, max_queued_tasks=3, max_queued_steps=1000)
    app = create_app(Backend(), db, queue, rate=1000, burst=1000)
    h = {t: _h(create_key(db, t, ["submit", "read"])[1]) for t in ("fuzz", "other")}
    client = TestClient(app)
    codes = [
        client.post("/v1/tasks", json={"steps": 10}, headers=h["fuzz"]).status_code
        for _ in range(4)
    ]
    assert codes == [202, 202, 202, 429]
    r = client.post("/v1/tasks", json={"steps": 10}, headers=h["fuzz"])
    assert "queued tasks" in r.json()["detail"] and r.headers["retry-after"]
    many = client.post("/v1/tasks", json={"steps": 1001}, headers=h["other"])
    assert many.status_code == 429 and "steps" in many.json()["detail"]
    assert client.post("/v1/tasks", json={"steps": 10}, headers=h["other"]).status_code == 202
    running = queue.claim("priority", lane="async")
    assert running is not None
    r = client.delete(f"/v1/tasks/{running.id}", headers=h[running.tenant])
    assert r.status_code == 200 and r.json()["state"] == "cancelling"
    queue.complete(running.id, cancelled=True)
    r = client.delete(f"/v1/tasks/{running.id}", headers=h[running.tenant])
    assert r.status_code == 409


def test_a_json_body_sent_as_a_form_is_read_as_json_and_a_key_has_its_own_rate(
    tmp_path: Path,
) -> None:
    """``curl -d '{...}'`` declares a form: the README's example got 422. A key made with
    ``--rate`` is limited at its own rate, the others at the gateway's."""
    db = Database(f"sqlite:///{tmp_path / 'f.sqlite'}")
    run = db.new_run("m", "c", {})
    app = create_app(Backend(), db, TaskQueue(db, run.id), rate=100, burst=100)
    _, slow = create_key(db, "slow", ["infer"], rate=0.5, burst=1)
    _, fast = create_key(db, "fast", ["infer"])
    client = TestClient(app)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    body = '{"prompt": "def ", "tokens": 2}'
    r = client.post("/v1/infer", content=body, headers={**_h(fast), **form})
    assert r.status_code == 200 and r.json()["text"] == "xx"
    assert client.post("/v1/infer", content=body, headers=_h(fast)).status_code == 200
    codes = [client.post("/v1/infer", content=body, headers=_h(slow)).status_code for _ in range(3)]
    assert codes == [200, 429, 429]
    assert client.post("/v1/infer", content=body, headers=_h(fast)).status_code == 200


def test_a_tenant_lists_its_own_tasks_and_an_admin_everyones(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'l.sqlite'}")
    run = db.new_run("m", "c", {})
    client = TestClient(create_app(Backend(), db, TaskQueue(db, run.id), rate=100, burst=100))
    h = {t: _h(create_key(db, t, ["submit", "read"])[1]) for t in ("ann", "bob")}
    admin = _h(create_key(db, "ops", ["admin"])[1])
    for tenant, steps in (("ann", 5), ("bob", 6), ("ann", 7)):
        client.post("/v1/tasks", json={"steps": steps}, headers=h[tenant])
    mine = client.get("/v1/tasks", headers=h["ann"]).json()
    assert [t["tenant"] for t in mine] == ["ann", "ann"] and mine[0]["id"] > mine[1]["id"]
    assert len(client.get("/v1/tasks", headers=admin).json()) == 3
    assert client.get("/v1/tasks?state=done", headers=h["ann"]).json() == []
    assert client.get("/v1/tasks?limit=0", headers=h["ann"]).status_code == 422
    assert client.get("/v1/tasks").status_code == 401


def test_sampling_settings_reach_the_backend_with_one_seed(env) -> None:  # type: ignore[no-untyped-def]
    client, _db, _clock, backend, keys = env
    h = _h(keys["alice"][1])
    body = {"prompt": "def ", "tokens": 3, "temperature": 0.5, "top_k": 7, "top_p": 0.9}
    r = client.post("/v1/infer", json={**body, "seed": 11}, headers=h)
    assert r.status_code == 200 and r.json()["seed"] == 11
    assert backend.sampling[-1] == Sampling(temperature=0.5, top_k=7, top_p=0.9, seed=11)
    r = client.post("/v1/infer", json={**body, "redundant": True}, headers=h)
    seeds = {s.seed for s in backend.sampling[-2:]}  # both copies draw the same bytes
    assert r.status_code == 200 and seeds == {r.json()["seed"]}
    bad = client.post("/v1/infer", json={**body, "top_p": 0}, headers=h)
    assert bad.status_code == 422 and "top_p" in bad.text


def test_task_settings_are_queued_and_checked_before_they_queue(env) -> None:  # type: ignore[no-untyped-def]
    client, db, _clock, backend, keys = env
    h = _h(keys["alice"][1])
    body = {"steps": 10, "lr": 3e-4, "lr_schedule": "cosine", "warmup_steps": 2, "seed": 4}
    r = client.post("/v1/tasks", json=body, headers=h)
    assert r.status_code == 202
    import json

    params = json.loads(db.tasks()[-1].params_json)
    assert {k: params[k] for k in body} == body

    def submit_task(req: TrainRequest, tenant: str) -> None:
        """The control plane's one way in refuses it (the real one, data roots included: tests/
        runtime/control/test_doors.py)."""
        raise BadRequest(f"batch ({req.batch}) must be divisible by microbatches x dp (2 x 1)")

    backend.submit_task = submit_task
    r = client.post("/v1/tasks", json={"steps": 1, "batch": 7}, headers=h)
    assert r.status_code == 422 and "divisible" in r.json()["detail"]
    assert len(db.tasks()) == 1
    # fields only the control plane sets are no part of the request
    r = client.post("/v1/tasks", json={"steps": 1, "first_step": 3}, headers=h)
    assert r.status_code == 422 and "first_step" in r.text


def test_an_answer_says_the_version_of_the_weights_that_produced_it(tmp_path: Path) -> None:
    """The answer's ``model_version`` is the backend's word for the weights that answered (the
    control plane's texts carry it), not the version the request was routed for: a replica
    that holds version 2's weights while version 1 is in production says 2, and weights no
    version holds (training's) say null."""
    from dmsc.data.db import ModelVersionRecord
    from dmsc.runtime.control.serving.held import Labelled
    from dmsc.runtime.control.serving.model_store import promote

    db = Database(f"sqlite:///{tmp_path / 'g.sqlite'}")
    run = db.new_run("gpt-mini", "local", {})
    v1 = db.add(ModelVersionRecord(run_id=run.id, step=5, path="/x", sha256="a" * 64))
    promote(db, v1.id)

    class Holding(Backend):
        held: ClassVar[dict[str, int | None]] = {"replica-0": 2, "replica-1": None}

        def infer_on(self, replica: str, prompt: str, tokens: int, **_: Any) -> str:
            return Labelled.of("x" * tokens, self.held[replica])

    client = TestClient(create_app(Holding(), db, TaskQueue(db, run.id), router="round_robin"))
    key = create_key(db, "t", ["infer"])[1]
    said = {
        (r := client.post("/v1/infer", json={"prompt": "a", "tokens": 2}, headers=_h(key)).json())[
            "replica"
        ]: r["model_version"]
        for _ in range(4)
    }
    assert said == {"replica-0": 2, "replica-1": None}
    plain = TestClient(create_app(Backend(), db, TaskQueue(db, run.id), router="round_robin"))
    out = plain.post("/v1/infer", json={"prompt": "a", "tokens": 2}, headers=_h(key)).json()
    assert out["model_version"] == v1.id  # a backend that does not say: the version routed for
