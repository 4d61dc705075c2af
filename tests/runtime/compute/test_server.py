"""The ``dmsc.Stage`` methods over real gRPC on 127.0.0.1: typed requests, refusals, fencing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from runtime_helpers import first_stage

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.worker import STAGE_SERVICE, StageWorker
from dmsc.runtime.transport.rpc import Client, serve
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")


@pytest.fixture
def client() -> Iterator[Client]:
    """A client of stage 0 (of two), served in this process at epoch 2."""
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    cfg = first_stage(f"127.0.0.1:{reg_port}", epoch=2)
    worker = StageWorker(cfg)
    server, port = serve(STAGE_SERVICE, worker.methods())
    c = Client(f"127.0.0.1:{port}", STAGE_SERVICE)
    try:
        yield c
    finally:
        c.close()
        server.stop(0)
        reg_server.stop(0)


def _refused(client: Client, method: str, body: dict[str, Any]) -> str:
    """The details of the INVALID_ARGUMENT that ``method`` answers ``body`` with."""
    with pytest.raises(grpc.RpcError) as info:
        client.call(method, body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details: str = info.value.details()
    return details


def test_run_step_without_microbatches_is_refused_naming_the_field(client: Client) -> None:
    details = _refused(client, "RunStep", {"step": 1, "microbatches": 0})
    assert "RunStep" in details and "microbatches" in details


def test_an_unknown_field_is_refused_naming_it(client: Client) -> None:
    details = _refused(client, "RunStep", {"step": 1, "microbatches": 1, "micro_batches": 2})
    assert "micro_batches" in details


def test_abort_without_an_epoch_is_refused_naming_the_field(client: Client) -> None:
    details = _refused(client, "Abort", {})
    assert "Abort" in details and "epoch" in details


def test_checks_that_need_the_worker_state_stay(client: Client) -> None:
    assert "fenced" in _refused(client, "RunStep", {"step": 1, "microbatches": 1, "epoch": 1})
    assert "fenced" in _refused(client, "Abort", {"epoch": 1})
    assert "nothing to commit" in _refused(client, "Commit", {"step": 3, "epoch": 2})
    assert "only a spare" in _refused(client, "Assume", {"config": {}, "epoch": 2})
    # the orchestrator adds the epoch to every call: accepted
    assert client.call("Health", {"epoch": 2})["epoch"] == 2
    assert client.call("Abort", {"epoch": 3}) == {"epoch": 3}
    assert client.call("Health")["epoch"] == 3


def test_a_spare_refuses_a_bad_stage_config() -> None:
    cfg = first_stage("127.0.0.1:1", sid="spare-0", spare=True)
    server, port = serve(STAGE_SERVICE, StageWorker(cfg).methods())
    client = Client(f"127.0.0.1:{port}", STAGE_SERVICE)
    try:
        details = _refused(client, "Assume", {"config": {"sid": "s1", "stage": 1}})
        assert "bad worker config" in details
    finally:
        client.close()
        server.stop(0)


def test_a_missing_or_corrupt_checkpoint_is_refused_as_data_loss(
    client: Client, tmp_path: Path
) -> None:
    """DATA_LOSS (not a bad request): the control plane then tries an older checkpoint."""
    saved = client.call("Save", {"path": str(tmp_path / "s0.safetensors")})
    assert "transformer.wte.weight" in saved.pop("tensors")  # what a checkpoint index lists
    whole = Path(saved["path"]).read_bytes()
    Path(saved["path"]).write_bytes(whole[: len(whole) // 2])  # truncated: fails its hash
    tries = [
        (saved, "fails its hash"),
        ({"path": saved["path"]}, "cannot be read"),  # no hash given: it must still read
        ({"path": str(tmp_path / "gone.safetensors")}, "no checkpoint"),
    ]
    for body, why in tries:
        with pytest.raises(grpc.RpcError) as info:
            client.call("Load", body)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert why in info.value.details() and str(tmp_path) in info.value.details()
    Path(saved["path"]).write_bytes(whole)
    assert client.call("Load", saved)["steps"] == 0


def test_inference_sessions_have_a_limit_an_idle_timeout_and_a_position_check() -> None:
    from dmsc.runtime.transport import messages as msg
    from dmsc.runtime.transport.rpc import BadRequest, NoRoom

    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:
        worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", max_sessions=1))
        cfg = worker.cfg

        def session(name: str, start: int) -> StageCache:  # as an inference RunStep takes it
            return worker.sessions.take(
                name, start, cfg.max_sessions, cfg.session_idle_s, cfg.stage, worker.spec.seq
            )

        cache = session("a", 0)
        with pytest.raises(NoRoom, match="1 inference sessions open"):
            session("b", 0)
        cache.length = 7  # as a prefill of seven tokens leaves it
        assert session("a", 7) is cache
        with pytest.raises(BadRequest, match="holds 7 positions, the step starts at 9"):
            session("a", 9)
        with pytest.raises(BadRequest, match="session c: not open here"):
            session("c", 3)
        # a session never grows past the model's window (its caches, and the rotary table
        # sized by them, stay bounded whatever a caller asks)
        seq = worker.spec.seq
        cache.length = seq
        with pytest.raises(BadRequest, match=f"position {seq} is past the model's last"):
            session("a", seq)
        assert worker.end_session(msg.EndSession(session="a")) == {"ended": True}
        session("b", 0)  # room again
        worker.cfg.session_idle_s = 0.0  # every session is idle: the next one takes its room
        session("c", 0)
        assert list(worker.sessions) == ["c"]
    finally:
        reg_server.stop(0)


def test_no_room_is_answered_resource_exhausted() -> None:
    from dmsc.runtime.transport.rpc import NoRoom, json_handler

    def full(_: dict[str, Any]) -> dict[str, Any]:
        raise NoRoom("stage 1: 64 inference sessions open")

    server, port = serve("dmsc.Test", {"Full": json_handler(full)})
    c = Client(f"127.0.0.1:{port}", "dmsc.Test")
    try:
        with pytest.raises(grpc.RpcError) as info:
            c.call("Full", {})
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "64 inference sessions open" in info.value.details()
    finally:
        c.close()
        server.stop(0)


def test_tokens_carried_in_run_step_give_the_logits_of_tokens_pushed_first() -> None:
    """The decoding fast path (the tokens in the inference ``RunStep``, no ``Push`` before it)
    against the frame path, prefill and one cached token each, and its refusals."""
    from pydantic import ValidationError

    from dmsc.runtime.transport import messages as msg
    from dmsc.runtime.transport.rpc import BadRequest
    from dmsc.runtime.transport.wire import Kind, encode

    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:  # the whole model in one stage: its reply carries the logits
        worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", stages=1, last="head"))
        prompt, nxt = [[5, 17, 99, 3]], [[42]]

        def pushed(step: int, ids: list[list[int]], session: str, start: int) -> str:
            worker.push(encode(Kind.TOKENS, step, 0, torch.tensor(ids), worker.epoch))
            m = msg.RunStep(step=step, microbatches=1, train=False, session=session, start=start)
            return str(worker.run_step(m)["logits"])

        def carried(step: int, ids: list[list[int]], session: str, start: int) -> str:
            m = msg.RunStep(
                step=step, microbatches=1, train=False, session=session, start=start, tokens=ids
            )
            return str(worker.run_step(m)["logits"])

        assert carried(1, prompt, "b", 0) == pushed(2, prompt, "a", 0)
        assert carried(3, nxt, "b", 4) == pushed(4, nxt, "a", 4)
        with pytest.raises(BadRequest, match=r"tokens of torch.int64 \(1, 1\) refused"):
            carried(5, [[SPEC.vocab]], "c", 0)  # past the vocabulary, as a TOKENS frame is
        with pytest.raises(BadRequest, match="RunStep tokens"):
            carried(6, [[1, 2], [3]], "d", 0)  # ragged rows
        with pytest.raises(ValidationError, match="inference step of one micro-batch only"):
            msg.RunStep(step=7, microbatches=1, train=True, tokens=prompt)
    finally:
        reg_server.stop(0)


def test_an_inference_step_with_top_answers_only_the_largest_logits() -> None:
    """``top`` (what greedy or top-k decoding asks for): the last stage answers each row's
    ``top`` largest logits and their ids, the same numbers as the whole row holds there."""
    from pydantic import ValidationError

    from dmsc.runtime.compute.sampling import reply_logits
    from dmsc.runtime.transport import messages as msg

    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:
        worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", stages=1, last="head"))
        ids = [[5, 17, 99, 3]]

        def answer(step: int, top: int | None) -> dict[str, Any]:
            m = msg.RunStep(step=step, microbatches=1, train=False, tokens=ids, top=top)
            return worker.run_step(m)

        whole = reply_logits(answer(1, None), SPEC.vocab)[0]
        for step, top in ((2, 1), (3, 5)):
            reply = answer(step, top)
            assert reply["logits_shape"] == [1, top]
            got = reply_logits(reply, SPEC.vocab)[0]
            kept = torch.isfinite(got)
            assert set(kept.nonzero().flatten().tolist()) == set(whole.topk(top).indices.tolist())
            assert torch.equal(got[kept], whole[kept])
        assert int(reply_logits(answer(4, 1), SPEC.vocab)[0].argmax()) == int(whole.argmax())
        with pytest.raises(ValidationError, match="top: the largest logits of an inference"):
            msg.RunStep(step=5, microbatches=1, train=True, top=1)
    finally:
        reg_server.stop(0)


def test_a_step_forms_its_expert_groups_in_its_own_epoch_after_an_abort() -> None:
    """An ``Abort`` that moves the worker on while a step of the old epoch still runs: the
    step's next mixture forms its groups under the step's epoch, not the new one's, where it
    would take the place the recovered replicas meet at (seen in the full suite: a survivor
    connected to the address a failed old-epoch step had left, and was refused)."""
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:
        moe = resolve_model("moe-mini").model_dump()
        cfg = first_stage(
            f"127.0.0.1:{reg_port}", model=moe, ep=2, replicas=2, tp_store="127.0.0.1:1"
        )
        worker = StageWorker(cfg)
        assert worker.experts is not None
        before = worker.epoch
        with worker.peers.at_epoch(before):  # the step of the old epoch, running
            worker.inbox.advance(before + 1)  # the recovery's Abort
            assert worker.experts.epoch() == before
        assert worker.experts.epoch() == before + 1  # between steps: the worker's own
    finally:
        reg_server.stop(0)


@pytest.mark.parametrize("streams", [False, True])
def test_a_chained_step_runs_through_every_stage_in_one_call_and_keeps_their_refusals(
    streams: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three stages: stage 0 hands its activations to stage 1 itself (``Relay``), stage 1 to
    stage 2, and stage 0 answers with stage 2's logits: the most likely token of the whole
    model; stage 2's refusals come back with their status, naming it; a stage 2 that is gone
    fails the call naming it. With pipeline streams (``streams``: the stages met in a store)
    the stages' ``Relay`` calls go over them, never over gRPC."""
    import torch.distributed as dist

    from dmsc.runtime.compute.models.chain import build_stage, layer_names
    from dmsc.runtime.compute.relay import pack
    from dmsc.runtime.compute.sampling import reply_logits
    from dmsc.runtime.transport.messages import RunStep
    from dmsc.runtime.transport.wire import Kind, encode

    grpc_relays: list[str] = []  # the Relay calls made over gRPC, by address
    stub = Client._stub

    def counted(self: Client, method: str, *rest: Any) -> Any:
        grpc_relays.extend([self.address] if method == "Relay" else [])
        return stub(self, method, *rest)

    monkeypatch.setattr(Client, "_stub", counted)
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    registry = f"127.0.0.1:{reg_port}"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    met = {"tp_store": f"127.0.0.1:{store.port}", "pp_stream": True} if streams else {}
    servers, clients, workers = [], [], []
    cuts = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
    try:
        for s, (first, last) in enumerate(cuts):
            cfg = first_stage(registry, sid=f"s{s}", stage=s, stages=3, first=first, last=last,
                              max_sessions=1 if s == 2 else 64, **met)  # fmt: skip
            worker = StageWorker(cfg)
            workers.append(worker)
            assert (worker.peers.calls is not None) == streams
            server, port = serve(STAGE_SERVICE, worker.methods())
            worker.address = f"127.0.0.1:{port}"
            worker.register()
            servers.append(server)
            clients.append(Client(worker.address, STAGE_SERVICE))
        ids = [[100, 101, 102, 32]]
        step = {"microbatches": 1, "train": False, "tokens": ids, "top": 1, "relay": [0, 0]}
        reply = clients[0].call("RunStep", {**step, "step": 1, "session": "a", "budget_s": 30})
        names = layer_names(SPEC)
        with torch.no_grad():
            want = build_stage(SPEC, 0, names[0], names[-1])(torch.tensor(ids))[0, -1]
        assert reply["stage"] == 2
        assert int(reply_logits(reply, SPEC.vocab).argmax()) == int(want.argmax())
        assert [c.call("Health")["sessions"] for c in clients] == [1, 1, 1]  # each keeps its own
        assert len(grpc_relays) == (0 if streams else 2), grpc_relays
        with pytest.raises(grpc.RpcError) as info:  # stage 2 holds its one session: full
            clients[0].call("RunStep", {**step, "step": 2, "session": "b"})
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stage 2 replica 0" in info.value.details()
        assert "relay: 1 stages after stage 0" in _refused(
            clients[0], "RunStep", {**step, "step": 3, "relay": [0]}
        )
        x = encode(Kind.ACTIVATION, 4, 0, torch.zeros(1, 2, SPEC.hidden))
        relayed = pack(RunStep(step=4, microbatches=1, train=False, relay=[0]), x)
        with pytest.raises(grpc.RpcError, match="stage 0 does not take activations"):
            clients[0].raw("Relay", relayed)
        grpc_relays.clear()
        servers[2].stop(0)  # stage 2 gone (its listener too): the call fails naming it
        if streams:
            workers[2].peers.pipe.close()
        with pytest.raises(grpc.RpcError, match="stage 2 replica 0"):
            clients[0].call("RunStep", {**step, "step": 5, "budget_s": 5})
        assert len(grpc_relays) == (0 if streams else 2), grpc_relays
    finally:
        for c in clients:
            c.close()
        for server in servers:
            server.stop(0)
        reg_server.stop(0)


