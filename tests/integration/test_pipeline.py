"""Pipelines of real worker processes on 127.0.0.1 against single-process training."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch
from runtime_helpers import reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.compute.reference import train_reference
from dmsc.runtime.compute.worker import STAGE_SERVICE
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.transport.rpc import Client
from dmsc.runtime.transport.wire import Kind, encode
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")
STEPS = 10
MICRO = 4


@pytest.fixture(scope="module")
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train, SPEC.seq, seed=1)
    return [corpus.batch(s, 8) for s in range(STEPS)]


@pytest.fixture(scope="module")
def reference(batches) -> list[float]:  # type: ignore[no-untyped-def]
    return reference_losses(SPEC, 0, 1e-3, batches, MICRO)


RANGES = {
    2: [("embedding", "block_1"), ("block_2", "head")],
    3: [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")],
}


@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_equals_single_process(stages: int, batches, reference) -> None:  # type: ignore[no-untyped-def]
    for schedule in ("gpipe", "1f1b"):
        with Deployment(StageLayout(SPEC, RANGES[stages])) as dep:
            losses = [
                dep.train_step(s, x, y, MICRO, schedule)["loss"] for s, (x, y) in enumerate(batches)
            ]
        assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-5, schedule


def test_data_parallel_pipeline_equals_single_process(batches, reference) -> None:  # type: ignore[no-untyped-def]
    with Deployment(StageLayout(SPEC, RANGES[2], replicas=2)) as dep:
        outs = [dep.train_step(s, x, y, MICRO // 2, "1f1b") for s, (x, y) in enumerate(batches)]
    losses = [o["loss"] for o in outs]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-5
    _check_traces(outs[-1]["traces"], STEPS - 1, MICRO // 2)


class _TreeDeployment(Deployment):
    """A deployment whose workers run the tree all-reduce, as a plan's ``allreduce: tree``
    stage makes them (its layout carries the plan's choice into each worker's configuration)."""

    def config(self, stage: int, replica: int, tp_rank: int = 0) -> WorkerConfig:
        return replace(super().config(stage, replica, tp_rank), allreduce="tree")


def test_data_parallel_tree_all_reduce_equals_single_process(batches, reference) -> None:  # type: ignore[no-untyped-def]
    """dp = 4 replicas of one stage averaging by the binary tree (replica 0 the root, 1 and 2
    its children, 3 the child of 1): the reference's losses, and each replica's bytes to each
    peer the tree's, the whole gradient each way along each edge of the tree."""
    steps = 2  # the second step's loss is of the first's averaged gradients
    with _TreeDeployment(StageLayout(SPEC, [("embedding", "head")], replicas=4)) as dep:
        outs = [dep.train_step(s, x, y, 1) for s, (x, y) in enumerate(batches[:steps])]
    losses = [o["loss"] for o in outs]
    assert max(abs(a - b) for a, b in zip(losses, reference[:steps], strict=True)) < 1e-5
    n = 4 * sum(p.numel() for p in stage_module(SPEC, 0, "embedding", "head").parameters())
    edges = {(1, 0), (2, 0), (3, 1)}
    for r in range(4):
        sent = outs[-1]["traces"][(0, r)][1]
        assert sent == {f"0/{b}": n for a, b in [*edges, *((b, a) for a, b in edges)] if a == r}


