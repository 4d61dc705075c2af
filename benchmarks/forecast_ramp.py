"""A stepped inference ramp served with and without the autoscaler's forecast, side by side.

Simulated, not deployed: the real rule (:class:`dmsc.runtime.control.serving.autoscale.ScalePolicy`,
the same object ``dmsc up --autoscale`` runs) drives a queueing model of the serving pipelines,
sampled every half second as ``autoscale_loop`` samples the control plane. A real ramp of
minutes, at several seeds, with pipelines that take seconds to start, does not fit on a 2-core
machine shared with other work; the model keeps what the rule sees and what it costs:

- requests arrive as a Poisson process whose rate steps up (``--steps RATExSECONDS,...``);
- a request needs ``--service-s`` of a pipeline alone (times a log-normal factor of sigma 0.2);
  a pipeline is a processor-sharing queue (its requests take turns a token at a time, so n of
  them each go at 1/n of its speed); the router sends a request to the pipeline with the fewest
  in flight (as the control plane counts them);
- a pipeline the rule adds joins after ``--start-s`` (the loop waits for it, as the real one
  does: ``ServingPool.scale_out`` returns once the pipeline is up); one the rule removes leaves
  routing at once and answers what it holds (drained).

The defaults come from ``benchmarks/results/autoscale.json`` (``docs/serving.md``): gpt-mini in
two stages on the CPU box answers a 24-byte request in 0.27 s (p50 at one client), and the
second pipeline joined routing 12 s after the load stepped up. Both deployments run the same
arrivals and service times (one seed each); ``reactive`` is ``--autoscale`` without
``lookahead``, ``forecast`` with ``lookahead`` = ``--start-s``.

Prints, per deployment, p50, p99 and the largest latency, the seconds over the SLO (each 5-s
window, by arrival, whose p99 is above ``--slo-s``), the mean pipelines, and when each was added
and why; ``--json``: one object with the settings and ``runs`` -> name -> seed -> figures.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dmsc.runtime.control.serving.autoscale import ScalePolicy, parse_autoscale

TICK_S = 0.5  # autoscale_loop's interval
SLO_WINDOW_S = 5.0


def arrivals(steps: list[tuple[float, float]], rng: np.random.Generator) -> list[float]:
    """Poisson arrivals, rate piecewise constant (memoryless: each step drawn on its own)."""
    out: list[float] = []
    t0 = 0.0
    for rate, seconds in steps:
        t = t0
        while rate > 0:
            t += rng.exponential(1 / rate)
            if t >= t0 + seconds:
                break
            out.append(t)
        t0 += seconds
    return out


class Pipeline:
    """One serving pipeline as a processor-sharing queue: its requests take turns (a token
    each, :class:`~dmsc.runtime.control.serving.turns.FairLock`), so n of them each advance at
    1/n of its speed."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.jobs: dict[int, float] = {}  # request -> service seconds left

    def advance(self, until: float, done: dict[int, float]) -> None:
        """Serve up to ``until``; finished requests go into ``done`` with their end time."""
        while self.jobs and self.now < until:
            n = len(self.jobs)
            least = min(self.jobs.values())
            if self.now + least * n <= until:
                self.now += least * n
                for k in list(self.jobs):
                    self.jobs[k] -= least
                    if self.jobs[k] <= 1e-12:
                        del self.jobs[k]
                        done[k] = self.now
            else:
                for k in self.jobs:
                    self.jobs[k] -= (until - self.now) / n
                self.now = until
        self.now = max(self.now, until)


def simulate(
    settings_text: str,
    times: list[float],
    service: list[float],
    start_s: float,
    end_s: float,
) -> dict[str, Any]:
    """Serve ``times`` (service ``service[i]`` each) with pipelines the rule sizes."""
    settings = parse_autoscale(settings_text)
    policy = ScalePolicy(settings)
    pipes = [Pipeline(0.0) for _ in range(settings.min)]
    routed = list(range(settings.min))  # the pipelines in routing
    done: dict[int, float] = {}
    changes: list[dict[str, Any]] = []
    timeline: list[tuple[float, int]] = []
    starting: float | None = None  # when the pipeline being started joins
    i, tick = 0, TICK_S

    def at(now: float) -> None:
        for pipe in pipes:
            pipe.advance(now, done)

    while tick <= end_s or any(p.jobs for p in pipes):
        while i < len(times) and times[i] <= tick:
            at(times[i])
            p = min(routed, key=lambda r: (len(pipes[r].jobs), r))
            pipes[p].jobs[i] = service[i]
            i += 1
        at(tick)
        if tick > end_s:  # the ramp is over: the requests left are answered
            tick = round(tick + TICK_S, 6)
            continue
        if starting is not None and tick >= starting:  # the new pipeline is up
            pipes.append(Pipeline(tick))
            routed.append(len(pipes) - 1)
            policy.changed(tick, ready_s=start_s)
            starting = None
        elif starting is None:
            load = sum(len(p.jobs) for p in pipes)
            current = len(routed)
            wanted = policy.observe(tick, load, current, i)
            if wanted > current:
                starting = tick + start_s
                changes.append({"t": tick, "action": "out", "reason": policy.why})
            elif wanted < current:
                routed.pop()  # leaves routing; answers what it holds
                policy.changed(tick)
                changes.append({"t": tick, "action": "in", "reason": policy.why})
        timeline.append((tick, len(routed)))
        tick = round(tick + TICK_S, 6)
    latency = [(times[k], done[k] - times[k]) for k in sorted(done)]
    return {"latency": latency, "changes": changes, "timeline": timeline}


