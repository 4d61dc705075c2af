"""Deployments whose replicas are tensor-parallel groups of worker processes, on 127.0.0.1,
against single-process training (the reference the pipeline tests use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_helpers import reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.netmodel import build_layer_costs
from dmsc.netmodel.layers import padded_vocab
from dmsc.netmodel.tp_calls import sequence_edges, tp_allreduce_calls
from dmsc.runtime.compute.checkpoints import read_checkpoint
from dmsc.runtime.compute.models.chain import layer_names
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.compute.outer_sync import make_optimizer
from dmsc.runtime.control.launch import recovery
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.transport.messages import Sampling
from dmsc.runtime.transport.wire import Kind, encode
from dmsc.spec import JobSpec, TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")
STEPS = 3
MICRO = 2
WHOLE = [("embedding", "head")]
TWO = [("embedding", "block_1"), ("block_2", "head")]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, SPEC.seq, seed=1)
    return [corpus.batch(s, 4) for s in range(STEPS)]


def test_tp2_trains_as_one_process_and_its_checkpoint_is_tp1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """tp = 2 with one stage: two processes, SIDs with their tp rank, the reference's losses;
    the checkpoint it saves is a tp = 1 stage file, and loading it back resumes the run."""
    batches = _batches()
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    with Deployment(StageLayout(SPEC, WHOLE, tp=2), home=tmp_path) as dep:
        sids = sorted(s.sid for s in dep.registry.lookup(stage=0))
        assert sids == ["stage0-r0-t0", "stage0-r0-t1"]
        losses = [dep.train_step(s, x, y, MICRO)["loss"] for s, (x, y) in enumerate(batches[:2])]
        ckpt = dep.checkpoint(2)
        losses.append(dep.train_step(2, *batches[2], MICRO)["loss"])
        dep.restore(ckpt)  # back before step 2: the same step gives the same loss
        again = dep.train_step(2, *batches[2], MICRO)["loss"]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4
    assert abs(again - losses[2]) < 1e-6
    # the file is the whole stage, optimizer included: it loads into a tp = 1 module, and a
    # tp = 1 deployment restored from it takes step 2 as the tp = 2 one did
    path, _ = ckpt.files[0]
    module = stage_module(SPEC, 0, *WHOLE[0])
    assert read_checkpoint(Path(path), SPEC, module, make_optimizer("adamw", module, 1e-3)) == 2
    with Deployment(StageLayout(SPEC, WHOLE), home=tmp_path) as dep:
        dep.restore(ckpt)
        assert abs(dep.train_step(2, *batches[2], MICRO)["loss"] - losses[2]) < 1e-4


def test_tp2_pp2_trains_as_one_process() -> None:
    """With the embedding (first stage) and the head (last) sharing one matrix, both split over
    the vocabulary: each tp rank swaps its rows' gradient with the same rank of the other end.
    Each rank sends the other stage its half of every activation and gradient, gathered there
    (``compute/pp_shards.py``): the bytes the cost model prices a device (a boundary
    activation's ``1/tp``, ``LayerCost.output_bytes``), not the whole from every rank."""
    spec = SPEC.model_copy(update={"tied_embeddings": True})
    batches = _batches()
    reference = reference_losses(spec, 0, 1e-3, batches, MICRO)
    with Deployment(StageLayout(spec, TWO, tp=2)) as dep:
        assert len(dep.tp.handles) == 2 and len(dep.handles) == 2
        outs = [dep.train_step(s, x, y, MICRO) for s, (x, y) in enumerate(batches)]
    losses = [o["loss"] for o in outs]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4
    rows = batches[0][0].shape[0] // MICRO
    job = JobSpec(global_batch=rows * MICRO, micro_batch=rows, tp=2, pp=2, dp=1)
    priced = max(lc.output_bytes for lc in build_layer_costs(spec, job) if lc.kind != "head")
    half = torch.zeros(rows, spec.seq, spec.hidden // 2)
    frame = len(encode(Kind.ACTIVATION, 1, 0, half, 0))  # a half and the frame's header
    assert half.numel() * 4 == priced and frame - priced < 100
    # and once a step, its rows' share of the tied embedding's gradient
    tied = len(
        encode(Kind.TIED_GRAD, 1, 0, torch.zeros(padded_vocab(spec.vocab, 2) // 2, spec.hidden), 0)
    )
    sent = outs[-1]["traces"]  # rank 0 of each stage: its activations, its gradients
    assert sent[(0, 0)][1] == {"1/0": MICRO * frame + tied}
    assert sent[(1, 0)][1] == {"0/0": MICRO * frame + tied}


def test_tp2_pp2_dp2_with_sequence_parallelism_trains_as_one_process() -> None:
    """Eight processes: each tp rank averages its shard's gradients with the same rank of the
    other replica, and each stage's blocks run split along the sequence too."""
    batches = _batches()
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    layout = StageLayout(SPEC, TWO, tp=2, replicas=2, sequence_parallel=True)
    with Deployment(layout) as dep:
        outs = [dep.train_step(s, x, y, MICRO // 2) for s, (x, y) in enumerate(batches)]
    losses = [o["loss"] for o in outs]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4
    # the stages' frames between block_1 and block_2 are each rank's slice of the sequence, as
    # Megatron's: no rank gathers the whole there. So each stage's ranks run the cost model's
    # list for their layers exactly, its one gather at the model's end included (the first
    # block's input gradient; the last block's output), where two a stage were before
    rows = batches[0][0].shape[0] // 2
    job = JobSpec(global_batch=2 * rows, micro_batch=rows, tp=2, pp=2, dp=2,
                  sequence_parallel=True)  # fmt: skip
    costs = build_layer_costs(SPEC.model_copy(update={"seq": batches[0][0].shape[1]}), job)
    names = layer_names(SPEC)
    ends = sequence_edges(costs, True, job.sequence_parallel_edges)
    for stage, (first, last) in enumerate(TWO):
        mine = [lc for lc in costs if lc.name in names[names.index(first) : names.index(last) + 1]]
        priced = tp_allreduce_calls(mine, True, "none", True, ends)
        for replica in (0, 1):
            tp = outs[-1]["comm"][(stage, replica)]["tp"]
            assert tp["calls"] == sum(c.count for c in priced), (stage, replica)
            # the group's exposed time, from both ranks' calls; their walls not kept
            assert tp["s"] > 0.0 and "wait_s" in tp and "walls" not in tp, (stage, replica)


def test_an_interleaved_tp2_pp2_sequence_parallel_pipeline_trains_as_one_process() -> None:
    """Two chunks a stage, each rank of each stage holding its chunks split along the sequence:
    every frame between blocks (stage 0 to 1, and back from stage 1's first chunk to stage 0's
    second) carries a sequence slice, the ends next to the embedding and the head whole."""
    batches = _batches()
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    chunks = [[("embedding", "block_0"), ("block_2", "block_2")],
              [("block_1", "block_1"), ("block_3", "head")]]  # fmt: skip
    layout = StageLayout(SPEC, [c[0] for c in chunks], chunks=chunks, tp=2,
                         sequence_parallel=True)  # fmt: skip
    with Deployment(layout) as dep:
        losses = [dep.train_step(s, x, y, MICRO)["loss"] for s, (x, y) in enumerate(batches)]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4


def test_tp2_greedy_decoding_equals_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding through two stages of two tensor-parallel ranks gives one process's tokens: a
    call a token, recomputing the context, and in runs drawn at the first stage (``Draw`` to
    both of its ranks, which agree before each token), greedy and sampled."""
    from dmsc.runtime.control.launch import decoding

    prompt, tokens, greedy = list(b"def f(x):"), 6, Sampling(temperature=0)
    warm = Sampling(temperature=0.8, top_k=20, seed=3)
    with Deployment(StageLayout(SPEC, WHOLE)) as dep:  # one process
        want = dep.generate(prompt, tokens, sampling=greedy, runs=False)
        sampled = dep.generate(prompt, tokens, sampling=warm, runs=False)
    with Deployment(StageLayout(SPEC, TWO, tp=2)) as dep:  # four: two stages of two ranks
        # each rank caches its heads
        assert dep.generate(prompt, tokens, sampling=greedy, runs=False) == want
        assert dep.generate(prompt, tokens, sampling=greedy, use_cache=False) == want
        calls: list[str] = []
        send = dep.tp.send

        def counted(key, leader, method, *rest):  # type: ignore[no-untyped-def]
            calls.extend([method] if method in ("RunStep", "Draw") else [])
            return send(key, leader, method, *rest)

        monkeypatch.setattr(dep.tp, "send", counted)
        monkeypatch.setattr(decoding, "RUN_S", 60.0)  # one run for the tokens after the first
        assert dep.draws_at_first_stage
        assert dep.generate(prompt, tokens, sampling=greedy) == want
        assert calls == ["RunStep", "Draw"], calls
        assert dep.generate(prompt, tokens, sampling=warm) == sampled


_TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": 97, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 97,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        },
    ),
}


@pytest.mark.parametrize("family", sorted(_TINY))
def test_tp2_greedy_decoding_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    """A tiny random GPT-2 and Llama saved with ``save_pretrained``, deployed from ``hf:DIR``
    as two stages of two tensor-parallel ranks: greedy decoding (with the key/value cache)
    gives the tokens ``transformers``' own ``generate`` gives."""
    import transformers

    config_cls, model_cls, kwargs = _TINY[family]
    torch.manual_seed(5)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # visible biases and norms: zeros and ones would hide a mapping error
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / family)
    spec = resolve_model(f"hf:{tmp_path / family}", {"seq": 32})
    assert isinstance(spec, TransformerSpec)
    names = layer_names(spec)  # embedding, block_0, block_1, head
    ranges = [(names[0], names[1]), (names[2], names[-1])]
    prompt = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=0)  # fmt: skip
    with Deployment(StageLayout(spec, ranges, tp=2)) as dep:
        got = dep.generate(prompt[0].tolist(), 8, sampling=Sampling(temperature=0))
    assert got == want[0, 6:].tolist()


def test_a_lost_tp_group_is_taken_over_by_warm_spares_one_per_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two warm spares (whole stages while they wait): rank 1 killed, both ranks of the replica
    are taken over by the spares, which meet in the new epoch's group, and the run goes on from
    the checkpoint with the reference's losses."""
    batches = _batches()
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    with Deployment(StageLayout(SPEC, WHOLE, tp=2), home=tmp_path, spares=2) as dep:
        spares = {h.address for h in dep.spares.handles}
        assert len(spares) == 2 and all(h.config.tp == 1 for h in dep.spares.handles)
        dep.train_step(0, *batches[0], MICRO)
        ckpt = dep.checkpoint(1)
        dep.tp.handles[0].process.kill()
        with pytest.raises(WorkerFailure) as failure:
            dep.train_step(1, *batches[1], MICRO)
        rec = recovery.recover(dep, failure.value, [ckpt])
        assert rec.failed == ["stage0-r0-t0", "stage0-r0-t1"] and rec.checkpoint_step == 1
        group = [*dep.handles, *dep.tp.handles]
        assert {h.address for h in group} == spares  # no new process for either rank
        assert [(h.config.tp_rank, h.config.epoch) for h in group] == [(0, 1), (1, 1)]
        losses = [dep.train_step(s, *batches[s], MICRO)["loss"] for s in (1, 2)]
    assert max(abs(a - b) for a, b in zip(losses, reference[1:], strict=True)) < 1e-4


def test_a_lost_tp_rank_is_found_and_its_whole_group_replaced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 of a replica killed: the step fails naming the replica, recovery starts both
    ranks anew (a new rank 0 alone would wait for its group forever; one warm spare is too few
    for the group's two ranks, and stays in the pool) and the run goes on from the checkpoint
    with the reference's losses."""
    batches = _batches()
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    with Deployment(StageLayout(SPEC, WHOLE, tp=2), home=tmp_path, spares=1) as dep:
        spare = [h.address for h in dep.spares.handles]
        dep.train_step(0, *batches[0], MICRO)
        ckpt = dep.checkpoint(1)
        dep.tp.handles[0].process.kill()
        with pytest.raises(WorkerFailure) as failure:
            dep.train_step(1, *batches[1], MICRO)
        assert failure.value.failed.keys() == {(0, 0)}
        rec = recovery.recover(dep, failure.value, [ckpt])
        assert rec.failed == ["stage0-r0-t0", "stage0-r0-t1"] and rec.checkpoint_step == 1
        assert [h.config.epoch for h in [*dep.handles, *dep.tp.handles]] == [1, 1]
        assert [h.address for h in dep.spares.handles] == spare  # not taken: too few
        assert spare[0] not in {h.address for h in [*dep.handles, *dep.tp.handles]}
        losses = [dep.train_step(s, *batches[s], MICRO)["loss"] for s in (1, 2)]
    assert max(abs(a - b) for a, b in zip(losses, reference[1:], strict=True)) < 1e-4


@pytest.mark.parametrize("name", ["llama-mini", "moe-mini"])
def test_tp2_llama_and_mixtral_families_train_as_one_process(name: str) -> None:
    """Grouped-query attention split by key/value heads, SwiGLU and each expert by units."""
    spec = resolve_model(name)
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=1)
    batches = [corpus.batch(s, 4) for s in range(2)]
    reference = reference_losses(spec, 0, 1e-3, batches, MICRO)  # type: ignore[arg-type]
    with Deployment(StageLayout(spec, WHOLE, tp=2)) as dep:  # type: ignore[arg-type]
        losses = [dep.train_step(s, x, y, MICRO)["loss"] for s, (x, y) in enumerate(batches)]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-4
