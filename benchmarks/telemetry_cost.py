"""What a worker's hardware telemetry costs (:mod:`dmsc.runtime.compute.telemetry`).

Measured in this process, each reading repeated and its median kept:

- ``step``: what a training step pays, the reading at its start and the one at its end;
- ``health``: the snapshot a ``Health`` answer carries (process, node, GPUs);
- ``tick``: what the window thread does once a second (its CPU share is this per second);
- ``scrape``: the worker's Prometheus page, written as a scrape asks for it.

Then a real pipeline of gpt-mini (two stage workers, 8 sequences in 4 micro-batches, as the
tests train it) gives the median training step, against which the step's readings are set.

Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.telemetry import Telemetry
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import resolve_model


def _median_s(fn: Callable[[], object], n: int) -> float:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t)
    return statistics.median(took)


def readings(n: int) -> dict[str, float]:
    reg = CollectorRegistry()
    t = Telemetry(reg, window_s=0)
    return {
        "step_s": _median_s(lambda: t.step_end(t.step_start()), n),
        "health_s": _median_s(t.snapshot, n),
        "tick_s": _median_s(t.tick, n),
        "scrape_s": _median_s(lambda: generate_latest(reg), n),
    }


def train_step_s(steps: int) -> float:
    spec = resolve_model("gpt-mini")
    train, _ = stdlib_text(max_bytes=200_000)
    corpus = Corpus(train, spec.seq, seed=1)
    ranges = [("embedding", "block_1"), ("block_2", "head")]
    with (
        tempfile.TemporaryDirectory() as tmp,
        Deployment(StageLayout(spec, ranges), home=Path(tmp)) as dep,
    ):
        took = [dep.train_step(s, *corpus.batch(s, 8), 4)["step_s"] for s in range(steps)]
    return statistics.median(took[1:])  # the first step warms the workers up


def measure(n: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": n, **readings(n), "train_steps": steps}
    out["train_step_s"] = train_step_s(steps)
    out["step_share"] = out["step_s"] / out["train_step_s"]
    out["thread_cpu_share"] = out["tick_s"] / 1.0  # one tick a second
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000, help="Times each reading is taken.")
    ap.add_argument("--steps", type=int, default=6, help="Training steps of the pipeline.")
    ap.add_argument("--json", action="store_true", help="One JSON object instead of the table.")
    args = ap.parse_args()
    out = measure(max(1, args.repeats), max(2, args.steps))
    if args.json:
        print(json.dumps(out))
        return
    for key in ("step", "health", "tick", "scrape"):
        print(f"{key:<8} {out[f'{key}_s'] * 1e6:>9.1f} us (median)")
    print(f"training step (median) {out['train_step_s'] * 1e3:.1f} ms")
    print(f"a step's readings: {out['step_share']:.2%} of its step")
    print(f"the window thread: {out['thread_cpu_share']:.3%} of a core")


if __name__ == "__main__":
    main()
