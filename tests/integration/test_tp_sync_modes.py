"""The sync modes at tp = 2, on real worker processes: each tensor-parallel rank agrees on its
shard with the same rank of the other replicas, which gives the losses the same mode gives at
tp = 1 (a tp = 2 replica computes the tp = 1 replica's gradients up to float error), and a
round's state (DiLoCo's outer momentum) crosses a change of tp in the gathered checkpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.models.chain import layer_names
from dmsc.runtime.control.launch.deployment import Checkpoint, Deployment, StageLayout
from dmsc.runtime.control.training.session import train
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import resolve_model

pytestmark = pytest.mark.integration

SPEC = resolve_model("gpt-mini")
NAMES = layer_names(SPEC)
WHOLE = [(NAMES[0], NAMES[-1])]
REPLICAS, STEPS, BATCH, MICRO, LR = 3, 3, 12, 2, 1e-3  # Krum needs n >= 2f + 3 = 3 at f = 0


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    text, _ = stdlib_text(max_bytes=400_000)
    return Corpus(text, SPEC.seq, seed=1)


@pytest.fixture(scope="module")
def deps() -> Iterator[dict[int, tuple[Deployment, Checkpoint]]]:
    """Three replicas of the whole model at tp = 1 and at tp = 2, with their first weights."""
    out: dict[int, tuple[Deployment, Checkpoint]] = {}
    try:
        for tp in (1, 2):
            dep = Deployment(StageLayout(SPEC, WHOLE, replicas=REPLICAS, tp=tp, lr=LR))
            dep.start()
            out[tp] = (dep, dep.checkpoint(0, dep.home / "start"))
        yield out
    finally:
        for dep, _ in out.values():
            dep.shutdown()


def _losses(
    deps: dict[int, tuple[Deployment, Checkpoint]], tp: int, corpus: Corpus, sync: SyncSettings
) -> list[float]:
    dep, start = deps[tp]
    dep.restore(start)
    return train(dep, corpus, corpus, STEPS, BATCH, MICRO, validate=False, sync=sync).losses


@pytest.mark.parametrize(
    "sync",
    [
        SyncSettings(
            mode="fedavg", inner_steps=2, aggregator="krum:0", privacy_clip=0.5, privacy_noise=0.01
        ),
        SyncSettings(mode="fedavg", inner_steps=2, secure=True, privacy_clip=0.5),
    ],
    ids=["fedavg-krum-central-dp", "fedavg-secure-clip"],
)
def test_a_sync_mode_at_tp2_gives_the_tp1_losses(deps, corpus, sync) -> None:  # type: ignore[no-untyped-def]
    """Krum's distances, the clipping norm and the noise are the whole replica's: a rank that
    used its shard's alone would pick, clip and noise otherwise than tp = 1 does. Secure
    aggregation runs per rank: each rank's keys and masks are its own with its peers'."""
    want = _losses(deps, 1, corpus, sync)
    got = _losses(deps, 2, corpus, sync)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
    assert got[-1] < got[0]


def test_diloco_at_tp2_keeps_its_outer_momentum_across_a_change_of_tp(deps, corpus) -> None:  # type: ignore[no-untyped-def]
    """DiLoCo in rounds of one step: a round at tp = 2 and a checkpoint of
    every replica (the round state gathered into the tp = 1 layout); from it two more rounds at
    tp = 1 and at tp = 2 (the state cut again) each give the losses of DiLoCo run without a stop
    at tp = 1. Without the outer momentum in the checkpoint the second outer step would
    differ, and with it the third step's loss."""
    sync = SyncSettings(mode="diloco", inner_steps=1, outer_lr=0.7, outer_momentum=0.9)
    want = _losses(deps, 1, corpus, sync)  # tp = 1 without a stop (against one process:
    # tests/integration/test_sync_modes.py)
    (dep2, start2), (dep1, _) = deps[2], deps[1]
    dep2.restore(start2)
    first = train(dep2, corpus, corpus, 1, BATCH, MICRO, validate=False, sync=sync).losses
    ckpt = dep2.checkpoint(1, dep2.home / "round", every=True)
    for dep in (dep1, dep2):
        dep.restore(ckpt)
        rest = train(dep, corpus, corpus, 2, BATCH, MICRO, validate=False, sync=sync, first_step=1)
        got = first + rest.losses
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, (got, want)
