"""The vocabulary-parallel ends of a tensor-parallel stage (:mod:`dmsc.runtime.compute.\
vocab_parallel`) against one process, for GPT and Llama with tied embeddings and a vocabulary
(600) padded to 768 (a multiple of 128 x 2, as the cost model prices it): 10 steps train to the
unsplit model's losses, no rank builds a tensor as wide as the vocabulary in a training step,
the tied pair stays one parameter, the state dict gathers to the unsplit one (padding dropped)
and shards back, and greedy decoding (the logits gathered) gives the unsplit model's tokens.
The untied presets at tp = 2 are covered by test_tensor_parallel.py, whose stages are
vocabulary-parallel too."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from tp_helpers import SEED, batches, greedy, small_spec, train, two_ranks

from dmsc.runtime.compute.models.chain import StageModule, build_stage
from dmsc.runtime.compute.tensor_parallel import (
    gather_state_dict,
    parallelize_stage,
    shard_state_dict,
)
from dmsc.runtime.compute.vocab_parallel import VocabParallelHead, stage_loss
from dmsc.spec import TransformerSpec

pytestmark = pytest.mark.integration  # one pair of rank processes: conftest.ONE_PROCESS

FAMILIES = ("gpt-mini", "llama-mini")
VOCAB = 600  # padded to 768: 384 rows a rank, 168 of rank 1's padding


def _spec(name: str) -> TransformerSpec:
    return small_spec(name).model_copy(update={"vocab": VOCAB, "tied_embeddings": True})


class _Widths(TorchDispatchMode):
    """The last dimension of every tensor an operation makes."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim():
                self.widths.add(t.shape[-1])
        return out


def _training_widths(module: StageModule, spec: TransformerSpec) -> tuple[set[int], list[int]]:
    """The widths of one training forward and backward's tensors (GPT only: every operation
    seen from Python is slow), and the head's output shape."""
    shapes: list[int] = []
    head = module.layers[-1]
    hook = head.register_forward_hook(lambda _m, _a, out: shapes.extend(out.shape))
    tokens = batches(spec)[0]
    seen = _Widths()
    with seen if spec.family == "gpt" else contextlib.nullcontext():
        stage_loss(module, module(tokens[:, :-1]), tokens[:, 1:]).backward()
    hook.remove()
    module.zero_grad(set_to_none=True)
    return seen.widths, shapes


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for name in FAMILIES:
            spec = _spec(name)
            module = parallelize_stage(spec, build_stage(spec, SEED, "embedding", "head"))
            head = module.layers[-1].get_submodule("out")
            assert isinstance(head, VocabParallelHead)
            tied = head.weight is module.layers[0].get_parameter("tok.weight")
            widths, head_shape = _training_widths(module, spec)
            record: dict[str, Any] = {"tied": tied, "widths": widths, "head": head_shape}
            record["losses"] = train(spec, module)
            record["local"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
            record["full"] = gather_state_dict(spec, module)
            record["greedy"] = greedy(spec, module)
            torch.save(record, f"{out}/{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def vp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return two_ranks(_rank, tmp_path_factory.mktemp("vp2"), FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_vocab_parallel_trains_tied_and_padded_as_one_process(
    vp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    spec = _spec(name)
    torch.set_num_threads(1)
    whole = build_stage(spec, SEED, "embedding", "head")
    reference = train(spec, whole)
    for got in vp2[name]:
        assert got["losses"] == pytest.approx(reference, abs=1e-4)
        assert got["tied"]  # one shard serves the embedding and the head
        # each rank's share of the logits, 384 of the 768 padded columns; nothing made in the
        # step is as wide as the vocabulary (the whole logits, their softmax or gradient)
        tokens = batches(spec)[0]
        assert got["head"] == [tokens.shape[0], tokens.shape[1] - 1, 384]
        assert not got["widths"] & {VOCAB, 768}, got["widths"]
    if name == "gpt-mini":
        assert 384 in vp2[name][0]["widths"]  # the check saw the head's share
    assert reference[-2] < reference[0] - 0.5  # learns


@pytest.mark.parametrize("name", FAMILIES)
def test_vocab_parallel_state_dict_gathers_and_decodes_as_one_process(
    vp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    spec = _spec(name)
    full = vp2[name][0]["full"]
    key = "layers.0.tok.weight"
    assert full[key].shape == (VOCAB, spec.hidden)  # the padding row dropped
    # the padding row, on the last rank, is never looked up nor the answer: it stays zero
    assert torch.equal(vp2[name][1]["local"][key][-1], torch.zeros(spec.hidden))
    one = build_stage(spec, 0, "embedding", "head")
    one.load_state_dict(full)
    assert greedy(spec, one) == vp2[name][0]["greedy"] == vp2[name][1]["greedy"]
    for rank, got in enumerate(vp2[name]):
        shards = shard_state_dict(spec, one.state_dict(), rank, 2)
        assert shards[key].shape == (384, spec.hidden)
        for k, tensor in got["local"].items():
            assert torch.equal(shards[k], tensor), k
