"""Tensor parallelism on the CPU with gloo: dmsc's column/row-parallel linears
(:mod:`dmsc.runtime.compute.tensor_parallel`) against PyTorch's own
``torch.distributed.tensor.parallel`` (``ColwiseParallel``/``RowwiseParallel`` on a
``DeviceMesh``), split the same way, in the same two processes, steps taken in turn.

A step is the forward and backward of a whole GPT model (embedding, its blocks split over the two
ranks, head, loss) on a batch of 8 x 128 tokens; one thread per rank. Two sizes: gpt-mini (4
blocks, hidden 128) and the same with hidden 512 and 8 heads. Also checks that the two give the
same loss (the DTensor model's fused q, k, v rows are reordered so that its column shards hold
each rank's heads, as dmsc's do). Prints a table, or with --json one object per size:
median step seconds of each, their ratio and the largest loss difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmsc.runtime.compute.models import gpt
from dmsc.runtime.compute.models.chain import StageModule, build_stage, loss_fn
from dmsc.runtime.compute.tensor_parallel import parallelize_stage, shard
from dmsc.spec import TransformerSpec, resolve_model

SIZES = {"gpt-mini": {}, "gpt-mini hidden 512": {"hidden": 512, "heads": 8}}
BATCH, TOKENS = 8, 128


def _spec(update: dict[str, int]) -> TransformerSpec:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    return spec.model_copy(update=update)


def _dtensor(spec: TransformerSpec, module: StageModule) -> StageModule:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    plan = {"qkv": ColwiseParallel(), "fc1": ColwiseParallel()}
    plan |= {"proj": RowwiseParallel(), "fc2": RowwiseParallel()}
    for layer in module.layers:
        if isinstance(layer, gpt.Block):
            with torch.no_grad():  # rank r's rows of q, k, v next to one another
                for p in (layer.qkv.weight, layer.qkv.bias):
                    p.copy_(torch.cat([shard(p, "qkv", r, tp) for r in range(tp)]))
            parallelize_module(layer, mesh, plan)  # type: ignore[arg-type]
    return module


def _step(module: StageModule, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = loss_fn(module(x), y)
    loss.backward()
    took = time.perf_counter() - t0
    module.zero_grad(set_to_none=True)
    return took, float(loss.detach())


def _rank(rank: int, port: int, steps: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    out = {}
    for label, update in SIZES.items():
        spec = _spec(update)
        # the blocks only, as the DTensor plan splits them: the ends whole on both sides
        hand = parallelize_stage(spec, build_stage(spec, 0, "embedding", "head"), vocab=False)
        dtensor = _dtensor(spec, build_stage(spec, 0, "embedding", "head"))
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, spec.vocab, (BATCH, TOKENS + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        times: dict[str, list[float]] = {"hand": [], "dtensor": []}
        gap = 0.0
        for i in range(steps + 3):  # in turn, so that both see the same machine
            (t_hand, l_hand), (t_dt, l_dt) = _step(hand, x, y), _step(dtensor, x, y)
            gap = max(gap, abs(l_hand - l_dt))
            if i >= 3:
                times["hand"].append(t_hand)
                times["dtensor"].append(t_dt)
        hand_s, dt_s = statistics.median(times["hand"]), statistics.median(times["dtensor"])
        out[label] = {
            "hand_step_s": hand_s,
            "dtensor_step_s": dt_s,
            "dtensor_over_hand": dt_s / hand_s,
            "loss_gap": gap,
        }
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_rank, args=(store.port, args.steps, queue), nprocs=2, join=True)
    result = queue.get()
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'model':<22}{'dmsc (hand)':>14}{'DTensor':>14}{'ratio':>8}{'loss gap':>11}")
    for label, r in result.items():
        print(
            f"{label:<22}{r['hand_step_s'] * 1e3:>11.1f} ms{r['dtensor_step_s'] * 1e3:>11.1f} ms"
            f"{r['dtensor_over_hand']:>8.2f}{r['loss_gap']:>11.1e}"
        )


if __name__ == "__main__":
    main()
