"""The Control service's requests: typed messages refused at the boundary, naming the field.

A real gRPC server with the control plane's methods; no worker is started (a refused request never
reaches the deployment).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from dmsc.data.db import Database, control_file
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.control.plane import ControlPlane
from dmsc.runtime.transport.messages import CONTROL_SERVICE, MAX_INFER_TOKENS, TrainRequest
from dmsc.runtime.transport.rpc import BadRequest, Client, serve
from dmsc.spec import ClusterSpec, JobSpec, resolve_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plan() -> Plan:
    from dmsc.spec import load_spec

    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    model = resolve_model("gpt-mini")
    job = JobSpec(global_batch=8, micro_batch=2, pp=2)
    return plan_job(cluster, model, job, fixed=True).plan


@pytest.fixture
def control(
    plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ControlPlane, Client]]:
    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    cp = ControlPlane(plan, Database(f"sqlite:///{tmp_path / 'dmsc.sqlite'}"))
    server, port = serve(CONTROL_SERVICE, cp.methods())
    client = Client(f"127.0.0.1:{port}", CONTROL_SERVICE, timeout_s=10)
    try:
        yield cp, client
    finally:
        client.close()
        server.stop(grace=0)
        cp.deployment.shutdown()


def _refusal(client: Client, method: str, body: dict[str, object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        client.call(method, body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(info.value.details())


def test_infer_refuses_more_tokens_than_the_gateway_allows(control) -> None:  # type: ignore[no-untyped-def]
    _, client = control
    details = _refusal(client, "Infer", {"prompt": "def ", "tokens": 2000})
    assert "InferRequest" in details and "tokens" in details and str(MAX_INFER_TOKENS) in details
    assert "prompt" in _refusal(client, "Infer", {"prompt": "", "tokens": 4})


def test_unknown_fields_are_refused_by_name(control) -> None:  # type: ignore[no-untyped-def]
    _, client = control
    assert "temprature" in _refusal(
        client, "Infer", {"prompt": "def ", "tokens": 4, "temprature": 2}
    )
    assert "top_p" in _refusal(client, "Infer", {"prompt": "def ", "top_p": 0})
    assert "lr_schedule" in _refusal(client, "Train", {"steps": 3, "lr_schedule": "step"})
    assert "stepz" in _refusal(client, "Train", {"stepz": 3})
    assert "verbose" in _refusal(client, "Status", {"verbose": True})
    assert "steps" in _refusal(client, "Train", {"steps": "ten"})


def test_train_batch_must_divide_into_microbatches(control) -> None:  # type: ignore[no-untyped-def]
    cp, client = control
    details = _refusal(client, "Train", {"steps": 1, "batch": 6, "microbatches": 4})
    assert "divisible" in details
    assert not cp.db.tasks(cp.run.id)  # refused before a task was made


def test_train_params_default_to_the_plan(control) -> None:  # type: ignore[no-untyped-def]
    cp, _ = control
    p = cp.train_params(TrainRequest(steps=3))
    assert (p.steps, p.batch, p.microbatches) == (3, 8, cp.plan.job.microbatches)
    assert (p.checkpoint_every, p.late_policy, p.first_step) == (50, "wait", None)
    assert "first_step" not in p.as_json()
    with pytest.raises(BadRequest, match="divisible"):
        cp.train_params(TrainRequest(steps=1, batch=5, microbatches=2))


def test_control_file_is_under_the_data_directory(control, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert control_file() == tmp_path / "control.json"


def test_training_settings_are_checked_before_a_task_exists(control, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cp, client = control
    assert "warmup_steps (9) exceeds steps (3)" in _refusal(
        client, "Train", {"steps": 3, "warmup_steps": 9}
    )
    missing = tmp_path / "nowhere.txt"
    assert f"data: {missing}: no such file" in _refusal(
        client, "Train", {"steps": 3, "data": str(missing)}
    )
    short = tmp_path / "short.txt"
    short.write_text("too short to hold one sequence")
    assert "bytes of text" in _refusal(client, "Train", {"steps": 3, "data": str(short)})
    (tmp_path / "empty").mkdir()
    assert "holds no files" in _refusal(
        client, "Train", {"steps": 3, "data": str(tmp_path / "empty")}
    )
    assert not cp.db.tasks(cp.run.id)


def test_a_data_directory_holds_out_its_last_files(control, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cp, _ = control
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i in range(10):
        (corpus / "sub" / f"f{i}.txt").write_bytes(bytes([65 + i]) * 300)
    (corpus / ".hidden").write_bytes(b"!" * 300)
    train, valid = cp.corpora(str(corpus), seed=3)
    assert sorted(set(train.data.tolist())) == list(range(65, 74))  # A..I
    assert set(valid.data.tolist()) == {74}  # J: the last file, held out
    x, y = train.batch(0, 2)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    again, _ = cp.corpora(str(corpus), seed=3)
    other, _ = cp.corpora(str(corpus), seed=4)
    assert torch.equal(again.batch(5, 4)[0], train.batch(5, 4)[0])
    assert not torch.equal(other.batch(5, 4)[0], train.batch(5, 4)[0])
