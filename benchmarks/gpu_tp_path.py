"""The runtime's tensor-parallel code path on one device, beside the same stage whole.

One GPU cannot hold two NCCL ranks, so ``dmsc up`` refuses tp > 1 on a one-GPU machine. What one
device allows is the path itself: a stage split by the runtime's own
:func:`dmsc.runtime.compute.tensor_parallel.parallelize_stage` over a process group of one rank
(NCCL on CUDA, gloo on the CPU), so its column- and row-parallel linears, its vocabulary-parallel
embedding, head and loss (:mod:`dmsc.runtime.compute.vocab_parallel`), sequence parallelism's
gathers and scatters and a mixture's tensor-parallel experts all run on the device, each of
their collectives a real call of the backend on the device's tensors
(:mod:`dmsc.runtime.compute.tp_ops`). For gpt-mini and llama-mini (each with and without
sequence parallelism) and moe-mini, ``--steps`` steps of AdamW from the same weights and
batches, the split stage beside the whole one: the largest difference of their losses and of
their gradients at the first step, each side's median step time and their ratio, and the
tensor-parallel calls a step made (the step meter's, :mod:`dmsc.runtime.compute.comm_meter`).
``benchmarks/gpu_check.py`` runs it as its ``tp`` check. Prints a table, or with ``--json`` one
object with the same figures.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.models.chain import StageModule, build_stage, loss_fn
from dmsc.runtime.compute.tensor_parallel import parallelize_stage
from dmsc.runtime.compute.vocab_parallel import stage_loss
from dmsc.spec import TransformerSpec, resolve_model

# (name, model, sequence parallel)
CASES = [
    ("gpt-mini", "gpt-mini", False),
    ("gpt-mini-sp", "gpt-mini", True),
    ("llama-mini", "llama-mini", False),
    ("llama-mini-sp", "llama-mini", True),
    ("moe-mini", "moe-mini", False),
]
BATCH = 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(
    module: StageModule,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    split: bool,
) -> tuple[float, list[torch.Tensor]]:
    logits = module(x)
    loss = stage_loss(module, logits, y) if split else loss_fn(logits, y)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.detach().clone() for p in module.parameters() if p.grad is not None]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item()), grads


def case(name: str, model: str, sequence: bool, device: torch.device, steps: int) -> dict[str, Any]:
    """One family's stage split over the one-rank group beside itself whole (module docstring)."""
    spec = resolve_model(model)
    assert isinstance(spec, TransformerSpec)
    first, last = "embedding", "head"
    whole = build_stage(spec, 0, first, last)
    split = parallelize_stage(spec, copy.deepcopy(whole), sequence=sequence)
    whole, split = whole.to(device), split.to(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (whole, split)]
    gen = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, spec.vocab, (BATCH, spec.seq), generator=gen).to(device),
            torch.randint(0, spec.vocab, (BATCH, spec.seq), generator=gen).to(device),
        )
        for _ in range(steps)
    ]
    losses: dict[str, list[float]] = {"whole": [], "split": []}
    times: dict[str, list[float]] = {"whole": [], "split": []}
    first_grads: dict[str, list[torch.Tensor]] = {}
    calls = []
    for i, (x, y) in enumerate(batches):
        for side, module, opt in (("whole", whole, opts[0]), ("split", split, opts[1])):
            METER.take()  # this step's calls only
            _sync(device)
            t0 = time.perf_counter()
            loss, grads = _step(module, opt, x, y, side == "split")
            _sync(device)
            times[side].append(time.perf_counter() - t0)
            losses[side].append(loss)
            if i == 0:
                first_grads[side] = grads
            if side == "split":
                calls.append(METER.take().get("tp", {}).get("calls", 0.0))
    grad_diff = max(
        float((a - b).abs().max())
        for a, b in zip(first_grads["whole"], first_grads["split"], strict=True)
    )
    warm = max(1, steps // 4)
    whole_s = statistics.median(times["whole"][warm:] or times["whole"])
    split_s = statistics.median(times["split"][warm:] or times["split"])
    return {
        "case": name,
        "model": model,
        "sequence_parallel": sequence,
        "steps": steps,
        "max_loss_diff": max(
            abs(a - b) for a, b in zip(losses["whole"], losses["split"], strict=True)
        ),
        "first_step_max_grad_diff": grad_diff,
        "losses_split": losses["split"],
        "whole_step_s": whole_s,
        "split_step_s": split_s,
        "split_over_whole": split_s / whole_s,
        "tp_calls_per_step": statistics.median(calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", help="comma-separated cases (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    names = [c[0] for c in CASES]
    only = set(args.only.split(",")) if args.only else set(names)
    if only - set(names):
        ap.error(f"--only: no case named {', '.join(sorted(only - set(names)))} ({names})")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_port()}",
        rank=0,
        world_size=1,
        timeout=dt.timedelta(seconds=60),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        rows = [case(n, m, s, device, args.steps) for n, m, s in CASES if n in only]
    finally:
        dist.destroy_process_group()
    out = {"device": str(device), "backend": backend, "world_size": 1, "cases": rows}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{backend} on {device}, one rank: the tensor-parallel path beside the stage whole")
    print(f"{'case':16s} {'loss diff':>10s} {'grad diff':>10s} {'whole ms':>9s} {'split ms':>9s} "
          f"{'ratio':>6s} {'tp calls':>9s}")  # fmt: skip
    for r in rows:
        print(
            f"{r['case']:16s} {r['max_loss_diff']:10.2e} {r['first_step_max_grad_diff']:10.2e} "
            f"{r['whole_step_s'] * 1e3:9.1f} {r['split_step_s'] * 1e3:9.1f} "
            f"{r['split_over_whole']:6.2f} {r['tp_calls_per_step']:9.0f}"
        )


if __name__ == "__main__":
    main()
