"""Data parallelism in dmsc: the leader's star against the ring all-reduce, and against DDP.

gpt-mini as one stage, global batch 8 (each replica its share, one micro-batch), AdamW, worker
processes on 127.0.0.1 with one thread each. For dp 1, 2 and 4, in one run, the same steps with
the replicas averaging through the stage leader over gRPC (``dp_star``) and by the bucketed
gloo all-reduce (the default): the median step time, and the bytes on the busiest link, the most
one worker sent and received in a step (its traffic as the step's trace counts it: the star's
leader carries 2 (n - 1) gradients, a ring member 4 (n - 1) / n of one). Then PyTorch's own
``DistributedDataParallel`` (gloo, 2 spawned processes, the same model, batch and optimizer) and
dmsc's dp = 2 over the ring against it as a ratio of median step times. Prints a table, or with
--json one object (``--out`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.models.chain import build_stage, loss_fn
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import TransformerSpec, resolve_model

WHOLE = [("embedding", "head")]
BATCH = 8


class StarDeployment(Deployment):
    """A deployment whose replicas average through the stage leader, as before the ring."""

    def config(self, stage: int, replica: int, tp_rank: int = 0) -> WorkerConfig:
        return replace(super().config(stage, replica, tp_rank), dp_star=True)


def _spec() -> TransformerSpec:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    return spec


def _corpus(spec: TransformerSpec) -> Corpus:
    train, _ = stdlib_text(max_bytes=400_000)
    return Corpus(train, spec.seq, seed=0)


def busiest_link(sent: dict[tuple[int, int], dict[str, int]]) -> int:
    """The most bytes one worker sent and received in a step, from the step's traces (each
    worker's bytes pushed, by peer ``"stage/replica"``)."""
    load: dict[str, int] = {}
    for (stage, replica), peers in sent.items():
        me = f"{stage}/{replica}"
        for peer, nbytes in peers.items():
            load[me] = load.get(me, 0) + nbytes
            load[peer] = load.get(peer, 0) + nbytes
    return max(load.values(), default=0)


def dmsc_run(dp: int, star: bool, steps: int) -> dict[str, Any]:
    spec = _spec()
    corpus = _corpus(spec)
    kind = StarDeployment if star else Deployment
    times, links, losses = [], [], []
    with kind(StageLayout(spec, WHOLE, replicas=dp)) as dep:
        for s in range(steps):
            out = dep.train_step(s, *corpus.batch(s, BATCH), 1, "1f1b")
            times.append(out["step_s"])
            links.append(busiest_link({k: v[1] for k, v in out["traces"].items()}))
            losses.append(out["loss"])
    return {
        "step_s": statistics.median(times[steps // 4 :]),
        "busiest_link_bytes": max(links),
        "busiest_link_mb": max(links) / 1e6,
        "last_loss": losses[-1],
    }


def _ddp_rank(rank: int, world: int, port: int, steps: int, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = _spec()
    model = torch.nn.parallel.DistributedDataParallel(build_stage(spec, 0, *WHOLE[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = _corpus(spec)
    times = []
    for step in range(steps):
        x, y = corpus.batch(step, BATCH)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        dist.barrier()
        t0 = time.perf_counter()
        logits: torch.Tensor = model(x)
        loss_fn(logits, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def ddp_step_s(world: int, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (world, port, steps, queue)
    procs = [ctx.Process(target=_ddp_rank, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    times: list[float] = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return statistics.median(times[steps // 4 :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dp", default="1,2,4", help="comma-separated degrees")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON object to this file")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows: dict[str, Any] = {}
    for dp in (int(d) for d in args.dp.split(",")):
        for star in (True, False) if dp > 1 else (False,):
            name = f"dp{dp}-" + ("star" if star else "ring") if dp > 1 else "dp1"
            rows[name] = dmsc_run(dp, star, args.steps)
    ddp = ddp_step_s(2, args.steps)
    out: dict[str, Any] = {
        "command": "python benchmarks/parallel_modes.py --json",
        "model": "gpt-mini",
        "global_batch": BATCH,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_1min": [load_before, os.getloadavg()[0]],  # before, after
        },
        "runs": rows,
        "ddp_dp2_step_s": ddp,
    }
    if "dp2-ring" in rows:
        out["dmsc_dp2_over_ddp"] = rows["dp2-ring"]["step_s"] / ddp
    for dp in (2, 4):
        star, ring = rows.get(f"dp{dp}-star"), rows.get(f"dp{dp}-ring")
        if star and ring:
            out[f"dp{dp}_star_over_ring"] = {
                "step_s": star["step_s"] / ring["step_s"],
                "busiest_link": star["busiest_link_bytes"] / ring["busiest_link_bytes"],
            }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'run':<10} {'step ms':>9} {'busiest link MB':>16}")
    for name, r in rows.items():
        print(f"{name:<10} {r['step_s'] * 1e3:>9.1f} {r['busiest_link_bytes'] / 1e6:>16.2f}")
    print(f"DDP dp2    {ddp * 1e3:>9.1f}")
    if "dmsc_dp2_over_ddp" in out:
        print(f"dmsc dp2 (ring) / DDP: {out['dmsc_dp2_over_ddp']:.2f} (goal <= 1.1)")


if __name__ == "__main__":
    main()