def test_a_decoding_step_lays_the_weights_out_for_decoding_and_a_training_step_puts_them_back() -> (
    None
):
    """:mod:`dmsc.runtime.compute.decode_layout` as a worker uses it: a step with a session
    switches to the decoding layout (the same logits as before, to float32 rounding), a step
    without one leaves the layout as it is, a training step restores the weights as built."""
    from dmsc.runtime.compute.decode_layout import is_column_major
    from dmsc.runtime.compute.sampling import reply_logits
    from dmsc.runtime.transport import messages as msg
    from dmsc.runtime.transport.wire import Kind, encode

    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:
        worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", stages=1, last="head"))
        # a deterministic timer: column-major faster for the weights wider than they are deep
        worker.layout.timer = lambda ws: (
            1.0 if is_column_major(ws[0]) == (ws[0].shape[0] > ws[0].shape[1]) else 2.0
        )
        weights = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
        ids = [[5, 17, 99, 3]]

        def logits(step: int, session: str | None) -> torch.Tensor:
            m = msg.RunStep(
                step=step, microbatches=1, train=False, session=session, start=0, tokens=ids
            )
            return reply_logits(worker.run_step(m), SPEC.vocab)

        def wide() -> list[torch.Tensor]:
            linear = [m.weight for m in worker.module.modules() if isinstance(m, torch.nn.Linear)]
            return [w for w in linear if w.shape[0] > w.shape[1]]

        row = logits(1, None)
        assert not worker.layout.on and all(p.is_contiguous() for p in wide())
        col = logits(2, "a")  # a session: decoding
        assert worker.layout.on and all(is_column_major(p) for p in wide())
        torch.testing.assert_close(col, row, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits(3, None), row, rtol=1e-5, atol=1e-5)
        assert worker.layout.on  # a step without a session leaves it
        for kind, t in ((Kind.TOKENS, torch.tensor(ids)), (Kind.TARGETS, torch.tensor(ids))):
            worker.push(encode(kind, 4, 0, t, worker.epoch))
        worker.run_step(msg.RunStep(step=4, microbatches=1, train=True))
        assert not worker.layout.on
        assert all(p.is_contiguous() for p in worker.module.parameters())
        for n, p in worker.module.named_parameters():  # as built, bit for bit (not committed)
            assert torch.equal(p.detach(), weights[n]), n
        logits(5, "b")  # inference between training steps: decoded as built, no copies
        assert not worker.layout.on
    finally:
        reg_server.stop(0)


