"""Aggregating the task heads of a business-segmented model at inference.

A gpt-mini-sized model (4 blocks, hidden 128, byte vocabulary) cut into a backbone (embedding,
block_0, block_1) and K=3 task heads (block_2, block_3 and an output layer each), every head
predicting the next byte. Head k trains only on shard k of the standard library's training text
(a contiguous third: different modules, so skewed data, as separate sites would hold), the
backbone on all three (:func:`dmsc.runtime.compute.models.heads.train_heads`).

The held-out text (the standard library files the training text leaves out) is cut in two: the
first half calibrates the combiners (each head's accuracy there is its weight for ``weighted``;
the attention combiner is fitted there), the second half scores everything: accuracy of the
next byte and cross-entropy (nats per byte), for each head alone, the heads' mean, ``vote``
(unweighted, ties broken by summed probability), ``weighted`` and ``attention``; and for each
combiner with one head late (missing), averaged over which head.

Prints a table, or with --json one object: ``rows`` (name -> ``accuracy``, ``loss``, and for
the combiners ``late_accuracy``, ``late_loss``, ``late`` per missing head), ``weights``
(calibration accuracies), ``attention_weights`` (mean weight per head on the scoring half),
``train_s``, ``fit_s``, and the settings.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from dmsc.data.corpus import stdlib_text
from dmsc.runtime.compute.models.heads import build_heads, held_out, shard_text, train_heads
from dmsc.runtime.control.serving.combiners import (
    METHODS,
    AttentionCombiner,
    HeadProbs,
    combine,
    fit_attention,
    score,
)
from dmsc.spec import TransformerSpec, resolve_model

HEADS = 3
BACKBONE_BLOCKS = 2


def run(steps: int, batch: int, windows: int, seed: int) -> dict[str, Any]:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    train, valid = stdlib_text()
    model = build_heads(spec, HEADS, BACKBONE_BLOCKS, seed=seed)
    t0 = time.perf_counter()
    losses = train_heads(
        model, shard_text(train, HEADS), steps, batch, spec.seq, lr=3e-3, seed=seed
    )
    train_s = time.perf_counter() - t0
    half = len(valid) // 2
    x_cal, y_cal = held_out(valid[:half], spec.seq, windows)
    x_eval, y_eval = held_out(valid[half:], spec.seq, windows)
    cal, labels_cal = model.head_probs(x_cal), y_cal.reshape(-1)
    evals, labels = model.head_probs(x_eval), y_eval.reshape(-1)

    weights = [score(p, labels_cal).accuracy for p in cal]
    combiner = AttentionCombiner(HEADS, seed=seed)
    t0 = time.perf_counter()
    fit_attention(combiner, cal, labels_cal, steps=300, lr=0.05, seed=seed)
    fit_s = time.perf_counter() - t0

    rows: dict[str, dict[str, Any]] = {}
    for k, p in enumerate(evals):
        rows[f"head_{k}"] = score(p, labels)._asdict()
    rows["mean of heads"] = {
        key: sum(r[key] for r in rows.values()) / HEADS for key in ("accuracy", "loss")
    }

    def combined(method: str, probs: HeadProbs) -> dict[str, float]:
        vote_weights = None if method == "vote" else weights
        return score(combine(method, probs, vote_weights, combiner), labels)._asdict()

    for method in METHODS:
        row: dict[str, Any] = combined(method, evals)
        late = {}
        for k in range(HEADS):
            part: list[torch.Tensor | None] = list(evals)
            part[k] = None
            late[f"head_{k}"] = combined(method, part)
        row["late_accuracy"] = sum(r["accuracy"] for r in late.values()) / HEADS
        row["late_loss"] = sum(r["loss"] for r in late.values()) / HEADS
        row["late"] = late
        rows[method] = row
    with torch.no_grad():
        attention_weights = combiner.attention_weights(evals).mean(0).tolist()
    return {
        "model": "gpt-mini: backbone embedding..block_1, 3 heads block_2..head",
        "steps": steps,
        "batch_per_head": batch,
        "seq": spec.seq,
        "eval_bytes": labels.numel(),
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "train_s": train_s,
        "fit_s": fit_s,
        "weights": weights,
        "attention_weights": attention_weights,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="sequences per head and step")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows per half")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine two ran a step 3-10x slower)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON object to this file")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = run(a.steps, a.batch, a.windows, a.seed)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    if a.json:
        print(json.dumps(res))
        return
    print(
        f"{res['model']}; {a.steps} steps of {a.batch} x {res['seq']} bytes per head "
        f"({res['train_s']:.0f} s); scored on {res['eval_bytes']:,} held-out bytes"
    )
    print(
        "calibration accuracies (weights): "
        + ", ".join(f"{w:.4f}" for w in res["weights"])
        + "; mean attention weights: "
        + ", ".join(f"{w:.3f}" for w in res["attention_weights"])
    )
    head = ("", "accuracy", "loss", "1 late: acc", "1 late: loss")
    print(f"{head[0]:14} {head[1]:>9} {head[2]:>7} {head[3]:>12} {head[4]:>13}")
    for name, r in res["rows"].items():
        late = f"{r['late_accuracy']:12.4f} {r['late_loss']:13.4f}" if "late_accuracy" in r else ""
        print(f"{name:14} {r['accuracy']:9.4f} {r['loss']:7.4f} {late}".rstrip())


if __name__ == "__main__":
    main()
