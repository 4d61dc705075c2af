"""Sync modes of data-parallel replicas on real worker processes, against references computed
in this process: plain data parallelism for DiLoCo with one inner step, and DiLoCo itself
re-implemented here step by step (two model copies, an anchor, Nesterov momentum)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.models.chain import layer_names
from dmsc.runtime.compute.outer_sync import by_collective
from dmsc.runtime.compute.reference import train_diloco_reference, train_reference
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.training.session import train
from dmsc.runtime.transport.messages import Health, SyncSettings
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")
NAMES = layer_names(SPEC)
WHOLE = [(NAMES[0], NAMES[-1])]  # one stage: each replica is the whole model
STEPS, BATCH, MICRO, LR = 6, 8, 2, 1e-3


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    train_text, _ = stdlib_text(max_bytes=400_000)
    return Corpus(train_text, SPEC.seq, seed=1)


@pytest.fixture(scope="module")
def dep():  # type: ignore[no-untyped-def]
    """Two replicas of the whole model, reset to their first weights by each test."""
    with Deployment(StageLayout(SPEC, WHOLE, replicas=2, lr=LR)) as d:
        d.start_ckpt = d.checkpoint(0, d.home / "start")  # type: ignore[attr-defined]
        yield d


def _run(dep, corpus: Corpus, sync: SyncSettings | None, steps: int = STEPS) -> list[float]:  # type: ignore[no-untyped-def]
    dep.restore(dep.start_ckpt)
    report = train(dep, corpus, corpus, steps, BATCH, MICRO, validate=False, sync=sync)
    return report.losses


def test_diloco_with_one_inner_step_is_data_parallelism(dep, corpus) -> None:  # type: ignore[no-untyped-def]
    """One inner SGD step and an outer SGD rate of 1 without momentum: the replicas apply the
    mean of their SGD steps, which is the SGD step of the mean gradient."""
    batches = [corpus.batch(s, BATCH) for s in range(STEPS)]
    reference = train_reference(SPEC, 0, LR, batches, MICRO, optimizer="sgd")
    plain = _run(dep, corpus, SyncSettings(inner_optimizer="sgd"))
    diloco = _run(
        dep,
        corpus,
        SyncSettings(
            mode="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0, inner_optimizer="sgd"
        ),
    )
    assert max(abs(a - b) for a, b in zip(plain, reference, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(diloco, reference, strict=True)) < 1e-5


def test_diloco_equals_its_reference_in_one_process(dep, corpus) -> None:  # type: ignore[no-untyped-def]
    s = SyncSettings(mode="diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    got = _run(dep, corpus, s, steps=5)  # rounds of 2, 2 and the last step alone
    batches = [corpus.batch(step, BATCH) for step in range(5)]
    want = train_diloco_reference(SPEC, 0, LR, batches, MICRO, 2, 2, 0.7, 0.9)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_a_rounds_exchange_is_in_the_trace_of_the_step_it_ends(dep, corpus) -> None:  # type: ignore[no-untyped-def]
    """A round's exchange runs as its last step is applied (the Commit call), after the step's
    trace was taken: DiLoCo's traces had no data-parallel time, and `dmsc status` no row."""
    dep.restore(dep.start_ckpt)
    s = SyncSettings(mode="diloco", inner_steps=2, compress="int8")
    for step in range(4):
        x, y = corpus.batch(step, BATCH)
        out = dep.train_step(step, x, y, MICRO, "1f1b", sync=s, outer=step % 2 == 1)
        for key, comm in out["comm"].items():
            if step % 2 == 0:  # an inner step: no exchange
                assert "dp" not in comm, (step, key, comm)
            else:
                assert comm["dp"]["calls"] >= 1 and comm["dp"]["s"] > 0, (step, key, comm)
                assert comm["dp"]["bytes"] > 0