def test_an_inference_step_runs_without_cudnn_attention_on_a_gpu_and_a_training_step_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker enters :func:`inference_attention` for its inference steps (with a session
    or without: each token is a new key length either way) and not for training steps (the
    same shape every step: cuDNN's graph is built once). The CPU worker is taken for a GPU's
    here: what the backend flags are while its ops run."""
    from dmsc.runtime.compute import server
    from dmsc.runtime.compute.models.attention import inference_attention
    from dmsc.runtime.transport import messages as msg
    from dmsc.runtime.transport.wire import Kind, encode

    monkeypatch.setattr(
        server, "inference_attention", lambda d: inference_attention(d.__class__("cuda"))
    )
    seen: list[tuple[bool, bool]] = []
    real = server.run_ops

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append((args[6], torch.backends.cuda.cudnn_sdp_enabled()))  # (train, cuDNN on)
        return real(*args, **kwargs)

    monkeypatch.setattr(server, "run_ops", recording)
    reg_server, reg_port = serve(REGISTRY_SERVICE, registry_methods(Registry(ttl_s=60)))
    try:
        worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", stages=1, last="head"))
        ids = [[5, 17, 99, 3]]
        for step, session in ((1, "a"), (2, None)):
            m = msg.RunStep(
                step=step, microbatches=1, train=False, session=session, start=0, tokens=ids
            )
            worker.run_step(m)
        for kind in (Kind.TOKENS, Kind.TARGETS):
            worker.push(encode(kind, 3, 0, torch.tensor(ids), worker.epoch))
        worker.run_step(msg.RunStep(step=3, microbatches=1, train=True))
        assert seen == [(False, False), (False, False), (True, True)]
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        reg_server.stop(0)