def _check_traces(traces, step: int, m: int) -> None:  # type: ignore[no-untyped-def]
    """A step's traces as the workers reported them: every stage's forwards and backwards in
    the order the pipeline forces (a stage's forward of a micro-batch after the stage before
    finished it, a backward after the stage after finished its own), and the bytes each
    worker pushed, frame for frame."""
    for r in (0, 1):
        first = {(op, mb): (a, b) for op, mb, a, b in traces[(0, r)][0]}
        last = {(op, mb): (a, b) for op, mb, a, b in traces[(1, r)][0]}
        assert sorted(first) == sorted(last) == [(o, i) for o in "BF" for i in range(m)]
        for i in range(m):
            assert first[("F", i)][1] <= last[("F", i)][0]
            assert last[("B", i)][1] <= first[("B", i)][0]
    # 2 sequences of 128 positions x 128 hidden per micro-batch, either way, as wire frames
    frame = len(
        encode(Kind.ACTIVATION, step, 0, torch.zeros(8 // 2 // m, SPEC.seq, SPEC.hidden), 0)
    )
    for r in (0, 1):
        assert traces[(0, r)][1]["1/" + str(r)] == m * frame
        assert traces[(1, r)][1]["0/" + str(r)] == m * frame
    # The replicas of each stage all-reduce their gradients in a ring of two: each puts
    # 2 (n - 1) / n = 1 times its stage's fp32 gradient on its link to the other, exactly (the
    # leader's star sent wire frames, a header more, and only the leader sent back).
    for s, (first, last) in enumerate(RANGES[2]):
        n = sum(p.numel() for p in stage_module(SPEC, 0, first, last).parameters())
        for r in (0, 1):
            assert traces[(s, r)][1][f"{s}/{1 - r}"] == 4 * n


def _train_transformers(directory, batches, m: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Single-process training of the checkpoint by ``transformers`` itself, micro-batches and
    AdamW as the pipeline does it: an independent reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens, targets in batches:
        total = 0.0
        for x, y in zip(tokens.chunk(m), targets.chunk(m), strict=True):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / m
            loss.backward()
            total += float(loss.detach()) * m
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / m)
    return losses


@pytest.mark.parametrize("family", ["MixtralForCausalLM"])
def test_a_hugging_face_checkpoint_trains_as_in_one_process(tmp_path, family: str) -> None:  # type: ignore[no-untyped-def]
    """pp=2 from a checkpoint of grouped-query attention and experts (Mixtral: the Llama block
    with a mixture of experts) and tied embeddings, the embedding in stage 0 and the head in
    stage 1, for 10 steps: the losses of single-process training from the same checkpoint, where
    the two are one tensor."""
    import transformers

    config = (transformers.MixtralConfig if "Mixtral" in family else transformers.LlamaConfig)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    getattr(transformers, family)(config).save_pretrained(tmp_path / "ckpt")
    spec = resolve_model(f"hf:{tmp_path / 'ckpt'}", {"seq": 32})
    train, _ = stdlib_text(max_bytes=100_000)
    corpus = Corpus(train, 32, seed=2)
    steps = [corpus.batch(s, 8) for s in range(10)]
    want = _train_transformers(tmp_path / "ckpt", steps, MICRO)
    layout = StageLayout(spec, [("embedding", "block_0"), ("block_1", "head")])  # type: ignore[arg-type]
    with Deployment(layout, home=tmp_path) as dep:
        got = [dep.train_step(s, x, y, MICRO, "1f1b")["loss"] for s, (x, y) in enumerate(steps)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert got[-1] < got[0]


def test_a_step_sends_its_batch_in_the_calls_of_its_stages_and_no_push(
    batches, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The control plane's calls of a training step: the first stage's step with the tokens,
    the last's with the targets, the middle's alone, then the commits (the first step only:
    the later ones are applied by each stage at the end of its part); no frame pushed."""
    sent: list[str] = []
    raw_pooled = Client.raw_pooled

    def counted(self: Client, method: str, data: bytes, timeout_s: float | None = None):  # type: ignore[no-untyped-def]
        sent.append(method)
        return raw_pooled(self, method, data, timeout_s)

    with Deployment(StageLayout(SPEC, RANGES[3])) as dep:
        monkeypatch.setattr(Client, "raw_pooled", counted)
        dep.train_step(0, *batches[0], MICRO)
        assert sorted(sent) == ["Commit"] * 3 + ["RunStep"] + ["RunWith"] * 2
        sent.clear()
        out = dep.train_step(1, *batches[1], MICRO)
        assert sorted(sent) == ["RunStep"] + ["RunWith"] * 2
        assert all(c > 0 for c in out["compute_s"].values())
        sent.clear()
        dep.eval_step(2, *batches[2], MICRO)
        assert sorted(sent) == ["RunStep"] + ["RunWith"] * 2


def test_malformed_messages_get_an_error_and_the_worker_keeps_serving(batches) -> None:  # type: ignore[no-untyped-def]
    with Deployment(StageLayout(SPEC, RANGES[2])) as dep:
        addr = dep.handles[0].address
        stranger = Client(addr, STAGE_SERVICE)  # no service credential: refused
        with pytest.raises(grpc.RpcError) as info:
            stranger.call("Health")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = Client(addr, STAGE_SERVICE, token="not-the-token")
        with pytest.raises(grpc.RpcError) as info:
            wrong.raw("Push", b"")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = Client(addr, STAGE_SERVICE, token=dep.token)
        good = encode(Kind.TOKENS, 99, 0, torch.zeros(1, SPEC.seq, dtype=torch.int64))
        for bad in (b"", b"garbage", good[:-3], b"XXXX" + good[4:]):
            with pytest.raises(grpc.RpcError) as info:
                client.raw("Push", bad)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            client.raw("RunStep", b"{not json")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError):
            client.call("RunStep", {"step": 1, "microbatches": 0})
        # Well-formed frames with the wrong content for this stage are refused too.
        wrong = {
            "wrong dtype": encode(Kind.TOKENS, 99, 0, torch.zeros(1, SPEC.seq)),
            "wrong shape": encode(Kind.TOKENS, 99, 0, torch.zeros(2, 3, 4, dtype=torch.int64)),
            "too long": encode(Kind.TOKENS, 99, 0, torch.zeros(1, SPEC.seq + 1, dtype=torch.int64)),
            "token out of range": encode(
                Kind.TOKENS, 99, 0, torch.full((1, SPEC.seq), SPEC.vocab, dtype=torch.int64)
            ),
            "not for the first stage": encode(
                Kind.ACTIVATION, 99, 0, torch.zeros(1, 4, SPEC.hidden)
            ),
            "not for the first stage (targets)": encode(
                Kind.TARGETS, 99, 0, torch.zeros(1, SPEC.seq, dtype=torch.int64)
            ),
            "gradient of the wrong size": encode(Kind.GRAD_PART, 99, 1, torch.zeros(7)),
            "a stale epoch": encode(
                Kind.TOKENS, 99, 0, torch.zeros(1, SPEC.seq, dtype=torch.int64), epoch=7
            ),
        }
        unknown_kind = bytearray(good)
        unknown_kind[5] = 42
        for why, frame in [*wrong.items(), ("unknown kind", bytes(unknown_kind))]:
            with pytest.raises(grpc.RpcError) as info:
                client.raw("Push", frame)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
        from dmsc.runtime.transport.batched import pack
        from dmsc.runtime.transport.messages import RunStep

        step = RunStep(step=99, microbatches=1)
        one = encode(Kind.TOKENS, 99, 1, torch.zeros(1, 4).long())
        for why, data in (
            ("garbage", b"garbage"),
            ("not a whole batch", pack(step, [one])),
            ("not for the first stage", pack(step, [wrong["not for the first stage (targets)"]])),
            ("a token out of range", pack(step, [wrong["token out of range"]])),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                client.raw("RunWith", data)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
        for bad_req in ({"step": 1, "microbatches": 1, "late_policy": "ignore"}, {"epoch": "x"}):
            with pytest.raises(grpc.RpcError) as info:
                client.call("RunStep", bad_req)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Control calls with bad arguments: refused, nothing changes.
        for method, body in (
            ("Assume", {"config": {}}),  # only a spare takes a stage over
            ("Abort", {"epoch": -1}),  # an older epoch: fenced
            ("Abort", {}),
            ("Commit", {"step": 12345}),  # nothing to commit
        ):
            with pytest.raises(grpc.RpcError) as info:
                client.call(method, body)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        # and the worker still trains: a step runs with the good frames
        assert client.call("Health")["status"] == "ok"
        assert dep.train_step(0, *batches[0], MICRO)["loss"] > 0
        x, y = batches[0]
        assert dep.train_step(0, x, y, MICRO)["loss"] > 0  # still trains
        client.close()


def test_sampling_and_checkpoint(tmp_path, batches, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Temperature 0 gives the single-process model's most likely bytes; a seed repeats a
    draw, top-k 1 is greedy (issue 12, item 4); then a checkpoint."""
    from dmsc.runtime.compute.models.chain import build_stage, layer_names
    from dmsc.runtime.transport.messages import Sampling

    names = layer_names(SPEC)
    model = build_stage(SPEC, 0, names[0], names[-1])
    want = bytearray(b"def ")
    with torch.no_grad():
        for _ in range(5):
            want.append(int(torch.argmax(model(torch.tensor([list(want)]))[0, -1])))
    with Deployment(StageLayout(SPEC, RANGES[2]), home=tmp_path) as dep:
        seen: list[int] = []
        calls: list[tuple[tuple[int, int], str]] = []  # the orchestrator's, to any worker
        send = dep.tp.send

        def counted(key, leader, method, *rest):  # type: ignore[no-untyped-def]
            calls.extend([(key, method)] if method in ("RunStep", "Draw") else [])
            return send(key, leader, method, *rest)

        monkeypatch.setattr(dep.tp, "send", counted)
        one = dep.generate(b"def ", 5, sampling=Sampling(temperature=0), runs=False)
        assert bytes(one) == bytes(want[4:])
        assert calls == [((0, 0), "RunStep")] * 5  # stage 0 calls stage 1 itself (compute.relay)
        calls.clear()
        # in runs (compute.drawing): the prompt's token from a RunStep, the 4 others drawn at
        # stage 0 in one Draw (a run as long as a minute: however slow the machine), the same
        from dmsc.runtime.control.launch import decoding

        monkeypatch.setattr(decoding, "RUN_S", 60.0)
        greedy = dep.generate(b"def ", 5, sampling=Sampling(temperature=0), on_token=seen.append)
        assert greedy == one and bytes(seen) == bytes(want[4:])
        assert calls == [((0, 0), "RunStep"), ((0, 0), "Draw")], calls
        monkeypatch.undo()
        # the KV-cache session gives what recomputing the context gives, also where the
        # context slides past the model's sequence length
        assert dep.generate(b"def ", 5, sampling=Sampling(temperature=0), use_cache=False) == greedy
        long = bytes(range(40, 40 + SPEC.seq - 3))
        cold = Sampling(temperature=0)
        assert dep.generate(long, 6, sampling=cold) == dep.generate(
            long, 6, sampling=cold, use_cache=False
        )
        # every session ended with its request (EndSession is sent, not waited for)
        import time

        ends = time.monotonic() + 10
        while any(c.call("Health")["sessions"] for c in dep.clients.values()):
            assert time.monotonic() < ends, "sessions left open"
            time.sleep(0.05)
        assert dep.generate(b"def ", 5, sampling=Sampling(temperature=3, top_k=1)) == greedy
        # requests in flight through the stages at once (the replica's fair lock is as wide as
        # its pipeline holds tokens: one per stage and one drawn): each keeps its own keys and
        # values. Each request's first turn waits at a barrier for the other's: they overlap.
        import threading

        from dmsc.runtime.control.serving.turns import FairLock

        assert dep.layout.tokens_in_flight == 3
        lock, met = FairLock(dep.layout.tokens_in_flight), threading.Barrier(2, timeout=30)
        together: list[list[int]] = [[], []]

        def request(i: int) -> None:
            first = [True]

            @contextlib.contextmanager
            def turn(until: float | None) -> Iterator[None]:
                with lock.turn(str(i), until):
                    if first.pop() if first else False:
                        met.wait()
                    yield

            prompt = b"def " if i == 0 else b"class "
            together[i] = dep.generate(prompt, 5, sampling=Sampling(temperature=0), turn=turn,
                                       step_base=10_000_000 * (i + 1))  # fmt: skip

        threads = [threading.Thread(target=request, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert together[0] == greedy
        assert together[1] == dep.generate(b"class ", 5, sampling=Sampling(temperature=0))
        hot = [
            dep.generate(b"def ", 8, sampling=Sampling(temperature=2, seed=s)) for s in (5, 5, 6)
        ]
        assert hot[0] == hot[1] != hot[2]
        x, y = batches[0]
        dep.train_step(0, x, y, MICRO)
        text = dep.generate(b"def ", 5)
        assert len(text) == 5
        import httpx

        metrics = dep.clients[(1, 0)].call("Health")["metrics"]
        body = httpx.get(f"http://{metrics}/metrics").text
        assert "dmsc_worker_step_seconds_count" in body and "dmsc_worker_bytes_sent_total" in body
        client = dep.clients[(0, 0)]
        saved = client.call("Save", {"path": str(tmp_path / "s0.safetensors")})
        saved.pop("tensors")
        assert client.call("Load", saved)["steps"] == 1
        with pytest.raises(grpc.RpcError, match="hash"):
            client.call("Load", {"path": saved["path"], "sha256": "0" * 64})
        # A worker writes only below its deployment's directory (issue 11: Save wrote anywhere).
        escape = tmp_path.parent / f"{tmp_path.name}-escape.safetensors"
        for outside in (escape, tmp_path / ".." / escape.name):
            with pytest.raises(grpc.RpcError, match="outside the deployment directory"):
                client.call("Save", {"path": str(outside)})
        assert not escape.exists()


def test_lr_schedule_equals_single_process_with_torch_schedulers(batches) -> None:  # type: ignore[no-untyped-def]
    """Warm-up then cosine decay, the rate sent with each Commit, against one process whose
    AdamW is driven by PyTorch's own schedulers (issue 12, item 4)."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    from dmsc.runtime.compute.models.chain import build_stage, layer_names, loss_fn
    from dmsc.runtime.control.training.lr_schedule import lr_at
    from dmsc.runtime.transport.messages import TrainSettings

    steps, warm = 5, 2
    settings = TrainSettings(lr=4e-3, lr_schedule="cosine", warmup_steps=warm, min_lr_ratio=0.1)
    with Deployment(StageLayout(SPEC, RANGES[2])) as dep:
        got = [
            dep.train_step(s, x, y, MICRO, lr=lr_at(s, steps, settings))["loss"]
            for s, (x, y) in enumerate(batches[:steps])
        ]
    names = layer_names(SPEC)
    model = build_stage(SPEC, 0, names[0], names[-1])
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3)
    sched = SequentialLR(
        opt,
        [
            LinearLR(opt, start_factor=1 / warm, total_iters=warm - 1),
            CosineAnnealingLR(opt, T_max=steps - warm, eta_min=4e-4),
        ],
        milestones=[warm],
    )
    want = []
    for x, y in batches[:steps]:
        total = 0.0
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True):
            loss = loss_fn(model(xm), ym) / MICRO
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        want.append(total)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    # the workers' own constant rate gives other losses: the schedule's rates reached them
    flat = train_reference(SPEC, 0, 4e-3, batches[:steps], MICRO)
    assert abs(flat[-1] - got[-1]) > 1e-4