def figures(sim: dict[str, Any], slo_s: float, end_s: float) -> dict[str, Any]:
    lat = np.array([s for _, s in sim["latency"]])
    over = 0.0
    for w in range(math.ceil(end_s / SLO_WINDOW_S)):
        inside = [s for t, s in sim["latency"] if w * SLO_WINDOW_S <= t < (w + 1) * SLO_WINDOW_S]
        if inside and float(np.percentile(inside, 99)) > slo_s:
            over += SLO_WINDOW_S
    outs = [c for c in sim["changes"] if c["action"] == "out"]
    return {
        "requests": len(lat),
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "max_s": float(lat.max()),
        "seconds_over_slo": over,
        "mean_pipelines": float(np.mean([n for _, n in sim["timeline"]])),
        "scale_outs": [[c["t"], c["reason"]] for c in outs],
        "forecast_scale_outs": sum(c["reason"].startswith("forecast:") for c in outs),
        "scale_ins": sum(c["action"] == "in" for c in sim["changes"]),
    }


def _first(r: dict[str, Any]) -> float:
    """When the first pipeline was added (inf: never)."""
    return float(r["scale_outs"][0][0]) if r["scale_outs"] else math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", default="1x40,2.5x20,4x20,5.5x20,7x20,8.5x20,10x60", help="REQ/SxSECONDS,..."
    )
    ap.add_argument("--service-s", type=float, default=0.27)
    ap.add_argument("--start-s", type=float, default=12.0)
    ap.add_argument("--autoscale", default="infer:min=1,max=4,target=2,cooldown=10,window=5")
    ap.add_argument("--slo-s", type=float, default=1.0, help="the p99 latency objective")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    steps = [(float(r), float(s)) for r, s in (p.split("x") for p in args.steps.split(","))]
    end_s = sum(s for _, s in steps)
    variants = {
        "reactive": args.autoscale,
        "forecast": f"{args.autoscale},lookahead={args.start_s:g}",
    }
    runs: dict[str, dict[str, Any]] = {name: {} for name in variants}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        times = arrivals(steps, rng)
        service = list(args.service_s * rng.lognormal(0.0, 0.2, len(times)))
        for name, text in variants.items():
            sim = simulate(text, times, service, args.start_s, end_s)
            runs[name][str(seed)] = figures(sim, args.slo_s, end_s)
    keys = ("p50_s", "p99_s", "max_s", "seconds_over_slo", "mean_pipelines")
    summary = {
        name: {k: float(np.mean([r[k] for r in per.values()])) for k in keys}
        for name, per in runs.items()
    }
    seeds = [str(k) for k in range(args.seeds)]
    compared = {
        "forecast_acted": sum(runs["forecast"][k]["forecast_scale_outs"] > 0 for k in seeds),
        "first_out_earlier": sum(
            _first(runs["forecast"][k]) < _first(runs["reactive"][k]) for k in seeds
        ),
        "first_out_same": sum(
            _first(runs["forecast"][k]) == _first(runs["reactive"][k]) for k in seeds
        ),
    }
    doc = {
        "model": "simulated: processor-sharing pipelines, Poisson arrivals, the real ScalePolicy",
        "steps": args.steps,
        "service_s": args.service_s,
        "start_s": args.start_s,
        "slo_s": args.slo_s,
        "seeds": args.seeds,
        "autoscale": variants,
        "mean_over_seeds": summary,
        "seeds_where": compared,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps(doc))
        return
    print(f"ramp {args.steps} req/s x s; p99 SLO {args.slo_s:g} s; start {args.start_s:g} s")
    print(f"seeds where: {compared}")
    head = ("deployment", "seed", "p50 s", "p99 s", "max s", "s>SLO", "pipes", "first out")
    print(f"{head[0]:<10} " + " ".join(f"{h:>9}" for h in head[1:]))
    for name, per in runs.items():
        for seed, r in per.items():
            first = f"{r['scale_outs'][0][0]:.1f}" if r["scale_outs"] else "-"
            print(
                f"{name:<10} {seed:>9} {r['p50_s']:>9.2f} {r['p99_s']:>9.2f} {r['max_s']:>9.2f} "
                f"{r['seconds_over_slo']:>9.0f} {r['mean_pipelines']:>9.2f} {first:>9}"
            )
        m = summary[name]
        print(
            f"{name:<10} {'mean':>9} {m['p50_s']:>9.2f} {m['p99_s']:>9.2f} {m['max_s']:>9.2f} "
            f"{m['seconds_over_slo']:>9.0f} {m['mean_pipelines']:>9.2f}"
        )
    for name, per in runs.items():
        print(f"{name}, seed 0, scale-outs:")
        for t, why in per["0"]["scale_outs"]:
            print(f"  {t:6.1f} s  {why}")


if __name__ == "__main__":
    main()
