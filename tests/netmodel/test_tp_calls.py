"""The tensor-parallel all-reduces the cost model prices (:mod:`dmsc.netmodel.tp_calls`), against
the calls counted by hand from Megatron-LM's layout (Shoeybi et al., 2019, sec. 3) and its
vocabulary-parallel cross-entropy: each call once in the iteration's tp traffic."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dmsc.netmodel import build_layer_costs, estimate_iteration
from dmsc.netmodel.layers import padded_vocab
from dmsc.netmodel.tp_calls import TpCall, tp_allreduce_calls
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model

MOE = TransformerSpec(
    layers=2, hidden=64, heads=4, seq=16, vocab=256, experts=4, top_k=2, mlp="swiglu"
)


def test_a_mixtures_training_step_by_hand() -> None:
    """micro-batch 2 of 16 tokens, hidden 64, fp16 (2 bytes), tp = 2: the embedding's sum, two
    forward and two backward sums per block (one carrying the router's 32 x 2 gradients in a
    mixture), the head's backward sum and the loss's three fp32 sums of one number a token."""
    T, h, k = 32, 64, 2
    job = JobSpec(global_batch=2, micro_batch=2, tp=2)
    got = tp_allreduce_calls(build_layer_costs(MOE, job), train=True, recompute="none")
    want = [TpCall("embedding", "forward", 2 * T * h, 1)]
    for i in range(MOE.layers):
        name = f"block_{i}"
        want.append(TpCall(name, "forward", 2 * T * h, 2))
        if MOE.is_moe_layer(i):
            want.append(TpCall(name, "backward", 2 * T * (h + k), 1))
            want.append(TpCall(name, "backward", 2 * T * h, 1))
        else:
            want.append(TpCall(name, "backward", 2 * T * h, 2))
    want += [TpCall("head", "forward", 4 * T, 3), TpCall("head", "backward", 2 * T * h, 1)]
    assert got == want
    assert sum(c.count for c in got) == 4 * MOE.layers + 5  # as the runtime's test counts them


def test_a_forward_and_full_recomputation() -> None:
    job = JobSpec(global_batch=2, micro_batch=2, tp=2)
    layers = build_layer_costs(MOE, job)
    forward = tp_allreduce_calls(layers, train=False, recompute="none")
    # no loss and no backward: the embedding's sum, the blocks' two, and the head's logits
    # gathered over the vocabulary (fp16, 32 tokens x 256 words: the whole buffer's bytes)
    assert [(c.layer, c.count, c.kind) for c in forward] == [
        ("embedding", 1, "all_reduce"),
        ("block_0", 2, "all_reduce"),
        ("block_1", 2, "all_reduce"),
        ("head", 1, "all_gather"),
    ]
    assert forward[-1].nbytes == 2 * 32 * 256
    full = tp_allreduce_calls(layers, train=True, recompute="full")
    again = [c for c in full if c.phase == "recompute"]
    assert [(c.layer, c.count) for c in again] == [("block_0", 2), ("block_1", 2)]
    # nothing at tp = 1
    one = build_layer_costs(MOE, JobSpec(global_batch=2, micro_batch=2))
    assert tp_allreduce_calls(one, train=True, recompute="full") == []


@pytest.mark.parametrize("name", ["gpt3-2.7b", "mixtral-8x7b"])
def test_the_iteration_sends_every_call_once(selene: ClusterSpec, name: str) -> None:
    """tp = 8 on one node, ring, two micro-batches of one sequence: a ring member sends
    2 (n - 1) / n of each buffer (Patarasuk and Yuan, JPDC 2009), 14 buffers for the 8 members."""
    model = resolve_model(name)
    assert isinstance(model, TransformerSpec)
    model = model.model_copy(update={"layers": 4})
    job = JobSpec(global_batch=2, micro_batch=1, tp=8, allreduce="ring")
    B, T, h, L = 2, model.seq, model.hidden, model.layers
    mixtures = sum(model.is_moe_layer(i) for i in range(L))
    per_rank = B * T * h * (1 + 4 * L + 1) + 3 * 4 * T + mixtures * B * T * model.top_k
    est = estimate_iteration(selene, model, job)
    assert est.traffic_bytes["tp"] == pytest.approx(2 * 14 * per_rank, rel=1e-12)


def test_a_mixture_at_ep_2_sends_its_token_counts_before_its_tokens(selene: ClusterSpec) -> None:
    """Per mixture and micro-batch, an all-to-all of one int64 per expert, then the tokens out
    and back and their gradients (four of top_k x tokens x hidden): each rank sends (n - 1) / n
    of each buffer, n = 2."""
    model = resolve_model("mixtral-8x7b")
    assert isinstance(model, TransformerSpec)
    model = model.model_copy(update={"layers": 4})
    job = JobSpec(global_batch=4, micro_batch=1, dp=2, ep=2)
    B, T, h = 2, model.seq, model.hidden
    per_rank = 4 * (B * T * h * model.top_k) / 2 + 8 * model.experts / 2
    est = estimate_iteration(selene, model, job)
    assert est.traffic_bytes["ep"] == pytest.approx(4 * 2 * 2 * per_rank, rel=1e-12)


def test_an_inference_forward_gathers_the_logits(selene: ClusterSpec) -> None:
    """tp = 8, one sequence, inference: the embedding's and the blocks' sums (2 (n - 1) / n of
    each buffer), then the head's all-gather of the logits over the (padded) vocabulary, of which
    a rank sends (n - 1) / n; before, an inference forward priced no gather at all."""
    model = resolve_model("gpt3-2.7b")
    assert isinstance(model, TransformerSpec)
    model = model.model_copy(update={"layers": 2})
    job = JobSpec(global_batch=1, micro_batch=1, tp=8, allreduce="ring", mode="infer")
    B, T, h, n = 2, model.seq, model.hidden, 8
    V = padded_vocab(model.vocab, n)
    per_rank = 2 * (n - 1) / n * B * T * h * (1 + 2 * model.layers) + (n - 1) / n * B * T * V
    est = estimate_iteration(selene, model, job)
    assert est.traffic_bytes["tp"] == pytest.approx(n * per_rank, rel=1e-12)


GPT = TransformerSpec(layers=3, hidden=64, heads=4, seq=16, vocab=256)


def test_sequence_parallel_ends_as_the_runtime_runs_them(
    one_node: Callable[[int], ClusterSpec],
) -> None:
    """Sequence parallelism, ``sequence_parallel_edges: gathered`` (dmsc's runtime, the
    default): one all-gather a micro-batch more at each end of the split region, the first
    block's backward (its sliced input's gradient) and the last block's forward (its output,
    whole for the head), each of the whole activations' buffer; ``fused`` (Megatron-LM's, as the
    published sets are priced) has neither. Both used to be left out, and the runtime's tests
    added them by hand; the iteration's tp traffic counts them too."""
    from dmsc.netmodel.collectives import bytes_sent_per_rank
    from dmsc.netmodel.tp_calls import sequence_edges

    job = JobSpec(global_batch=2, micro_batch=2, tp=2, sequence_parallel=True)
    layers = build_layer_costs(GPT, job)
    assert sequence_edges(layers, True, "gathered") == ("block_0", "block_2")
    assert sequence_edges(layers, True, "fused") is None
    assert sequence_edges(layers, False, "gathered") is None
    fused = tp_allreduce_calls(layers, True, "none", True)
    gathered = tp_allreduce_calls(layers, True, "none", True, ("block_0", "block_2"))
    extra = [c for c in gathered if c not in fused]
    whole = 2 * 32 * 64  # fp16, 32 tokens x hidden 64
    assert extra == [
        TpCall("block_0", "backward", whole, 1, "all_gather"),
        TpCall("block_2", "forward", whole, 1, "all_gather"),
    ]
    # a stage of the middle block alone runs neither
    middle = [lc for lc in layers if lc.name == "block_1"]
    assert tp_allreduce_calls(middle, True, "none", True, ("block_0", "block_2")) == (
        tp_allreduce_calls(middle, True, "none", True)
    )
    # the estimate's tp bytes: the two gathers' more with the default, as Megatron without
    cluster = one_node(2)
    ours = estimate_iteration(cluster, GPT, job)
    megatron = estimate_iteration(
        cluster, GPT, job.model_copy(update={"sequence_parallel_edges": "fused"})
    )
    more = 2 * bytes_sent_per_rank("all_gather", 2, whole) * 2  # two calls, two ranks
    assert ours.traffic_bytes["tp"] - megatron.traffic_bytes["tp"] == pytest.approx(more)
    assert ours.breakdown_s["tp_comm"] > megatron.breakdown_s["tp_comm"]
