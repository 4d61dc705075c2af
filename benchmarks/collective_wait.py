"""A gloo all-reduce waited for blocked against awake (:mod:`dmsc.runtime.compute.waiting`).

Two spawned processes, one torch thread each (as a worker runs), a gloo group over a TCPStore on
127.0.0.1, all-reduce a tensor of ``--bytes`` bytes right after a barrier and a pause of 0, 4 or
16 ms (an idle core, as when a rank waits for its peer's compute). Each is waited for the two
ways, alternated ``--passes`` times: ``blocked`` (``work.wait()``, how the runtime waited before
2026-12-04) and ``awake`` (``waiting.finish``: the core yielded in a loop while the work runs, at
most ``SPIN_S``, then blocked), each the median of ``--rounds`` rounds; with the processes free
to move between the cores and pinned one a core (as ``dmsc up`` pins workers where it can).

Prints a table, or with --json one object: ``us`` (placement -> pause ms -> way -> each pass's
median), ``speedup`` (placement -> pause -> blocked over awake, the median pass), ``bytes``,
``spin_s``, ``load_average``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmsc.runtime.compute.waiting import SPIN_S, finish

PAUSES_MS = (0, 4, 16)
WAYS = ("blocked", "awake")


def _rank(rank: int, port: int, pin: bool, nbytes: int, rounds: int, passes: int, out: Any) -> None:
    torch.set_num_threads(1)
    if pin:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(nbytes // 4)
    got: dict[str, dict[str, list[float]]] = {}
    try:
        for _ in range(3):
            dist.all_reduce(x)
        for _ in range(passes):
            for pause in PAUSES_MS:
                for way in WAYS:
                    took = []
                    for _ in range(rounds):
                        dist.barrier()
                        time.sleep(pause / 1e3)
                        t0 = time.perf_counter()
                        work = dist.all_reduce(x, async_op=True)
                        if way == "awake":
                            finish(work)
                        else:
                            work.wait()
                        took.append((time.perf_counter() - t0) * 1e6)
                    got.setdefault(str(pause), {}).setdefault(way, []).append(
                        round(statistics.median(took), 1)
                    )
        if rank == 0:
            out.put(got)
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def measure(nbytes: int, rounds: int, passes: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    us: dict[str, Any] = {}
    for placement, pin in (("free", False), ("pinned", True)):
        out = ctx.SimpleQueue()
        args = (_port(), pin, nbytes, rounds, passes, out)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        us[placement] = out.get()
    speedup = {
        placement: {
            pause: statistics.median(ways["blocked"]) / statistics.median(ways["awake"])
            for pause, ways in by_pause.items()
        }
        for placement, by_pause in us.items()
    }
    return {
        "bytes": nbytes,
        "spin_s": SPIN_S,
        "us": us,
        "speedup": speedup,
        "load_average": list(os.getloadavg()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    result = measure(a.bytes, a.rounds, a.passes)
    if a.json:
        print(json.dumps(result))
        return
    print(f"a {a.bytes}-byte gloo all-reduce of 2 processes, us (median of {a.rounds}) per pass")
    print(f"{'placement':<9} {'pause':>6}  {'blocked':<26} {'awake':<26} blocked/awake")
    for placement, by_pause in result["us"].items():
        for pause, ways in by_pause.items():
            cells = ["/".join(f"{v:.0f}" for v in ways[w]) for w in WAYS]
            ratio = result["speedup"][placement][pause]
            print(f"{placement:<9} {pause:>4}ms  {cells[0]:<26} {cells[1]:<26} {ratio:.1f}x")


if __name__ == "__main__":
    main()
