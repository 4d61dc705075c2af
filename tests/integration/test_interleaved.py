"""An interleaved pipeline of real worker processes (pp = 2, v = 2 chunks per stage) against
single-process training, and its checkpoint in a plain pp = 2 pipeline (issue 31, point 4).

gpt-mini's chain (embedding, block_0 .. block_3, head) cut as ``dmsc plan --schedule
interleaved --interleave 2`` cuts it: stage 0 holds chunks 0 and 2 (embedding .. block_0,
block_2), stage 1 chunks 1 and 3 (block_1, block_3 .. head)."""

from __future__ import annotations

from pathlib import Path

import torch
from runtime_helpers import reference_losses

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.planner.plan import stage_chunks
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.transport.messages import Sampling
from dmsc.spec import JobSpec, resolve_model

SPEC = resolve_model("gpt-mini")
MICRO = 4
INTERLEAVED_STEPS = 2  # then 1 in the plain pipeline, from the interleaved run's checkpoint
PLAIN = [("embedding", "block_1"), ("block_2", "head")]


def test_interleaved_pipeline_trains_as_one_process_and_its_checkpoint_moves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = JobSpec(global_batch=8, micro_batch=2, pp=2, schedule="interleaved", interleave=2)
    chunks = [c for _, c in stage_chunks(SPEC, job)]
    assert chunks == [
        [("embedding", "block_0"), ("block_2", "block_2")],
        [("block_1", "block_1"), ("block_3", "head")],
    ]
    train, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train, SPEC.seq, seed=1)
    batches = [corpus.batch(s, 8) for s in range(INTERLEAVED_STEPS + 1)]
    reference = reference_losses(SPEC, 0, 1e-3, batches, MICRO)
    prompt = list(b"def main(")
    greedy = Sampling(temperature=0.0, seed=0)
    layout = StageLayout(SPEC, [c[0] for c in chunks], chunks=chunks)
    with Deployment(layout, home=tmp_path / "interleaved") as dep:
        outs = [
            dep.train_step(s, x, y, MICRO) for s, (x, y) in enumerate(batches[:INTERLEAVED_STEPS])
        ]
        ckpt = dep.checkpoint(INTERLEAVED_STEPS)
        x, y = batches[0]
        val = dep.eval_step(900, x, y, MICRO)
        logits = dep.logits(901, x[:2])
        tokens = dep.generate(prompt, 4, sampling=greedy)  # keys and values kept per chunk
        recomputed = dep.generate(prompt, 4, sampling=greedy, use_cache=False)
    losses = [o["loss"] for o in outs]
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=False)) < 1e-4, losses
    # each stage ran a forward and a backward of every micro-batch through each of its chunks
    for key, (spans, _sent) in outs[-1]["traces"].items():
        assert sorted((op, mb) for op, mb, *_ in spans) == sorted(
            (op, i) for op in "FB" for i in range(MICRO) for _ in range(2)
        ), key
    assert tokens == recomputed
    # stage 0's file holds the embedding and block 2, not block 1 (no merged range)
    folder = Path(ckpt.files[0][0]).parent
    names = {f.name for f in folder.iterdir()}
    assert {"stage0.safetensors", "stage1.safetensors", "model.safetensors.index.json"} <= names
    from safetensors import safe_open

    with safe_open(str(folder / "stage0.safetensors"), "pt") as fh:
        held = {k.split(".")[2] for k in fh.keys() if k.startswith("transformer.h.")}  # noqa: SIM118
    assert held == {"0", "2"}

    with Deployment(StageLayout(SPEC, PLAIN), home=tmp_path / "plain") as dep:
        dep.restore(ckpt)  # weights and AdamW moments from both interleaved stages' files
        assert abs(dep.eval_step(900, x, y, MICRO) - val) < 1e-5
        assert torch.allclose(dep.logits(901, x[:2]), logits, atol=1e-5)
        assert dep.generate(prompt, 4, sampling=greedy) == tokens
        after = [
            dep.train_step(s, bx, by, MICRO)["loss"]
            for s, (bx, by) in enumerate(batches)
            if s >= INTERLEAVED_STEPS
        ]
    assert max(abs(a - b) for a, b in zip(after, reference[INTERLEAVED_STEPS:], strict=True)) < 1e-4