@pytest.mark.parametrize(
    "sync",
    [
        SyncSettings(mode="diloco", inner_steps=2, compress="int8"),
        SyncSettings(compress="topk:0.05"),
        SyncSettings(compress="powersgd:2"),
        SyncSettings(mode="fedprox", inner_steps=2, compress="bf16"),
        SyncSettings(
            mode="fedavg", inner_steps=2, secure=True, privacy_clip=1.0, privacy_noise=0.01
        ),
    ],
    ids=["diloco-int8", "topk", "powersgd", "fedprox-bf16", "fedavg-secure-dp"],
)
def test_every_mode_trains_and_keeps_the_replicas_equal(dep, corpus, sync, request) -> None:  # type: ignore[no-untyped-def]
    dep.restore(dep.start_ckpt)
    before = _to_leader(dep)
    report = train(dep, corpus, corpus, 4, BATCH, MICRO, validate=False, sync=sync)
    assert all(math.isfinite(v) for v in report.losses)
    assert report.losses[-1] < report.losses[0]
    assert report.dp_bytes > 0
    # both replicas hold the same weights after the task's last round
    from dmsc.runtime.transport.messages import Save

    saved = {}
    for r in (0, 1):
        path = dep.home / request.node.callspec.id / f"r{r}.safetensors"
        dep.gather(
            dep.calls("Save", lambda e, p=path: Save(path=str(p), epoch=e), [(0, r)], 60), 60
        )
        from safetensors.torch import load_file

        saved[r] = load_file(str(path))
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    # what the follower sent is in its metrics, by kind: bf16 updates and PowerSGD's factors
    # are all-reduced among the replicas, int8 ones on the re-quantising ring, top-k payloads
    # all-gathered (as the cost model prices them); secure aggregation goes to the leader
    sent = _to_leader(dep) - before
    assert (sent > 0) is sync.secure, sent
    assert by_collective(sync) is not sync.secure, sync


def _to_leader(dep) -> float:  # type: ignore[no-untyped-def]
    """The bytes the follower has sent its stage leader for sync rounds (its metrics)."""
    health = dep.clients[(0, 1)].send("Health", Health(), timeout_s=5)
    text = httpx.get(f"http://{health['metrics']}/metrics", timeout=5).text
    return sum(
        float(ln.split()[-1])
        for ln in text.splitlines()
        if ln.startswith("dmsc_worker_bytes_sent_total") and 'kind="sync_part"' in ln
    )


def test_a_poisoned_replica_derails_the_mean_and_not_the_robust_aggregators(corpus) -> None:  # type: ignore[no-untyped-def]
    """Three replicas, one of which sends its round's update sign-flipped and scaled by 100."""
    layout = StageLayout(
        SPEC, WHOLE, replicas=3, lr=LR, faults={"stage0-r2": {"poison": {"scale": -100.0}}}
    )
    val: dict[str, tuple[float, float]] = {}
    with Deployment(layout) as d:
        start = d.checkpoint(0, d.home / "start")
        for aggregator in ("mean", "median", "trimmed-mean:0.34"):
            d.restore(start)
            sync = SyncSettings(mode="fedavg", inner_steps=2, aggregator=aggregator)
            r = train(d, corpus, corpus, 6, 12, 1, sync=sync)
            assert r.val_start is not None and r.val_end is not None
            val[aggregator] = (r.val_start, r.val_end)
    start_loss = val["mean"][0]
    assert not val["mean"][1] < start_loss  # derailed (worse than untrained, or NaN)
    for robust in ("median", "trimmed-mean:0.34"):
        assert val[robust][1] < start_loss - 0.1, (robust, val)


def test_a_federated_task_on_its_sites_own_files_reports_bytes_and_epsilon(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the control plane: FedAvg rounds on local shards with clipping and noise; the
    task's report names the mode, the bytes and the privacy spent."""
    from runtime_helpers import control_plane, one_box

    from dmsc.planner.solve import plan_job
    from dmsc.runtime.transport.messages import TrainRequest
    from dmsc.spec import ClusterSpec, JobSpec, load_spec

    cluster = load_spec(ClusterSpec, one_box(tmp_path, 2))
    plan = plan_job(cluster, SPEC, JobSpec(global_batch=8, micro_batch=2, dp=2), fixed=True).plan
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 60)
    sync = SyncSettings(
        mode="fedavg",
        inner_steps=2,
        local_data=True,
        skew=1.0,
        privacy_clip=1.0,
        privacy_noise=0.01,
    )
    (tmp_path / "home").mkdir()
    with control_plane(plan, tmp_path / "home", data_roots=[tmp_path]) as cp:
        out = cp.train(TrainRequest(steps=4, data=str(data), sync=sync))
        stored = cp.db.recent_tasks()[0]
    assert json.loads(stored.result_json)["sync"] == out["sync"]  # in the task's record
    s = out["sync"]
    assert s["mode"] == "fedavg:2" and s["local_data"] and s["rounds"] == 2
    assert s["dp_bytes"] > 0
    assert s["privacy"]["epsilon"] > 0 and s["privacy"]["rounds"] == 2
