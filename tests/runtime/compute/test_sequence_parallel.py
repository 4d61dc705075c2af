"""Sequence parallelism (:mod:`dmsc.runtime.compute.sequence_parallel`) against one process: GPT
and Llama split over two gloo ranks with their residual streams split along the sequence train
10 steps to the losses of the unsplit model (within 1e-4), with each rank's norms seeing half of
the tokens, the all-reduces replaced by as many all-gathers and reduce-scatters, and decoding
with the key/value cache (no graph: plain tensor parallelism) giving the unsplit model's
tokens; and the collectives a training step runs are the cost model's list for a sequence-split
plan (``netmodel/tp_calls.py``), call for call and byte for byte."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from tp_helpers import SEED, batches, greedy, small_spec, train, two_ranks

from dmsc.netmodel import build_layer_costs
from dmsc.netmodel.collectives import bytes_sent_per_rank
from dmsc.netmodel.tp_calls import sequence_edges, tp_allreduce_calls
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.compute.tensor_parallel import gather_state_dict, parallelize_stage
from dmsc.runtime.compute.vocab_parallel import stage_loss
from dmsc.spec import JobSpec

pytestmark = pytest.mark.integration  # one pair of rank processes: conftest.ONE_PROCESS

FAMILIES = ("gpt-mini", "llama-mini")


def _collectives(module: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """The collectives of one forward and backward (its gradients then dropped)."""
    names = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single")
    calls = dict.fromkeys(names, 0)
    real = {n: getattr(dist, n) for n in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counting(n))
    try:
        stage_loss(module, module(tokens[:, :-1]), tokens[:, 1:]).backward()
    finally:
        for n in names:
            setattr(dist, n, real[n])
    module.zero_grad(set_to_none=True)
    return calls


def _tokens(into: list[int], _module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
    into.append(args[0].shape[1])


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for name in FAMILIES:
            spec = small_spec(name)
            module = parallelize_stage(
                spec, build_stage(spec, SEED, "embedding", "head"), sequence=True
            )
            seen: list[int] = []  # the tokens each norm of the first block sees
            norm = next(m for m in module.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm))
            norm.register_forward_hook(partial(_tokens, seen))
            METER.take()
            calls = _collectives(module, batches(spec)[0])
            metered = METER.take()["tp"]
            losses = train(spec, module)
            record = {"losses": losses, "seen": seen[0], "calls": calls, "metered": metered}
            record |= {"full": gather_state_dict(spec, module), "greedy": greedy(spec, module)}
            torch.save(record, f"{out}/{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return two_ranks(_rank, tmp_path_factory.mktemp("sp2"), FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_sp2_trains_to_the_losses_of_one_process(
    sp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    spec = small_spec(name)
    torch.set_num_threads(1)
    whole = build_stage(spec, SEED, "embedding", "head")
    reference = train(spec, whole)
    tokens = batches(spec)[0].shape[1] - 1
    for got in sp2[name]:
        assert got["losses"] == pytest.approx(reference, abs=1e-4)
        assert got["seen"] == tokens // 2  # the norms run on this rank's half of the sequence
        # f and g of each sub-layer, forward and backward: an all-gather and a reduce-scatter
        # instead of two all-reduces (+ the gathers after the embedding and before the head);
        # the only all-reduces left sum the norms' and biases' gradients, plus the five of the
        # vocabulary-parallel ends (embedding, head, the loss's max, target and sum). On the
        # CPU a reduce-scatter is gloo's all-to-all and a sum: gloo's reduce_scatter_tensor
        # says it is done only once waited for, and the awake wait ran to its bound, 4 ms
        calls = got["calls"]
        assert calls["reduce_scatter_single"] == 0
        assert calls["all_to_all_single"] == 4 * spec.layers
        assert calls["all_gather_single"] == 4 * spec.layers + 2
        assert calls["all_reduce"] == (6 if name == "gpt-mini" else 2) * spec.layers + 5
    # the cost model's list for the same micro-batch on a sequence-split plan, its ends as the
    # runtime runs them (sequence_parallel_edges: gathered, the default: the gradient of the
    # sliced input and the output gathered whole): the same calls of each kind and the same
    # bytes (a ring's share: an all-gather's or a reduce-scatter's (n - 1) / n of the buffer, an
    # all-reduce's twice that). Those two gathers used to be left out of the list and added here
    micro = batches(spec)[0].shape[0]
    job = JobSpec(global_batch=micro, micro_batch=micro, tp=2, sequence_parallel=True)
    layers = build_layer_costs(spec.model_copy(update={"seq": tokens}), job)
    ends = sequence_edges(layers, True, job.sequence_parallel_edges)
    priced = tp_allreduce_calls(layers, True, "none", True, ends)
    by_kind = {
        k: sum(c.count for c in priced if c.kind == k)
        for k in ("all_reduce", "all_gather", "reduce_scatter")
    }
    priced_bytes = sum(c.count * bytes_sent_per_rank(c.kind, 2, c.nbytes) for c in priced)
    for got in sp2[name]:
        assert by_kind == {
            "all_reduce": got["calls"]["all_reduce"],
            "all_gather": got["calls"]["all_gather_single"],
            "reduce_scatter": got["calls"]["all_to_all_single"],
        }
        assert got["metered"]["calls"] == sum(by_kind.values())
        assert got["metered"]["bytes"] == pytest.approx(priced_bytes, rel=1e-9)
    # the weights trained: the same on both ranks, and the unsplit model decodes as they did
    one = build_stage(spec, 0, "embedding", "head")
    one.load_state_dict(sp2[name][0]["full"])
    assert all(torch.equal(sp2[name][0]["full"][k], t) for k, t in sp2[name][1]["full"].items())
    assert greedy(spec, one) == sp2[name][0]["greedy"] == sp2[name][1]["greedy"]
