"""Task heads on real workers: each data-parallel replica's last stage trained as its own head
(the backbone averaged, the heads not), against a reference in this process; and
``Infer(aggregate=...)`` through the control plane, its tokens checked against the heads' own
logits combined here."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from runtime_helpers import control_plane, local_plan, one_box

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.runtime.business.auth import create_key
from dmsc.runtime.business.gateway import create_app
from dmsc.runtime.compute.models.chain import layer_names, loss_fn
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.serving.combiners import combine
from dmsc.runtime.control.training.session import train
from dmsc.runtime.transport.messages import InferRequest, Save, SyncSettings, TrainRequest
from dmsc.runtime.transport.rpc import BadRequest
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

SPEC = resolve_model("gpt-mini")
NAMES = layer_names(SPEC)
SPLIT = 3  # chain index of the head's first layer: embedding, block_0, block_1 | block_2 ..
TWO_STAGES = [(NAMES[0], NAMES[SPLIT - 1]), (NAMES[SPLIT], NAMES[-1])]
STEPS, BATCH, MICRO, LR = 4, 8, 2, 3e-3


def heads_reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Two replicas in one process: one backbone whose gradient is the mean of the replicas',
    and two heads, each with the gradient of its own replica's loss only. AdamW is elementwise,
    so one optimizer over all of them is each replica's own."""
    backbone = stage_module(SPEC, 0, *TWO_STAGES[0])
    heads = [stage_module(SPEC, 0, *TWO_STAGES[1]) for _ in range(2)]  # replicas start equal
    params = [*backbone.parameters(), *(p for h in heads for p in h.parameters())]
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for tokens, targets in batches:
        step_loss = 0.0
        for r, (xr, yr) in enumerate(zip(tokens.chunk(2), targets.chunk(2), strict=True)):
            for x, y in zip(xr.chunk(MICRO), yr.chunk(MICRO), strict=True):
                loss = loss_fn(heads[r](backbone(x)), y) / MICRO
                # the backbone gets half of each replica's gradient (their mean), the head all
                head_grads = torch.autograd.grad(
                    loss, list(heads[r].parameters()), retain_graph=True
                )
                (loss / 2).backward()
                for p, g in zip(heads[r].parameters(), head_grads, strict=True):
                    p.grad += g / 2  # the other half: the head keeps its whole gradient
                step_loss += float(loss.detach()) / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


@functools.cache  # one reference for the tp = 1 and tp = 2 runs
def _heads_want() -> list[float]:
    train_text, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train_text, SPEC.seq, seed=1)
    return heads_reference([corpus.batch(s, BATCH) for s in range(STEPS)])


def _saved(dep: Deployment, key: tuple[int, int], folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = folder / f"stage{key[0]}-r{key[1]}.safetensors"
    dep.gather(dep.calls("Save", lambda e: Save(path=str(path), epoch=e), [key], 60), 60)
    return load_file(str(path))


@pytest.mark.parametrize("tp", [1, 2])
def test_each_replica_trains_its_own_head_on_a_shared_backbone(tp: int) -> None:
    """At tp = 2 each rank averages its shard of the backbone and keeps its shard of the head
    (it used to be refused); the saved files are gathered whole, per replica."""
    train_text, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train_text, SPEC.seq, seed=1)
    sync = SyncSettings(task_heads=True)
    with Deployment(StageLayout(SPEC, TWO_STAGES, replicas=2, tp=tp, lr=LR)) as dep:
        report = train(dep, corpus, corpus, STEPS, BATCH, MICRO, validate=False, sync=sync)
        backbone = [_saved(dep, (0, r), dep.home) for r in (0, 1)]  # Save writes below home
        heads = [_saved(dep, (1, r), dep.home) for r in (0, 1)]
    want = _heads_want()
    assert max(abs(a - b) for a, b in zip(report.losses, want, strict=True)) < 1e-4
    assert all(torch.equal(backbone[0][k], backbone[1][k]) for k in backbone[0])
    assert any(not torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


def test_task_heads_are_refused_where_there_is_no_head_to_own() -> None:
    with pytest.raises(ValueError, match="task_heads: a round averages whole models"):
        SyncSettings(mode="diloco", inner_steps=5, task_heads=True)


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    cluster = load_spec(ClusterSpec, one_box(tmp_path_factory.mktemp("box"), 4))
    job = JobSpec(global_batch=8, micro_batch=2, pp=2, dp=2)
    return plan_job(cluster, SPEC, job, fixed=True).plan


def test_infer_aggregates_the_heads_it_trained(four_devices: Plan, tmp_path: Path) -> None:
    with control_plane(four_devices, tmp_path) as cp:
        req = InferRequest(prompt="def ", tokens=6, temperature=0.0, aggregate="weighted")
        with pytest.raises(BadRequest, match="train with --task-heads first"):
            cp.infer(req)
        cp.train(TrainRequest(steps=4, lr=3e-3, sync=SyncSettings(task_heads=True)))
        out = cp.infer(req)
        assert out["replica"] == "heads" and out["answered"] == [0, 1]
        cal = out["calibration"]
        assert cal["windows"] == 256 and len(cal["accuracy"]) == 2
        assert out["weights"] == cal["accuracy"]
        # the reference: each head's logits of the prompt, asked directly, combined here
        ctx = torch.tensor([list(b"def ")])
        probs = [torch.softmax(cp.deployment.logits(1, ctx, r)[0:1], -1) for r in (0, 1)]
        assert out["token_ids"][0] == int(combine("weighted", probs, out["weights"]).argmax())
        assert len(out["token_ids"]) == 6 and out["text"] == bytes(out["token_ids"]).decode(
            "utf-8", "replace"
        )
        for method in ("vote", "attention"):
            got = cp.infer(req.model_copy(update={"aggregate": method}))
            assert got["aggregate"] == method and len(got["token_ids"]) == 6
        # the gateway's /v1/infer takes the same request and gives the same combined answer
        gateway = TestClient(create_app(cp, cp.db, cp.queue))
        auth = {"Authorization": f"Bearer {create_key(cp.db, 'alice', ['infer'])[1]}"}
        r = gateway.post("/v1/infer", json=req.model_dump(exclude_none=True), headers=auth)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == out["text"] and r.json()["aggregate"] == "weighted"
        assert r.json()["answered"] == [0, 1] and r.json()["replica"] == "heads"
        # the version the task saved holds every head: loaded again, the same answer
        cp.inference.heads = False
        for r in (0, 1):
            cp.inference.healed(r)  # forgets what the replica serves
        cp.inference.sync_versions()
        assert cp.inference.heads and cp.infer(req)["token_ids"] == out["token_ids"]
        # a head that fails drops out; the other answers alone
        victim = next(
            h for h in cp.deployment.handles if (h.config.stage, h.config.replica) == (1, 1)
        )
        victim.process.kill()
        victim.process.wait(timeout=10)
        alone = cp.infer(req)
        assert alone["answered"] == [0] and "1" in alone["missing"]
        assert [t.state for t in cp.db.tasks() if t.kind == "infer"][-1] == "done"


def test_aggregate_on_one_replica_says_why_not(tmp_path: Path) -> None:
    with control_plane(local_plan(), tmp_path) as cp:
        with pytest.raises(BadRequest, match="one replica holds one head"):
            cp.infer(InferRequest(prompt="x", tokens=2, aggregate="vote"))
        with pytest.raises(ValueError, match=r"sync\.task_heads: .* dp >= 2"):
            cp.train_params(TrainRequest(steps=1, sync=SyncSettings(task_heads=True)))
