"""The cost of ``dmsc up --encrypt-checkpoints`` on the demo's checkpoint: gpt-mini in two
stages (as ``dmsc demo`` trains it), each stage's weights and AdamW state written with
:func:`~dmsc.runtime.compute.checkpoints.write_checkpoint` and read back with
:func:`~dmsc.runtime.compute.checkpoints.read_state`, plain and sealed (AES-256-GCM) alternated
``--repeats`` times in one process; the median of each, and the bytes written.

Prints a table, or with --json one object: plain and sealed save_s / load_s (both stages, one
after the other, as the workers of one replica do them in parallel), bytes, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dmsc.runtime.compute import sealing
from dmsc.runtime.compute.checkpoints import optimizer_path, read_state, write_checkpoint
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.spec import TransformerSpec, resolve_model

STAGES = [("embedding", "block_1"), ("block_2", "head")]


def _stages(spec: TransformerSpec) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = []
    for first, last in STAGES:
        module = build_stage(spec, 0, first, last)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        for p in module.parameters():  # AdamW's moments exist once it has stepped
            p.grad = torch.zeros_like(p)
        optimizer.step()
        out.append((module, optimizer))
    return out


def _once(folder: Path, spec: TransformerSpec, stages: list) -> tuple[float, float, int]:  # type: ignore[type-arg]
    t0 = time.perf_counter()
    paths = []
    for i, (module, optimizer) in enumerate(stages):
        path = folder / f"stage{i}.safetensors"
        write_checkpoint(path, spec, module, optimizer, steps=1)  # type: ignore[arg-type]
        paths.append(path)
    saved = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in paths:
        read_state(path)
    loaded = time.perf_counter() - t0
    size = sum(p.stat().st_size + optimizer_path(p).stat().st_size for p in paths)
    return saved, loaded, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    stages = _stages(spec)
    key = sealing.home_key(Path(tempfile.mkdtemp(prefix="dmsc-seal-bench-")))
    runs: dict[str, list[tuple[float, float, int]]] = {"plain": [], "sealed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats + 1):  # the first round warms the caches and is dropped
            for mode in ("plain", "sealed"):
                sealing.install(key if mode == "sealed" else None)
                got = _once(Path(tmp) / f"{mode}{r}", spec, stages)
                if r:
                    runs[mode].append(got)
    sealing.install(None)
    out: dict[str, object] = {"model": "gpt-mini", "stages": len(STAGES), "repeats": args.repeats}
    for mode, rs in runs.items():
        out[mode] = {
            "save_s": statistics.median(x[0] for x in rs),
            "load_s": statistics.median(x[1] for x in rs),
            "bytes": rs[0][2],
        }
    plain, sealed = out["plain"], out["sealed"]
    assert isinstance(plain, dict) and isinstance(sealed, dict)
    out["save_ratio"] = sealed["save_s"] / plain["save_s"]
    out["load_ratio"] = sealed["load_s"] / plain["load_s"]
    if args.json:
        print(json.dumps(out))
        return
    for mode in ("plain", "sealed"):
        m = out[mode]
        assert isinstance(m, dict)
        print(
            f"{mode:7s} save {m['save_s'] * 1e3:7.1f} ms  load {m['load_s'] * 1e3:7.1f} ms  "
            f"{m['bytes'] / 1e6:.1f} MB"
        )
    print(f"sealed / plain: save x{out['save_ratio']:.2f}, load x{out['load_ratio']:.2f}")


if __name__ == "__main__":
    main()
