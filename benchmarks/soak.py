"""A soak: inference at 80% of the measured capacity for ten minutes, through the real stack.

``dmsc up --gateway`` with a gpt-mini pp=2 x dp=2 plan on this machine; four tenants with keys
from ``dmsc token create``. First the capacity: closed-loop clients (two per tenant) for
``--probe-s`` seconds give the requests per second the deployment answers. Then an open-loop
load at ``--load`` of it (Poisson arrivals, spread over the tenants) for ``--seconds``, while
the resident memory of every process of the deployment (control plane, workers) is sampled.

Prints a table, or with --json one object: capacity_per_s, offered_per_s, answered, errors by
status (429: refused by a tenant's in-flight limit, a burst of the Poisson arrivals), latency
p50/p99/max, and per process the RSS at start and end (MiB) and its growth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from _deployment import free_port, home_and_dmsc, two_by_two_plan

TENANTS = ("t0", "t1", "t2", "t3")
BODY = {"prompt": "def ", "tokens": 8}


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--probe-s", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=0.8, help="Share of the capacity offered.")
    args = parser.parse_args()
    home, dmsc = home_and_dmsc("dmsc-soak-")
    plan = two_by_two_plan(home, dmsc)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/infer"
    dmsc("up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}", "--rate", "1000")
    control = json.loads((home / "control.json").read_text())["pid"]
    pids = {"control plane": control} | {
        f"worker {n}": p for n, p in enumerate(sorted(_children(control)))
    }
    try:
        keys = {t: dmsc("token", "create", "--tenant", t, "--scopes", "infer") for t in TENANTS}
        heads = [{"Authorization": f"Bearer {k}"} for k in keys.values()]

        # capacity: closed loop, two clients per tenant
        done = []
        stop = time.monotonic() + args.probe_s

        def closed(h: dict[str, str]) -> None:
            with httpx.Client(timeout=60) as c:
                while time.monotonic() < stop:
                    if c.post(url, json=BODY, headers=h).status_code == 200:
                        done.append(1)

        with ThreadPoolExecutor(2 * len(heads)) as pool:
            list(pool.map(closed, heads * 2))
        capacity = len(done) / args.probe_s
        rate = args.load * capacity

        rss0 = {name: _rss_mib(p) for name, p in pids.items()}
        lat: list[float] = []
        codes: Counter[str] = Counter()
        lock = threading.Lock()
        clients = [httpx.Client(timeout=60) for _ in heads]

        def one(n: int) -> None:
            t0 = time.perf_counter()
            try:
                code = str(
                    clients[n % len(heads)]
                    .post(url, json=BODY, headers=heads[n % len(heads)])
                    .status_code
                )
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            with lock:
                codes[code] += 1
                if code == "200":
                    lat.append(time.perf_counter() - t0)

        rng = random.Random(0)
        end = time.monotonic() + args.seconds
        sent = 0
        rss_peak = dict(rss0)
        next_sample = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            at = time.monotonic()
            while at < end:
                at += rng.expovariate(rate)
                time.sleep(max(0.0, at - time.monotonic()))
                pool.submit(one, sent)
                sent += 1
                if time.monotonic() >= next_sample:
                    next_sample += 10
                    for name, p in pids.items():
                        v = _rss_mib(p)
                        if v is not None:
                            rss_peak[name] = max(rss_peak[name] or 0, v)
        rss1 = {name: _rss_mib(p) for name, p in pids.items()}
        for c in clients:
            c.close()
    finally:
        dmsc("down")
    out = {
        "capacity_per_s": capacity,
        "offered_per_s": sent / args.seconds,
        "seconds": args.seconds,
        "answered": codes.get("200", 0),
        "errors": {k: v for k, v in codes.items() if k != "200"},
        "p50_ms": float(np.percentile(lat, 50)) * 1e3 if lat else None,
        "p99_ms": float(np.percentile(lat, 99)) * 1e3 if lat else None,
        "max_ms": max(lat) * 1e3 if lat else None,
        "rss_mib": {
            name: {"start": rss0[name], "end": rss1[name], "peak": rss_peak[name]} for name in pids
        },
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"capacity {capacity:.1f} req/s ({BODY['tokens']} tokens); "
        f"offered {out['offered_per_s']:.1f} req/s for {args.seconds:g} s: "
        f"{out['answered']} answered, errors {out['errors']}"
    )
    print(
        f"latency p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms, "
        f"max {out['max_ms']:.0f} ms"
    )
    for name, r in out["rss_mib"].items():  # type: ignore[union-attr]
        print(f"{name:14s} RSS {r['start']:.0f} -> {r['end']:.0f} MiB (peak {r['peak']:.0f})")


if __name__ == "__main__":
    main()
