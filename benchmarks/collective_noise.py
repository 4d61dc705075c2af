"""How steady this machine's gloo all-reduce is: the noise floor under the per-mode comparison.

``benchmarks/parallel_modes.py`` compares each mode's measured communication with the cost
model's prediction from ``dmsc calibrate``'s gloo all-reduce. Both sides rest on a small
all-reduce between two processes, and on a shared virtual machine that figure moves on its own.
This program measures by how much, with nothing of dmsc in the way: two spawned processes, one
torch thread each (as a worker runs), a gloo group over a TCPStore on 127.0.0.1.

- **Spells**: ``--seconds`` one-second windows of all-reduces of ``--bytes`` bytes, each right
  after a barrier (an idle group, as ``dmsc calibrate`` measures it): each window's median.
- **After compute**: the same all-reduce right after both processes computed for a while (a
  256 x 256 matrix product in a loop, both starting at a barrier), as a step's collective follows
  its layer's compute: the median of ``--rounds`` rounds for each burst length. The bursts run
  ``--passes`` times over, alternated, so that a spell of the machine shows as a difference
  between passes rather than between bursts.

Prints a table, or with --json one object: ``spells_us`` (each window's median), ``spell``
(least, median and largest window median, and how many windows took over twice the least),
``after_compute_us`` (burst ms -> each pass's median), ``after_compute_range_us`` (burst ms ->
the least and largest of those), ``bytes``, ``load_average`` (1, 5, 15 min,
at the end).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BURSTS_MS = (0.0, 1.0, 4.0, 16.0)


def _member(rank: int, port: int, args: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.zeros(args["bytes"] // 4)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(20):  # warm-up: the pair's connections, the allocator
        dist.all_reduce(x)
    spells = []
    for _ in range(args["seconds"]):
        times: list[float] = []
        end = time.monotonic() + 1.0
        while True:  # rank 0's clock ends the window, its flag the tensor's first element
            x[0] = float(rank == 0 and time.monotonic() >= end)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
            if x[0] > 0:
                break
        spells.append(statistics.median(times))
    after: dict[float, list[float]] = {ms: [] for ms in BURSTS_MS}
    for _ in range(args["passes"]):
        for ms in BURSTS_MS:
            times = []
            for _ in range(args["rounds"]):
                dist.barrier()
                until = time.perf_counter() + ms / 1e3
                while time.perf_counter() < until:
                    a @ b
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            after[ms].append(statistics.median(times))
    if rank == 0:
        out.put({"spells": spells, "after": after})
    dist.destroy_process_group()


def measure(seconds: int, nbytes: int, rounds: int, passes: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {"seconds": seconds, "bytes": nbytes, "rounds": rounds, "passes": passes}
    procs = [ctx.Process(target=_member, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = queue.get(timeout=seconds + 600)
    for p in procs:
        p.join(timeout=60)
    spells = [t * 1e6 for t in got["spells"]]
    least = min(spells)
    return {
        "bytes": nbytes,
        "spells_us": [round(t, 1) for t in spells],
        "spell": {
            "least_us": round(least, 1),
            "median_us": round(statistics.median(spells), 1),
            "largest_us": round(max(spells), 1),
            "windows": len(spells),
            "over_twice_least": sum(t > 2 * least for t in spells),
        },
        "after_compute_us": {
            f"{ms:g}": [round(t * 1e6, 1) for t in v] for ms, v in got["after"].items()
        },
        "after_compute_range_us": {
            f"{ms:g}": [round(min(v) * 1e6, 1), round(max(v) * 1e6, 1)]
            for ms, v in got["after"].items()
        },
        "load_average": list(os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=int, default=30, help="One-second idle windows.")
    parser.add_argument("--bytes", type=int, default=4096, help="Size of the all-reduced tensor.")
    parser.add_argument("--rounds", type=int, default=40, help="Rounds of each burst length.")
    parser.add_argument("--passes", type=int, default=3, help="Passes over the burst lengths.")
    args = parser.parse_args()
    res = measure(args.seconds, args.bytes, args.rounds, args.passes)
    if args.json:
        print(json.dumps(res))
        return
    s = res["spell"]
    print(f"gloo all-reduce of {res['bytes']} bytes, 2 processes, 1 thread each")
    print(
        f"idle, {s['windows']} one-second windows: median of each window "
        f"{s['least_us']:.0f}-{s['largest_us']:.0f} us (median {s['median_us']:.0f}), "
        f"{s['over_twice_least']} over twice the least"
    )
    print(f"{'after compute':>14} | " + " | ".join(f"pass {i + 1:>2}" for i in range(args.passes)))
    for ms, v in res["after_compute_us"].items():
        print(f"{ms + ' ms':>14} | " + " | ".join(f"{t:7.0f}" for t in v))
    print(f"load average {', '.join(f'{x:.2f}' for x in res['load_average'])}")


if __name__ == "__main__":
    main()
