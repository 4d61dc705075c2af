"""Autoscaling under a stepped inference load, against a fixed deployment of the same maximum.

gpt-mini in two stages on a one-box cluster of four CPU devices (``_deployment.ONE_BOX``):

- **autoscaled**: planned with dp=1 (two devices), ``dmsc up --autoscale infer:min=1,max=2,...``:
  one serving pipeline more fits on the two free devices;
- **fixed**: planned with dp=2, both pipelines up from the start.

- **autoscaled+forecast** (with ``--lookahead S``): the same, its rule also scaling out when the
  request rate its Holt forecast expects ``S`` seconds ahead needs more pipelines than run
  (``lookahead=S``), so a ramp is met before the queue builds.

Each is started with ``dmsc up --gateway`` and loaded through the gateway (``POST /v1/infer``,
closed-loop clients, ``--tokens`` bytes each, sampled) in steps of clients and seconds
(``--steps 1x20,6x40,1x40`` by default; a ramp such as ``1x20,2x8,3x8,4x8,5x8,6x20,1x20`` is
where a forecast can lead); the replicas in routing are read from ``/v1/health`` every half
second. The time over the SLO (``--slo-s``) is the seconds in which the slowest request that
ended in that second took longer than the SLO. Prints a table per deployment and load step
(requests answered, errors, p50 and p99 latency, mean replicas) and a line per deployment (p99
over the whole load, time over the SLO, its first scale-out), or with --json one object:
``runs`` -> name -> ``phases`` (the same figures), ``p99_s``, ``over_slo_s``,
``first_scale_out_s`` and ``timeline`` ([seconds, replicas]), and the settings. On a 2-core
machine four stage workers share two cores: the second pipeline can only use what the first
leaves idle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _deployment import ONE_BOX, closed_loop, free_port, home_and_dmsc


def _plan(home: Path, dmsc: Any, dp: int) -> Path:
    cluster = home / "one-box.yaml"
    cluster.write_text(ONE_BOX)
    plan = home / "plan.json"
    dmsc(
        *("plan", "--cluster", str(cluster), "--model", "gpt-mini", "--global-batch", "8"),
        *("--micro-batch", "2", "--tp", "1", "--pp", "2", "--dp", str(dp), "--out", str(plan)),
    )
    return plan


def _load(base: str, key: str, steps: list[tuple[int, float]], tokens: int) -> dict[str, Any]:
    """Run the load steps; per step the requests' latencies and errors, and the timeline."""
    t0 = time.monotonic()
    timeline: list[tuple[float, int]] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=5) as c:
            while not done.is_set():
                try:
                    n = c.get(f"{base}/v1/health").json()["replicas"]
                    timeline.append((round(time.monotonic() - t0, 2), int(n)))
                except httpx.HTTPError:
                    pass
                done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    phases = []
    ended: list[tuple[float, float]] = []  # (seconds since the start, latency) of each answer
    body = {"prompt": "def ", "tokens": tokens, "temperature": 0.8}
    headers = {"Authorization": f"Bearer {key}"}
    for clients, seconds in steps:
        start = time.monotonic() - t0
        got = closed_loop(f"{base}/v1/infer", body, headers, clients, seconds)
        lat, errors, ends = got.latency, got.errors, got.ended
        ended += [(e - t0, a) for e, a in zip(ends, lat, strict=True)]
        end = time.monotonic() - t0
        seen = [n for s, n in timeline if start <= s <= end] or [0]
        phases.append(
            {
                "clients": clients,
                "seconds": seconds,
                "answered": len(lat),
                "errors": len(errors),
                "p50_s": float(np.percentile(lat, 50)) if lat else None,
                "p99_s": float(np.percentile(lat, 99)) if lat else None,
                "mean_replicas": float(np.mean(seen)),
                "max_replicas": int(max(seen)),
            }
        )
    done.set()
    watcher.join()
    lats = [a for _, a in ended]
    start_n = timeline[0][1] if timeline else 0
    out = [s for s, n in timeline if n > start_n]
    return {
        "phases": phases,
        "timeline": timeline,
        "p99_s": float(np.percentile(lats, 99)) if lats else None,
        "worst_per_second": _worst_per_second(ended),
        "first_scale_out_s": out[0] if out else None,
    }


