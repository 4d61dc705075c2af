"""Expert parallelism (:mod:`dmsc.runtime.compute.expert_parallel`) against one process: a
mixture split over two gloo ranks computes what the whole mixture computes on each rank's
tokens; moe-mini with ep = 2, each rank on half the batch, trains to the losses and gradients of
the whole model on the whole batch; its state dict gathers to the ep = 1 one and shards back
exactly, the whole model then decoding what each rank decoded; and which replicas average
which gradients, for a few (dp, ep)."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tp_helpers import LR, SEED, batches, small_spec

from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.expert_parallel import (
    ExpertParallelMoE,
    expert_of,
    expert_parallel_groups,
    gather_state_dict,
    gradient_averaging,
    kind_of,
    parallelize_experts,
    shard_state_dict,
)
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.chain import StageModule, build_stage, loss_fn
from dmsc.runtime.compute.models.llama import MixtureOfExperts
from dmsc.runtime.compute.outer_sync import make_optimizer
from dmsc.spec import TransformerSpec

EP = 2
# tokens per rank in each forward of the first mixture: uneven, and a rank with none
SIZES = ((3, 0, 64), (40, 5, 0))


def _spec() -> TransformerSpec:
    """moe-mini, two blocks deep (each with experts)."""
    return small_spec("moe-mini")


def _held_out(spec: TransformerSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (4, 33), generator=torch.Generator().manual_seed(99))


def _greedy(spec: TransformerSpec, module: StageModule, rank: int, new: int = 8) -> list[int]:
    """Greedy decoding with the key/value cache, each rank its own prompt: a prompt, then one
    token at a time (each step's few tokens exchanged between the ranks)."""
    tokens = _held_out(spec)[rank : rank + 1, :12]
    cache, out = StageCache(), []
    with torch.no_grad():
        logits = module(tokens, cache, 0)
        for _ in range(new):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = module(torch.tensor([[nxt]]), cache, cache.length)
    return out


def _average(module: StageModule, rank: int) -> None:
    """The data-parallel sync of dp = ep = 2, as :func:`gradient_averaging` says."""
    plan = gradient_averaging(EP, EP)
    for name, param in module.named_parameters():
        assert param.grad is not None, name
        how = plan[kind_of(name)]
        group = how.group_of(rank)
        if len(group) > 1:
            assert group == (0, 1)
            dist.all_reduce(param.grad)
        param.grad /= how.divisor


def _rank(rank: int, port: int, out: str) -> None:
    """One of two ranks of one expert-parallel group, each a data-parallel replica."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        spec = _spec()
        whole = build_stage(spec, SEED, "embedding", "head")
        mixture = next(m for m in whole.modules() if isinstance(m, MixtureOfExperts))
        reference, split = copy.deepcopy(mixture), ExpertParallelMoE(copy.deepcopy(mixture))
        forward = []
        METER.take()
        with torch.no_grad():
            for call, n in enumerate(SIZES[rank]):
                gen = torch.Generator().manual_seed(100 * rank + call)
                x = torch.randn(1, n, spec.hidden, generator=gen)
                forward.append((split(x), reference(x)))
        metered = METER.take()  # the step's meter: the forwards' all-to-alls

        module = parallelize_experts(whole)
        assert isinstance(module, StageModule)
        initial = gather_state_dict(module)
        exchanges = _all_to_alls(spec, module, rank)
        optimizer = make_optimizer("adamw", module, LR)
        losses, grads = [], {}
        for step, tokens in enumerate(batches(spec)):
            mine = tokens[rank * 2 : (rank + 1) * 2]
            loss = loss_fn(module(mine[:, :-1]), mine[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _average(module, rank)
            if step == 0:
                grads = {
                    n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None
                }
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / 2)
        local = {k: v.detach().clone() for k, v in module.state_dict().items()}
        full = gather_state_dict(module)
        with torch.no_grad():
            held = _held_out(spec)
            held_out = float(loss_fn(module(held[:, :-1]), held[:, 1:]))
        greedy = _greedy(spec, module, rank)
        record = {"forward": forward, "initial": initial, "exchanges": exchanges}
        record |= {"metered": metered}
        record |= {"losses": losses, "grads": grads, "local": local, "full": full}
        record |= {"held_out": held_out, "greedy": greedy}
        torch.save(record, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _all_to_alls(spec: TransformerSpec, module: StageModule, rank: int) -> dict[str, Any]:
    """The all-to-alls of one forward and backward (its gradients then dropped): the tokens'
    (differentiable) and all those gloo ran; and the step's meter's ``ep`` figures for the
    forward alone and for the forward and backward."""
    tokens = batches(spec)[0][rank * 2 : (rank + 1) * 2]
    METER.take()
    with torch.no_grad():
        module(tokens[:, :-1])
    forward = METER.take()["ep"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn(module(tokens[:, :-1]), tokens[:, 1:]).backward()
    step = METER.take()["ep"]
    module.zero_grad(set_to_none=True)
    names = Counter(e.name for e in prof.events())
    counted = {"tokens": names["ep::all_to_all"], "all": names["gloo:all_to_all"]}
    return counted | {"forward": forward, "step": step}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's record (one pair of processes for every test)."""
    out = tmp_path_factory.mktemp("ep2")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    with pytest.MonkeyPatch.context() as patch:
        # the spawned ranks import this module by its name, with the repository's root on sys.path
        patch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
        mp.spawn(_rank, args=(store.port, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.integration
def test_a_split_mixture_computes_what_the_whole_one_does(ep2: list[dict[str, Any]]) -> None:
    for rank, record in enumerate(ep2):
        assert [got.shape[1] for got, _ in record["forward"]] == list(SIZES[rank])
        for got, want in record["forward"]:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.integration
def test_the_meter_counts_each_forward_s_three_all_to_alls(ep2: list[dict[str, Any]]) -> None:
    """The counts, the tokens out and the tokens back: on the step's meter as ``ep``, with the
    bytes that left the rank (the counts' int64s at least)."""
    experts = _spec().experts
    for rank, record in enumerate(ep2):
        ep = record["metered"]["ep"]
        assert set(record["metered"]) == {"ep"} and ep["calls"] == 3 * len(SIZES[rank])
        assert ep["bytes"] >= len(SIZES[rank]) * experts * 8 and ep["s"] > 0


def test_ep2_trains_to_the_losses_and_gradients_of_one_process(
    ep2: list[dict[str, Any]],
) -> None:
    spec = _spec()
    torch.set_num_threads(1)
    whole = build_stage(spec, SEED, "embedding", "head")
    optimizer = make_optimizer("adamw", whole, LR)
    reference, first = [], {}
    for step, tokens in enumerate(batches(spec)):
        loss = loss_fn(whole(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}
        optimizer.step()
        reference.append(float(loss.detach()))
    for record in ep2:
        assert record["losses"] == pytest.approx(reference, abs=1e-4)
    # the first step's averaged gradients: every replica's dense ones, each rank's experts
    got = ep2[0]["grads"] | {k: v for k, v in ep2[1]["grads"].items() if kind_of(k) == "expert"}
    assert got.keys() == first.keys()
    for name, grad in first.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        if kind_of(name) == "dense":
            assert torch.equal(ep2[1]["grads"][name], got[name]), name
    assert reference[-1] < reference[1] - 0.5  # it learns
    # per mixture: tokens out and back in the forward, both reversed in the backward, and one
    # exchange of the token counts (the cost model's five, netmodel/layers.py ep_counts_bytes)
    mixtures = sum(isinstance(m, MixtureOfExperts) for m in whole.modules())
    assert mixtures == spec.layers == 2
    for record in ep2:
        got = record["exchanges"]
        assert {k: got[k] for k in ("tokens", "all")} == {
            "tokens": 4 * mixtures,
            "all": 5 * mixtures,
        }


@pytest.mark.integration
def test_the_meter_counts_the_backward_s_all_to_alls_too(ep2: list[dict[str, Any]]) -> None:
    """Forward and backward: the three of each mixture's forward and the two of its backward on
    the step's meter, the backward sending away what the forward's two exchanges brought in
    (each exchange's reverse), so the step's ``ep`` bytes are twice the tokens' of the forward
    plus the counts (one int64 per expert and mixture)."""
    spec = _spec()
    counts = spec.layers * spec.experts * 8
    for record in ep2:
        forward, step = record["exchanges"]["forward"], record["exchanges"]["step"]
        assert forward["calls"] == 3 * spec.layers and step["calls"] == 5 * spec.layers
        assert forward["bytes"] > counts
        assert step["bytes"] == 2 * (forward["bytes"] - counts) + counts
        assert step["s"] > 0 and forward["s"] > 0


@pytest.mark.integration
def test_an_ep2_state_dict_loads_into_ep1_and_back(ep2: list[dict[str, Any]]) -> None:
    spec = _spec()
    whole = build_stage(spec, SEED, "embedding", "head")
    for record in ep2:  # split then gathered: the model as built
        assert record["initial"].keys() == whole.state_dict().keys()
        for key, tensor in whole.state_dict().items():
            assert torch.equal(record["initial"][key], tensor), key
    full = ep2[0]["full"]
    assert full.keys() == ep2[1]["full"].keys()
    assert all(torch.equal(full[k], t) for k, t in ep2[1]["full"].items())
    # ep = 2 -> ep = 1: the gathered state dict loads into the whole model, which computes
    # the loss the two ranks computed on the held-out batch
    one = build_stage(spec, 0, "embedding", "head")
    one.load_state_dict(full)
    held = _held_out(spec)
    with torch.no_grad():
        loss = float(loss_fn(one(held[:, :-1]), held[:, 1:]))
    assert loss == pytest.approx(ep2[0]["held_out"], abs=1e-5)
    # and decodes each rank's prompt as that rank did
    for rank, record in enumerate(ep2):
        assert _greedy(spec, one, rank) == record["greedy"]
    # ep = 1 -> ep = 2: each rank's shard is exactly what it held, half the experts each
    for rank, record in enumerate(ep2):
        shard = shard_state_dict(one.state_dict(), spec.experts, rank, EP)
        assert shard.keys() == record["local"].keys()
        for key, tensor in record["local"].items():
            assert torch.equal(shard[key], tensor), key
        held_experts = {expert_of(k) for k in shard} - {None}
        assert held_experts == {2 * rank, 2 * rank + 1}


@pytest.mark.parametrize(
    ("dp", "ep", "dense", "expert", "exchange"),
    [
        (1, 1, [(0,)], [(0,)], [(0,)]),
        (2, 1, [(0, 1)], [(0, 1)], [(0,), (1,)]),
        (2, 2, [(0, 1)], [(0,), (1,)], [(0, 1)]),
        (4, 2, [(0, 1, 2, 3)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]),
        (6, 3, [tuple(range(6))], [(0, 3), (1, 4), (2, 5)], [(0, 1, 2), (3, 4, 5)]),
        (8, 4, [tuple(range(8))], [(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ],
)
def test_gradient_averaging_groups(
    dp: int,
    ep: int,
    dense: list[tuple[int, ...]],
    expert: list[tuple[int, ...]],
    exchange: list[tuple[int, ...]],
) -> None:
    plan = gradient_averaging(dp, ep)
    assert list(plan["dense"].groups) == dense and list(plan["expert"].groups) == expert
    assert plan["dense"].divisor == plan["expert"].divisor == dp
    assert expert_parallel_groups(dp, ep) == exchange
    for rank in range(dp):
        # the replicas holding rank's experts: its position in its exchange group, in each
        held_alike = plan["expert"].group_of(rank)
        assert len(held_alike) == dp // ep
        assert all(r % ep == rank % ep for r in held_alike)
        assert rank in plan["dense"].group_of(rank)


@pytest.mark.parametrize(("dp", "ep"), [(4, 3), (2, 0), (0, 1)])
def test_gradient_averaging_refuses_an_ep_not_dividing_dp(dp: int, ep: int) -> None:
    with pytest.raises(ValueError, match="must divide"):
        gradient_averaging(dp, ep)


def test_expert_parameters_are_told_by_name() -> None:
    assert kind_of("layers.1.mlp.experts.3.gate.weight") == "expert"
    assert expert_of("layers.1.mlp.experts.3.gate.weight") == 3
    assert kind_of("layers.1.mlp.router.weight") == "dense"
    assert kind_of("layers.1.mlp.gate.weight") == "dense"
    assert kind_of("layers.0.tok.weight") == "dense"


def test_an_ep1_mixture_computes_and_learns_what_the_whole_one_does() -> None:
    """At ep = 1 (a tensor-parallel replica's mixture at tp = 1) nothing is exchanged and no
    group is needed: the output and every gradient are the whole mixture's."""
    spec = _spec()
    whole = MixtureOfExperts(spec)
    mine = ExpertParallelMoE(copy.deepcopy(whole), None, 0, 1)
    x = torch.randn(2, 9, spec.hidden, generator=torch.Generator().manual_seed(4))
    outputs = []
    for mixture in (whole, mine):
        xi = x.clone().requires_grad_(True)
        y = mixture(xi)
        y.square().sum().backward()
        assert xi.grad is not None
        outputs.append((y.detach(), xi.grad, {n: p.grad for n, p in mixture.named_parameters()}))
    (y0, g0, p0), (y1, g1, p1) = outputs
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert p1.keys() == p0.keys()
    for name, grad in p0.items():
        torch.testing.assert_close(p1[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_ep1_mixture_is_cut_to_a_rank_s_share_once() -> None:
    spec = _spec()
    one = ExpertParallelMoE(MixtureOfExperts(spec), None, 0, 1)
    half = ExpertParallelMoE(one, None, 1, EP)
    assert list(half.experts) == ["2", "3"] and half.experts["2"] is one.experts["2"]
    with pytest.raises(ValueError, match="already split over ep=2"):
        ExpertParallelMoE(half, None, 0, EP)
