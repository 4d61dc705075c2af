"""SimPy against the simulator's heap loop on the workload's own pattern.

Jobs arrive (Poisson), run until they complete, and at every event the completion time of a few
running jobs moves (their lightpaths were re-provisioned). The heap loop pushes a new versioned
completion event and skips stale ones; SimPy, whose timeouts cannot be moved, interrupts the job's
process so that it waits again. Both process the same events with the same seed; the table gives
wall time and events per second. Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

import numpy as np
import simpy


def _workload(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0, size=n))
    durations = rng.exponential(20.0, size=n)
    moves = rng.uniform(0.8, 1.2, size=(n, 3))  # factors applied to 3 jobs' remaining time
    return arrivals, durations, moves


def run_heap(n: int, seed: int) -> tuple[float, int]:
    arrivals, durations, moves = _workload(n, seed)
    heap: list[tuple[float, int, int, int]] = [(float(t), i, 0, i) for i, t in enumerate(arrivals)]
    heapq.heapify(heap)
    seq = n
    end: dict[int, float] = {}
    version: dict[int, int] = {}
    events = 0
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if kind == 1:
            jid, ver = divmod(payload, 1_000_000)
            if version.get(jid) != ver:
                continue
            del end[jid], version[jid]
        else:
            jid = payload
            end[jid] = now + float(durations[jid])
            version[jid] = 0
            heapq.heappush(heap, (end[jid], seq, 1, jid * 1_000_000))
            seq += 1
        events += 1
        running = list(end)
        for k, other in enumerate(running[:3]):
            end[other] = now + (end[other] - now) * float(moves[events % n, k])
            version[other] += 1
            heapq.heappush(heap, (end[other], seq, 1, other * 1_000_000 + version[other]))
            seq += 1
    return 0.0, events


def run_simpy(n: int, seed: int) -> tuple[float, int]:
    arrivals, durations, moves = _workload(n, seed)
    env = simpy.Environment()
    end: dict[int, float] = {}
    procs: dict[int, simpy.Process] = {}
    count = [0]

    def on_event() -> None:
        count[0] += 1
        for k, other in enumerate(list(end)[:3]):
            end[other] = env.now + (end[other] - env.now) * float(moves[count[0] % n, k])
            procs[other].interrupt()

    def job(jid: int):  # type: ignore[no-untyped-def]
        end[jid] = env.now + float(durations[jid])
        while True:
            try:
                yield env.timeout(max(0.0, end[jid] - env.now))
                break
            except simpy.Interrupt:
                continue
        del end[jid], procs[jid]
        on_event()

    def source():  # type: ignore[no-untyped-def]
        last = 0.0
        for i, t in enumerate(arrivals):
            yield env.timeout(float(t) - last)
            last = float(t)
            procs[i] = env.process(job(i))
            on_event()

    env.process(source())
    env.run()
    return 0.0, count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--jobs", type=int, default=20_000)
    args = parser.parse_args()
    rows = {}
    for name, fn in (("heap", run_heap), ("simpy", run_simpy)):
        t0 = time.perf_counter()
        _, events = fn(args.jobs, 7)
        wall = time.perf_counter() - t0
        rows[name] = {"events": events, "wall_s": wall, "events_per_s": events / wall}
    rows["simpy_over_heap_wall"] = rows["simpy"]["wall_s"] / rows["heap"]["wall_s"]  # type: ignore[assignment]
    if args.json:
        print(json.dumps(rows))
        return
    for name in ("heap", "simpy"):
        r = rows[name]
        print(
            f"{name:6s} {r['events']:>8d} events in {r['wall_s']:.2f} s: "  # type: ignore[index]
            f"{r['events_per_s']:>9.0f} events/s"
        )  # type: ignore[index]
    print(f"SimPy takes {rows['simpy_over_heap_wall']:.2f}x the heap loop's time")


if __name__ == "__main__":
    main()
