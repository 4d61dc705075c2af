"""Every sync mode at tp = 2 against the same mode at tp = 1: gpt-mini, one stage, three replicas.

A tp = 2 replica computes the gradients of a tp = 1 one up to float error, and each of its ranks
runs the mode on its shard with the same rank of the other replicas
(:mod:`dmsc.runtime.compute.tp_sync`), so a mode computed coordinate by coordinate, or over the
whole update through the ranks (Krum's distances, the clipping norm, the noise), gives the tp = 1
losses; a codec whose blocks, k or factors are the shard's (``int8``, ``topk``, ``powersgd``)
gives its own approximation. Each mode trains the same steps on the same batches from the same
weights at both tp.

Prints a table, or with --json one object: ``modes``: per mode the losses at each tp and
``max_abs_diff``, the largest difference between them over the steps.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.training.session import train
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")
WHOLE = [("embedding", "head")]
REPLICAS, BATCH, MICRO = 3, 12, 2

MODES: dict[str, SyncSettings] = {
    "diloco-2": SyncSettings(mode="diloco", inner_steps=2),
    "fedprox-2-bf16": SyncSettings(mode="fedprox", inner_steps=2, compress="bf16"),
    "fedavg-2-krum": SyncSettings(mode="fedavg", inner_steps=2, aggregator="krum:0"),
    "diloco-2-multi-krum": SyncSettings(mode="diloco", inner_steps=2, aggregator="multi-krum:0"),
    "bf16-median": SyncSettings(compress="bf16", aggregator="median"),
    "trimmed-mean": SyncSettings(aggregator="trimmed-mean:0.34"),
    "fedavg-2-dp": SyncSettings(mode="fedavg", inner_steps=2, privacy_clip=0.5, privacy_noise=0.01),
    "fedavg-2-secure-clip": SyncSettings(
        mode="fedavg", inner_steps=2, secure=True, privacy_clip=0.5
    ),
    "int8": SyncSettings(compress="int8"),
    "topk-0.05": SyncSettings(compress="topk:0.05"),
    "powersgd-2": SyncSettings(compress="powersgd:2"),
}


def run(steps: int, modes: list[str]) -> dict[str, Any]:
    text, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(text, SPEC.seq, seed=1)
    losses: dict[str, dict[int, list[float]]] = {m: {} for m in modes}
    for tp in (1, 2):
        with Deployment(StageLayout(SPEC, WHOLE, replicas=REPLICAS, tp=tp)) as dep:
            start = dep.checkpoint(0, dep.home / "start")
            for m in modes:
                dep.restore(start)
                report = train(
                    dep, corpus, corpus, steps, BATCH, MICRO, validate=False, sync=MODES[m]
                )
                losses[m][tp] = report.losses
    out = {}
    for m in modes:
        a, b = losses[m][1], losses[m][2]
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        out[m] = {"tp1": a, "tp2": b, "max_abs_diff": diff}
    return {"model": "gpt-mini", "replicas": REPLICAS, "steps": steps, "modes": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES)
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown} (known: {', '.join(MODES)})")
    result = run(args.steps, modes)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'mode':<22} {'tp1 last':>10} {'tp2 last':>10} {'max |diff|':>11}")
    for m, r in result["modes"].items():
        print(f"{m:<22} {r['tp1'][-1]:>10.5f} {r['tp2'][-1]:>10.5f} {r['max_abs_diff']:>11.2e}")


if __name__ == "__main__":
    main()