def _worst_per_second(ended: list[tuple[float, float]]) -> dict[int, float]:
    """The longest latency of the answers that ended in each whole second of the load."""
    worst: dict[int, float] = {}
    for at, latency in ended:
        worst[int(at)] = max(worst.get(int(at), 0.0), latency)
    return worst


def over_slo_s(worst: dict[int, float], slo_s: float) -> int:
    """The seconds in which the slowest answer took longer than ``slo_s``."""
    return sum(1 for latency in worst.values() if latency > slo_s)


def run(
    name: str, dp: int, autoscale: str | None, steps: list[tuple[int, float]], tokens: int
) -> dict[str, Any]:
    home, dmsc = home_and_dmsc(f"dmsc-autoscale-{name}-")
    plan = _plan(home, dmsc, dp)
    port = free_port()
    extra = ["--autoscale", autoscale, "--cluster", str(home / "one-box.yaml")] if autoscale else []
    dmsc(
        "up",
        "--plan",
        str(plan),
        "--gateway",
        f"127.0.0.1:{port}",
        "--tenant-requests",
        "64",
        *extra,
    )
    try:
        out = dmsc(
            "token",
            "create",
            "--tenant",
            "bench",
            "--scopes",
            "infer,read",
            "--rate",
            "1000",
            "--burst",
            "1000",
        )
        key = re.findall(r"dmsc_[A-Za-z0-9_-]+", out)[-1]
        result = _load(f"http://127.0.0.1:{port}", key, steps, tokens)
    finally:
        dmsc("down")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="1x20,6x40,1x40", help="CLIENTSxSECONDS,...")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--autoscale", default="infer:min=1,max=2,target=2,cooldown=5,window=5")
    ap.add_argument(
        "--lookahead", type=float, default=0.0, help="Also run with lookahead=S (0: not)."
    )
    ap.add_argument("--slo-s", type=float, default=1.0, help="Latency SLO for time over it.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    steps = [(int(c), float(s)) for c, s in (p.split("x") for p in args.steps.split(","))]
    runs = {"autoscaled": run("autoscaled", 1, args.autoscale, steps, args.tokens)}
    if args.lookahead > 0:
        ahead = f"{args.autoscale},lookahead={args.lookahead:g}"
        runs["autoscaled+forecast"] = run("forecast", 1, ahead, steps, args.tokens)
    runs["fixed-max"] = run("fixed", 2, None, steps, args.tokens)
    for r in runs.values():
        r["over_slo_s"] = over_slo_s(r.pop("worst_per_second"), args.slo_s)
    doc = {
        "steps": args.steps,
        "tokens": args.tokens,
        "autoscale": args.autoscale,
        "lookahead_s": args.lookahead,
        "slo_s": args.slo_s,
        "load_after": list(os.getloadavg()),  # a shared machine: how busy it was
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))
        return
    head = ("deployment", "clients", "s", "answered", "errors", "p50 s", "p99 s", "replicas")
    print(f"{head[0]:<12} " + " ".join(f"{h:>8}" for h in head[1:]))
    for name, r in runs.items():
        for p in r["phases"]:
            p50 = f"{p['p50_s']:.2f}" if p["p50_s"] is not None else "-"
            p99 = f"{p['p99_s']:.2f}" if p["p99_s"] is not None else "-"
            print(
                f"{name:<12} {p['clients']:>8} {p['seconds']:>8.0f} {p['answered']:>8} "
                f"{p['errors']:>8} {p50:>8} {p99:>8} {p['mean_replicas']:>8.2f}"
            )
    for name, r in runs.items():
        p99 = f"{r['p99_s']:.2f} s" if r["p99_s"] is not None else "-"
        first = r["first_scale_out_s"]
        out = f"first scale-out at {first:.1f} s" if first is not None else "no scale-out"
        print(f"{name}: p99 {p99}, {r['over_slo_s']} s over the {args.slo_s:g} s SLO, {out}")


if __name__ == "__main__":
    main()
