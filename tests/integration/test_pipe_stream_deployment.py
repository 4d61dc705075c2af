"""A pipeline whose stages send over TCP streams (``StageLayout.pp_stream``, the default), as
worker processes on 127.0.0.1: the same losses as over gRPC (``pp_stream=False``) and as one
process, the bytes booked per link, and a killed stage found, replaced and reached again over
the new epoch's streams; a decoded token's ``Relay`` calls on the streams' listeners
(:mod:`dmsc.runtime.transport.stream_calls`) draw the tokens gRPC's draw, also under mutual TLS
and after the replacement, and the control plane's step calls go there too."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import reference_losses, text_batches

from dmsc.runtime.control.launch import recovery
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.messages import Sampling
from dmsc.runtime.transport.rpc import Client
from dmsc.runtime.transport.wire import Kind, encode
from dmsc.spec import resolve_model

pytestmark = pytest.mark.integration

SPEC = resolve_model("gpt-mini")
THREE = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
STEPS = 4
MICRO = 4
GREEDY = Sampling(temperature=0)


def _calls_published(dep: Deployment) -> bool:
    """Whether every stage published the listener it takes Relay calls at, by its address."""
    keys = [f"ppstream/calls/{dep.clients[(s, 0)].address}" for s in range(dep.stages)]
    return dep.tp.store is not None and bool(dep.tp.store.check(keys))


def test_streamed_sends_train_as_grpc_and_one_process_and_survive_a_killed_stage(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    batches = text_batches(SPEC, STEPS)
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    over: list[str] = []  # the step calls this process (the control plane) made over gRPC
    stub = Client._stub

    def counted(self, method, *rest):  # type: ignore[no-untyped-def]
        over.extend([method] if method in ("RunStep", "RunWith") else [])
        return stub(self, method, *rest)

    monkeypatch.setattr(Client, "_stub", counted)
    with Deployment(StageLayout(SPEC, THREE, pp_stream=False)) as dep:  # the gRPC path
        over_grpc = [dep.train_step(s, x, y, MICRO)["loss"] for s, (x, y) in enumerate(batches)]
        assert not _calls_published(dep)
        drawn_over_grpc = dep.generate(b"def ", 6, sampling=GREEDY)
    assert over.count("RunWith") == 2 * STEPS  # to the first stage and the last, each step
    over.clear()
    with Deployment(StageLayout(SPEC, THREE), home=tmp_path) as dep:
        cfgs = [dep.config(s, 0) for s in range(3)]
        assert all(c.pp_stream and not c.pp_group for c in cfgs) and dep.tp.address
        outs = [dep.train_step(s, x, y, MICRO) for s, (x, y) in enumerate(batches[:2])]
        # each activation and gradient (2 sequences x 128 x 128 float32 a micro-batch) as its
        # wire frame (as a Push of it is booked), on its link and in the step's comm
        frame = len(encode(Kind.ACTIVATION, 0, 0, torch.zeros(2, SPEC.seq, SPEC.hidden)))
        sent = outs[-1]["traces"]
        assert sent[(0, 0)][1] == {"1/0": MICRO * frame}
        assert sent[(1, 0)][1] == {"2/0": MICRO * frame, "0/0": MICRO * frame}
        assert outs[-1]["comm"][(1, 0)]["pp"]["links"] == sent[(1, 0)][1]
        ckpt = dep.checkpoint(2)
        dep.handle((1, 0)).process.kill()  # the middle stage: both neighbours wait on it
        with pytest.raises(WorkerFailure) as failure:
            dep.train_step(2, *batches[2], MICRO)
        assert (1, 0) in failure.value.failed
        rec = recovery.recover(dep, failure.value, [ckpt])
        assert rec.checkpoint_step == 2 and rec.epoch == 1
        losses = [o["loss"] for o in outs]
        losses += [dep.train_step(s, *batches[s], MICRO)["loss"] for s in (2, 3)]
        assert _calls_published(dep)  # the replacement's too, by its new address
        drawn = dep.generate(b"def ", 6, sampling=GREEDY)
        assert not over  # every step call on the workers' streams, the replacement's too
    assert drawn == drawn_over_grpc
    assert losses == over_grpc  # bitwise: the same tensors, another transport
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-5


def test_under_mutual_tls_the_streams_are_tls_and_train_as_grpc(tmp_path) -> None:  # type: ignore[no-untyped-def]
    batches = text_batches(SPEC, STEPS)[:2]
    tls.install_authority(tmp_path / "ca")  # as dmsc up: every worker holds a leaf
    try:
        with Deployment(StageLayout(SPEC, THREE, pp_stream=False)) as dep:
            over_grpc = [dep.train_step(s, x, y, MICRO)["loss"] for s, (x, y) in enumerate(batches)]
            drawn_over_grpc = dep.generate(b"def ", 6, sampling=GREEDY)
        with Deployment(StageLayout(SPEC, THREE), home=tmp_path) as dep:
            assert tls.issuer() is not None  # each worker starts with a leaf of its own
            outs = [dep.train_step(s, x, y, MICRO) for s, (x, y) in enumerate(batches)]
            # each stage published its stream's address (the frames went that way)
            assert dep.tp.store.check([f"ppstream/0/0/e0/{s}" for s in range(3)])
            assert _calls_published(dep)
            drawn = dep.generate(b"def ", 6, sampling=GREEDY)
    finally:
        tls.install(None)
    assert [o["loss"] for o in outs] == over_grpc
    assert drawn == drawn_over_grpc
