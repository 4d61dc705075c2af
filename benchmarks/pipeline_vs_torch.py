"""dmsc's pipeline against torch.distributed.pipelining on the same model, split and schedule.

gpt-mini in 3 stages ((embedding, block_0), (block_1, block_2), (block_3, head)), global batch
16 in 4 micro-batches, 1F1B, AdamW; torch runs one gloo process per stage (CPU), dmsc one
worker process per stage (its activations and gradients over a TCP stream to each neighbour,
as a deployment sends them by default; the calls around a step over gRPC). Median step time
over the measured steps (the first fifth left out), and CPU seconds per measured step of every
process of each side (torch: each rank's own; dmsc: the control plane and its workers), which a
shared machine's load disturbs far less than the wall clock. The two sides run alternated,
``--rounds`` pairs (default 3). Prints a table, or with --json one object: dmsc_step_s,
torch_step_s, ratio (dmsc / torch), dmsc_cpu_s_per_step, torch_cpu_s_per_step, cpu_ratio (each
the median over the pairs, the ratios each pair's), rounds (each pair's figures) and
load_average (1, 5, 15 min, at the end).
With ``--tls`` dmsc also runs with mutual TLS between the control plane and every worker (as
``dmsc up`` runs it: a CA in a temporary home, a leaf per worker), plain and TLS alternated over
``--rounds`` deployments each: dmsc_tls_step_s and tls_ratio (TLS over plain, the better round
of each). With ``--gloo`` dmsc also runs with its activations and gradients over gloo
point-to-point (``StageLayout.pp_gloo``: the stages share a datacenter,
:mod:`dmsc.runtime.compute.pipe_group`) against its frames as gRPC ``Push`` calls (as they all
went until 2026-12-04), alternated over ``--rounds`` deployments each: dmsc_gloo_step_s,
dmsc_gloo_cpu_s_per_step, gloo_ratio (gloo over gRPC, beside it each round's) and
gloo_torch_ratio, the median round of each, dmsc_step_s and its CPU the gRPC rounds' median,
and a frame's way to an idle stage over each (grpc_idle_frame_way_ms, the median over the
rounds).
``--stream`` does the same with the streams (``StageLayout.pp_stream``,
:mod:`dmsc.runtime.compute.pipe_stream`): dmsc_stream_step_s, stream_ratio and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _deployment import cpu_s

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.compute.models.chain import build_stage, loss_fn
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.spec import TransformerSpec, resolve_model

RANGES = [("embedding", "block_0"), ("block_1", "block_2"), ("block_3", "head")]
BATCH, MICRO = 16, 4


def _torch_rank(rank: int, world: int, port: int, steps: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    module = build_stage(spec, 0, *RANGES[rank])
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICRO, loss_fn=loss_fn)
    # fused, as dmsc's stages (dmsc.runtime.compute.outer_sync.make_optimizer)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
    train, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train, spec.seq, seed=0)
    times = []
    for step in range(steps):
        if step == steps // 5:
            cpu0 = time.process_time()
        x, y = corpus.batch(step, BATCH)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    queue.put((rank, times, time.process_time() - cpu0))
    dist.destroy_process_group()


def torch_step_s(steps: int) -> tuple[float, float]:
    """Median step time and CPU seconds per measured step (all ranks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_torch_rank, args=(r, 3, port, steps, queue)) for r in range(3)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    times = next(t for rank, t, _ in got if rank == 0)
    cpu = sum(c for _, _, c in got) / (steps - steps // 5)
    return statistics.median(times[steps // 5 :]), cpu


def dmsc_step_s(
    steps: int, mtls: bool = False, via: str | None = None, phases: list[Any] | None = None
) -> tuple[float, float]:
    """Median step time and CPU seconds per measured step (control plane and workers); the
    pipeline's frames ``via`` gRPC, gloo point-to-point or TCP streams (None: as a deployment
    sends them by default, over streams). Where the step's wall time went (:func:`_phases`) is
    appended to ``phases`` when given."""
    from dmsc.runtime.transport import tls

    if mtls:  # what the control plane does at dmsc up: every channel and server mutual TLS
        tls.install_authority(Path(tempfile.mkdtemp(prefix="dmsc-bench-ca-")))
    try:
        return _dmsc_steps(steps, via, phases)
    finally:
        tls.install(None)


def _dmsc_steps(
    steps: int, via: str | None = None, phases: list[Any] | None = None
) -> tuple[float, float]:
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    train, _ = stdlib_text(max_bytes=400_000)
    corpus = Corpus(train, spec.seq, seed=0)
    times, warm, seen = [], steps // 5, []
    layout = StageLayout(spec, RANGES)  # as deployed: the frames over streams
    if via is not None:
        layout = StageLayout(spec, RANGES, pp_gloo=via == "gloo", pp_stream=via == "stream")
    with Deployment(layout) as dep:
        for s in range(steps):
            if s == warm:
                cpu0 = cpu_s()
            called = time.time()
            out = dep.train_step(s, *corpus.batch(s, BATCH), MICRO, "1f1b")
            times.append(out["step_s"])
            if s >= warm:
                seen.append((called, time.time(), {k[0]: v[0] for k, v in out["traces"].items()}))
        cpu = (cpu_s() - cpu0) / (steps - warm)
    if phases is not None:
        phases.append(_phases(seen))
    return statistics.median(times[warm:]), cpu


def _phases(seen: list[tuple[float, float, dict[int, list[Any]]]]) -> dict[str, Any]:
    """Where the steps' wall time went, from each stage's spans (op, micro-batch, start, end;
    wall clock), medians in ms: from the call to each stage's first op, from the last op's end
    to the step's return (the last sends, the replies, ``Commit``), each stage's compute, and
    a frame's way (its sender's op ended, its receiver's op began) where the receiver was idle
    waiting for it."""
    start: dict[int, list[float]] = {}
    compute: dict[int, list[float]] = {}
    tail, hops = [], []
    for called, returned, spans in seen:
        tail.append(returned - max(sp[3] for ops in spans.values() for sp in ops))
        for st, ops in spans.items():
            start.setdefault(st, []).append(ops[0][2] - called)
            compute.setdefault(st, []).append(sum(sp[3] - sp[2] for sp in ops))
            for j, (op, mb, began, _) in enumerate(ops):
                src = st - 1 if op == "F" else st + 1
                if src not in spans:
                    continue
                sent = next(x[3] for x in spans[src] if x[0] == op and x[1] == mb)
                if j == 0 or ops[j - 1][3] < sent:  # idle: waiting for exactly this frame
                    hops.append(began - sent)

    def ms(xs: list[float]) -> float:
        return round(1e3 * statistics.median(xs), 2)

    return {
        "first_op_after_call_ms": {st: ms(v) for st, v in sorted(start.items())},
        "after_last_op_ms": ms(tail),
        "compute_ms": {st: ms(v) for st, v in sorted(compute.items())},
        "idle_frame_way_ms": ms(hops),
        "idle_frames": len(hops),
    }


def _compare(steps: int, rounds: int, as_json: bool) -> None:
    """torch and dmsc alternated over ``rounds`` pairs of runs, so that the machine's drift
    (on this shared 2-core VM the same run's step moved 15-25% from one minute to the next)
    hits both alike: each pair's ratio, and the medians."""
    pairs = []
    for _ in range(rounds):
        t_torch, cpu_torch = torch_step_s(steps)
        t_dmsc, cpu_dmsc = dmsc_step_s(steps)
        pair = {"torch_step_s": t_torch, "dmsc_step_s": t_dmsc, "ratio": t_dmsc / t_torch}
        pair.update({"torch_cpu_s_per_step": cpu_torch, "dmsc_cpu_s_per_step": cpu_dmsc})
        pairs.append({**pair, "cpu_ratio": cpu_dmsc / cpu_torch})
    out: dict[str, Any] = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
    out["rounds"] = pairs
    out["load_average"] = list(os.getloadavg())
    if as_json:
        print(json.dumps(out))
        return
    print(f"{'round':>5s} {'torch ms':>9s} {'dmsc ms':>9s} {'ratio':>6s} {'CPU ratio':>9s}")
    for i, p in enumerate(pairs):
        print(f"{i + 1:5d} {p['torch_step_s'] * 1e3:9.1f} {p['dmsc_step_s'] * 1e3:9.1f} "
              f"{p['ratio']:6.2f} {p['cpu_ratio']:9.2f}")  # fmt: skip
    print(f"torch.distributed.pipelining (gloo): {out['torch_step_s'] * 1e3:.1f} ms per step")
    print(f"dmsc (stage services):               {out['dmsc_step_s'] * 1e3:.1f} ms per step")
    print(f"ratio dmsc / torch, median of the pairs: {out['ratio']:.2f} (goal <= 1.0)")
    print(f"CPU per step: torch {out['torch_cpu_s_per_step'] * 1e3:.0f} ms, "
          f"dmsc {out['dmsc_cpu_s_per_step'] * 1e3:.0f} ms")  # fmt: skip
    print("load average: " + " ".join(f"{x:.2f}" for x in out["load_average"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    also = parser.add_mutually_exclusive_group()
    also.add_argument("--tls", action="store_true", help="Also dmsc with mutual TLS.")
    also.add_argument("--gloo", action="store_true", help="Also dmsc's sends over gloo.")
    also.add_argument("--stream", action="store_true", help="Also dmsc's sends over TCP streams.")
    parser.add_argument("--rounds", type=int, default=3, help="Pairs of runs, alternated.")
    args = parser.parse_args()
    if not args.gloo and not args.stream and not args.tls:
        _compare(args.steps, args.rounds, args.json)
        return
    t_torch, cpu_torch = torch_step_s(args.steps)
    via = "gloo" if args.gloo else "stream"
    if args.gloo or args.stream:
        rounds: dict[str, list[tuple[float, float]]] = {"grpc": [], via: []}
        phases: dict[str, list[Any]] = {"grpc": [], via: []}
        for _ in range(args.rounds):  # alternated, so drift hits both alike
            for v in ("grpc", via):
                rounds[v].append(dmsc_step_s(args.steps, via=v, phases=phases[v]))
        t_dmsc, cpu_dmsc = (statistics.median(x) for x in zip(*rounds["grpc"], strict=True))
        t_via, cpu_via = (statistics.median(x) for x in zip(*rounds[via], strict=True))
        by_round = [b[0] / a[0] for a, b in zip(rounds["grpc"], rounds[via], strict=True)]
        out: dict[str, Any] = {
            "dmsc_step_s": t_dmsc,
            "torch_step_s": t_torch,
            "ratio": t_dmsc / t_torch,
            f"dmsc_{via}_step_s": t_via,
            f"dmsc_{via}_cpu_s_per_step": cpu_via,
            f"{via}_ratio": t_via / t_dmsc,
            f"{via}_ratio_by_round": by_round,
            f"{via}_torch_ratio": t_via / t_torch,
            "grpc_rounds": rounds["grpc"],
            f"{via}_rounds": rounds[via],
            "grpc_phases": phases["grpc"],
            f"{via}_phases": phases[via],
            "rounds_each": args.rounds,
        }
        for v in ("grpc", via):  # a frame's way to an idle stage, the median over the rounds
            out[f"{v}_idle_frame_way_ms"] = statistics.median(
                p["idle_frame_way_ms"] for p in phases[v]
            )
    else:
        plain, sealed = [], []
        for _ in range(args.rounds):  # alternated, so drift hits both alike
            plain.append(dmsc_step_s(args.steps)[0])
            sealed.append(dmsc_step_s(args.steps, mtls=True)[0])
        t_dmsc, t_tls = min(plain), min(sealed)
        out = {
            "dmsc_step_s": t_dmsc,
            "torch_step_s": t_torch,
            "ratio": t_dmsc / t_torch,
            "dmsc_tls_step_s": t_tls,
            "tls_ratio": t_tls / t_dmsc,
            "plain_rounds_s": plain,
            "tls_rounds_s": sealed,
        }
    if not args.tls:
        out["dmsc_cpu_s_per_step"], out["torch_cpu_s_per_step"] = cpu_dmsc, cpu_torch
        out["cpu_ratio"] = cpu_dmsc / cpu_torch
    out["load_average"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(out))
        return
    print(f"torch.distributed.pipelining (gloo): {t_torch * 1e3:.1f} ms per step")
    name = "dmsc, frames over gRPC:" if args.gloo or args.stream else "dmsc (stage services):"
    print(f"{name:<37s}{t_dmsc * 1e3:.1f} ms per step")
    print(f"ratio dmsc / torch: {out['ratio']:.2f} (goal <= 1.0)")
    if not args.tls:
        print(f"CPU per step: torch {cpu_torch * 1e3:.0f} ms, dmsc {cpu_dmsc * 1e3:.0f} ms")
    if args.gloo or args.stream:
        print(f"dmsc with its sends over {via + ':':<11s}{t_via * 1e3:.1f} ms per step")
        rounds_text = ", ".join(f"{r:.3f}" for r in by_round)
        print(
            f"ratio {via} / gRPC: {out[f'{via}_ratio']:.3f} (by round {rounds_text}); CPU per "
            f"step {cpu_via * 1e3:.0f} ms; {via} / torch {out[f'{via}_torch_ratio']:.3f}"
        )
        print(f"a frame's way to an idle stage: gRPC {out['grpc_idle_frame_way_ms']:.2f} ms, "
              f"{via} {out[f'{via}_idle_frame_way_ms']:.2f} ms")  # fmt: skip
    print("load average: " + " ".join(f"{x:.2f}" for x in out["load_average"]))
    if args.tls:
        print(f"dmsc with mutual TLS:                {t_tls * 1e3:.1f} ms per step")
        print(f"ratio TLS / plain: {out['tls_ratio']:.3f} (goal < 1.05)")


if __name__ == "__main__":
    main()
