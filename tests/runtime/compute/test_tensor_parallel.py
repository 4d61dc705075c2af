"""Tensor parallelism (:mod:`dmsc.runtime.compute.tensor_parallel`) against one process: a whole
model split over two gloo ranks trains 10 steps to the same losses as the model unsplit, and
its state dict gathers to the unsplit one and shards back (a tp = 2 checkpoint loads into
tp = 1 and back), where the unsplit model computes and greedily decodes what the ranks did."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from tp_helpers import SEED, batches, greedy, small_spec, train, two_ranks

from dmsc.netmodel import build_layer_costs
from dmsc.netmodel.constants import DTYPE_BYTES
from dmsc.netmodel.tp_calls import tp_allreduce_calls
from dmsc.runtime.compute.comm_meter import METER, ring_allreduce_bytes
from dmsc.runtime.compute.models.chain import StageModule, build_stage, loss_fn
from dmsc.runtime.compute.tensor_parallel import (
    gather_state_dict,
    parallelize_stage,
    shard_state_dict,
    split_of,
)
from dmsc.runtime.compute.vocab_parallel import stage_loss
from dmsc.spec import JobSpec, TransformerSpec

pytestmark = pytest.mark.integration  # one pair of rank processes: conftest.ONE_PROCESS


FAMILIES = ("gpt-mini", "llama-mini", "moe-mini")


def _rank(rank: int, port: int, out: str) -> None:
    """One of two tensor-parallel ranks: each family built whole from the seed, split, its
    state dict gathered, trained, gathered again and evaluated on a batch it did not see."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for name in FAMILIES:
            spec = small_spec(name)
            module = parallelize_stage(spec, build_stage(spec, SEED, "embedding", "head"))
            initial = gather_state_dict(spec, module)
            METER.take()
            collectives = _all_reduces(spec, module)
            step_comm = METER.take()["tp"]
            losses = train(spec, module)
            local = {k: v.detach().clone() for k, v in module.state_dict().items()}
            full = gather_state_dict(spec, module)
            held_out = _evaluate(spec, module)
            record = {"losses": losses, "initial": initial, "local": local, "full": full}
            record["greedy"] = greedy(spec, module)
            record["all_reduces"] = collectives
            record["step_comm"] = step_comm
            record["block_comm"] = _block_comm(spec, module)
            torch.save(record | {"held_out": held_out}, f"{out}/{name}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _all_reduces(spec: TransformerSpec, module: StageModule) -> int:
    """The all-reduces of one forward and backward (its gradients then dropped)."""
    calls, all_reduce = [], dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return all_reduce(*args, **kwargs)

    tokens = batches(spec)[0]
    dist.all_reduce = counted
    try:
        stage_loss(module, module(tokens[:, :-1]), tokens[:, 1:]).backward()
    finally:
        dist.all_reduce = all_reduce
    module.zero_grad(set_to_none=True)
    return len(calls)


def _block_comm(spec: TransformerSpec, module: StageModule) -> dict[str, float]:
    """The step's meter's ``tp`` figures for the first block's forward and backward on a
    micro-batch of two sequences of the model's length (its gradients then dropped)."""
    block = module.layers[1]
    x = torch.randn(2, spec.seq, spec.hidden, generator=torch.Generator().manual_seed(5))
    x.requires_grad_(True)
    METER.take()
    block(x).square().mean().backward()
    module.zero_grad(set_to_none=True)
    return METER.take()["tp"]


def _evaluate(spec: TransformerSpec, module: StageModule) -> float:
    tokens = torch.randint(0, spec.vocab, (4, 33), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(loss_fn(module(tokens[:, :-1]), tokens[:, 1:]))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each family's record from the two ranks (one pair of processes for all of them)."""
    return two_ranks(_rank, tmp_path_factory.mktemp("tp2"), FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_trains_to_the_losses_of_one_process(
    tp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    spec = small_spec(name)
    torch.set_num_threads(1)
    whole = build_stage(spec, SEED, "embedding", "head")
    split_then_gathered = tp2[name][0]["initial"]
    assert split_then_gathered.keys() == whole.state_dict().keys()
    for key, tensor in whole.state_dict().items():
        assert torch.equal(split_then_gathered[key], tensor), key
    reference = train(spec, whole)
    for got in tp2[name]:
        assert got["losses"] == pytest.approx(reference, abs=1e-4)
    # one all-reduce per sub-layer in the forward, one in the backward (a mixture's too, not
    # one per expert); the embedding's and the head's (forward, backward) and the loss's three
    assert tp2[name][0]["all_reduces"] == 4 * spec.layers + 5
    assert reference[-2] < reference[0] - 0.5 and reference[-1] < reference[1] - 0.5  # learns


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tp2_state_dict_loads_into_tp1_and_back(
    tp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    spec = small_spec(name)
    full = tp2[name][0]["full"]
    assert all(torch.equal(full[k], t) for k, t in tp2[name][1]["full"].items())
    # tp = 2 -> tp = 1: the gathered state dict loads into the unsplit model, which computes
    # what the two ranks computed
    one = build_stage(spec, 0, "embedding", "head")
    one.load_state_dict(full)
    assert _evaluate(spec, one) == pytest.approx(tp2[name][0]["held_out"], abs=1e-5)
    # and decodes the same tokens (each rank keeping the keys and values of its own heads)
    assert greedy(spec, one) == tp2[name][0]["greedy"] == tp2[name][1]["greedy"]
    # tp = 1 -> tp = 2: each rank's shard of it is exactly what that rank held
    split = [k for k in full if split_of(spec, k)]
    assert split and len(split) < len(full)
    for rank, got in enumerate(tp2[name]):
        shards = shard_state_dict(spec, one.state_dict(), rank, 2)
        assert shards.keys() == got["local"].keys()
        for key, tensor in got["local"].items():
            assert torch.equal(shards[key], tensor), key
            if key in split:
                assert tensor.numel() * 2 == full[key].numel(), key


@pytest.mark.parametrize("name", ("llama-mini", "moe-mini"))
def test_a_block_runs_the_tp_collectives_the_cost_model_prices(
    tp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """A block's forward and backward on each rank: the calls and the ring's bytes of the
    block's layer cost (``netmodel/layers.py``), a mixture's like a dense MLP's; the mixture
    adds only its router weights' gradients (tokens x top_k numbers) to the backward's sum,
    which the cost model prices too."""
    spec = small_spec(name)
    job = JobSpec(global_batch=2, micro_batch=2, tp=2, sequence_parallel=False)
    block = build_layer_costs(spec, job)[1]
    assert block.kind == ("moe_block" if spec.is_moe else "block")
    calls = block.tp_allreduces_fwd + block.tp_allreduces_bwd
    elements = int(block.tp_allreduce_bytes) // DTYPE_BYTES[spec.dtype]
    priced = calls * ring_allreduce_bytes(elements, DTYPE_BYTES[spec.dtype], 2)
    router = ring_allreduce_bytes(2 * spec.seq * spec.top_k, 4, 2) if spec.is_moe else 0
    assert ring_allreduce_bytes(int(block.tp_router_grad_bytes), 1, 2) == router
    for got in tp2[name]:
        assert got["block_comm"]["calls"] == calls == 4
        assert got["block_comm"]["bytes"] == priced + router


@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_runs_the_tp_collectives_the_cost_model_prices(
    tp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """One micro-batch's forward and backward through the whole model on each rank (the
    vocabulary-split embedding, the blocks, the head and the loss's three sums): the metered
    tp calls and ring bytes are those of the cost model's list (``netmodel/tp_calls.py``)."""
    spec = small_spec(name)
    tokens = batches(spec)[0]
    micro, seq = tokens.shape[0], tokens.shape[1] - 1
    job = JobSpec(global_batch=micro, micro_batch=micro, tp=2)
    layers = build_layer_costs(spec.model_copy(update={"seq": seq}), job)
    calls = tp_allreduce_calls(layers, train=True, recompute=job.recompute)
    count = sum(c.count for c in calls)
    priced = sum(c.count * ring_allreduce_bytes(int(c.nbytes), 1, 2) for c in calls)
    loss = [c for c in calls if c.layer == "head" and c.phase == "forward"]
    assert [(c.count, c.nbytes) for c in loss] == [(3, 4 * micro * seq)]
    for got in tp2[name]:
        assert got["step_comm"]["calls"] == count == got["all_reduces"] == 4 * spec.layers + 5
        assert got["step_comm"]["bytes"] == priced


@pytest.mark.parametrize("name", FAMILIES)
def test_a_rank_holds_the_parameters_the_cost_model_counts(
    tp2: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """The norms and a row-parallel layer's bias stay whole on every rank: a rank's parameters
    (what its data-parallel all-reduce carries) are the layers' ``params_per_device``."""
    spec = small_spec(name)
    layers = build_layer_costs(spec, JobSpec(global_batch=2, micro_batch=2, tp=2))
    priced = sum(lc.params_per_device for lc in layers)
    names = {n for n, _ in build_stage(spec, SEED, "embedding", "head").named_parameters()}
    for got in tp2[name]:
        assert sum(t.numel() for k, t in got["local"].items() if k in names) == priced
