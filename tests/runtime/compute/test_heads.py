from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dmsc.data.corpus import stdlib_text
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.compute.models.heads import (
    build_heads,
    held_out,
    shard_text,
    train_heads,
)
from dmsc.runtime.control.serving.combiners import score, vote, weighted
from dmsc.spec import TransformerSpec, resolve_model

TINY = resolve_model("gpt-mini", {"layers": 2, "hidden": 32, "heads": 2, "seq": 32})
assert isinstance(TINY, TransformerSpec)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # tensors this small are all overhead: two threads on a shared 2-core machine ran the
    # training test 4x slower than one
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_backbone_and_heads_are_slices_of_the_chain() -> None:
    model = build_heads(TINY, heads=3, backbone_blocks=1, seed=4)
    assert model.backbone.names == ["embedding", "block_0"]
    assert all(head.names == ["block_1", "head"] for head in model.heads)
    # the backbone and head 0 are the model built from their seeds, sliced
    x = torch.randint(0, 256, (2, 16))
    whole = build_stage(TINY, 4, "embedding", "block_0")
    torch.testing.assert_close(model.backbone(x), whole(x))
    # the heads start apart and share no parameters
    ids = [{id(p) for p in head.parameters()} for head in model.heads]
    assert not ids[0] & ids[1] and not ids[1] & ids[2]
    logits = model(x)
    assert len(logits) == 3 and logits[0].shape == (2, 16, 256)
    assert not torch.equal(logits[0], logits[1])
    probs = model.head_probs(x)
    assert probs[0].shape == (32, 256)
    torch.testing.assert_close(probs[2].sum(-1), torch.ones(32))
    # the extremes: a backbone of the embedding alone, heads of the output layer alone
    assert build_heads(TINY, 1, 0).backbone.names == ["embedding"]
    assert build_heads(TINY, 1, 2).heads[0].names == ["head"]


def test_refusals() -> None:
    with pytest.raises(ValueError, match="backbone_blocks: 3"):
        build_heads(TINY, 2, 3)
    with pytest.raises(ValueError, match="heads: 0"):
        build_heads(TINY, 0, 1)
    with pytest.raises(ValueError, match="2 shards for 3 heads"):
        train_heads(build_heads(TINY, 3, 1), [b"x" * 100] * 2, steps=1, batch=1, seq=8)
    with pytest.raises(ValueError, match="3 bytes cannot make 4 shards"):
        shard_text(b"abc", 4)
    with pytest.raises(ValueError, match="fewer than 10 windows"):
        held_out(b"a" * 100, 16, 10)


def test_shards_and_held_out_windows() -> None:
    data = bytes(range(256)) * 4
    parts = shard_text(data, 3)
    assert b"".join(parts) == data and [len(p) for p in parts] == [341, 341, 342]
    x, y = held_out(data, 8, 5)
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_heads_train_on_skewed_shards_and_combining_them_helps() -> None:
    train, valid = stdlib_text(max_bytes=600_000)
    model = build_heads(TINY, heads=3, backbone_blocks=1, seed=0)
    losses = train_heads(model, shard_text(train, 3), steps=30, batch=8, seq=32, lr=1e-2)
    assert losses[-1] < losses[0] - 1.0
    x, y = held_out(valid, 32, 48)
    labels = y.reshape(-1)
    probs = model.head_probs(x)
    accuracies = [score(p, labels).accuracy for p in probs]
    assert min(accuracies) > 5 / 256  # well above chance
    mean_accuracy = sum(accuracies) / len(accuracies)
    assert score(weighted(probs, accuracies), labels).accuracy >= mean_accuracy
    assert score(vote(probs), labels).accuracy >= mean_accuracy - 0.01
    # a late head: the two others still answer
    late = [probs[0], None, probs[2]]
    assert score(weighted(late), labels).accuracy > 5 / 256
