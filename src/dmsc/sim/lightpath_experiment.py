"""The RMSA experiment of the optical literature: lightpath requests alone (no training jobs) on
a named topology or a cluster's fibers, at several loads and seeds, under one or more spectrum
fits. Per fit and load: service and bandwidth blocking with 95% intervals over the seeds, slot
utilisation, fragmentation, entropy and the time per request (:func:`load_row`); the traces and
the spectrum snapshot the plots draw. ``dmsc simulate --lightpaths`` and
``benchmarks/sim_rmsa.py`` run it; rendering is theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dmsc.sim.metrics import mean_ci
from dmsc.sim.rmsa import RMSAResult, simulate_lightpaths

MAX_REQUESTS = 10_000_000


@dataclass(frozen=True)
class LightpathSettings:
    """The experiment's settings (checked by :func:`check`)."""

    topology: str = "nsfnet"
    slots: int = 100
    k_paths: int = 5
    guard_band: int = 1
    modulations: str = "dmsc"
    bitrate: str = "uniform:25:100"
    loads: tuple[float, ...] = (100.0, 200.0, 300.0, 400.0)
    requests: int = 30_000  # counted, after the warm-up
    warmup: int = 10_000
    seeds: int = 1
    fits: tuple[str, ...] = ("first",)
    snapshot_at: int | None = None  # the request whose arrival the heat map shows


class SettingInvalid(ValueError):
    """A setting the experiment cannot run with: ``field`` (a :class:`LightpathSettings` field)
    and the reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def check(s: LightpathSettings) -> tuple[Any, Any, Any]:
    """The topology, modulation table and bit rates of ``s``; :class:`SettingInvalid` otherwise."""
    from dmsc.netmodel.optical import modulation_table
    from dmsc.sim.rmsa import BitRates
    from dmsc.sim.spectrum import FITS
    from dmsc.sim.topologies import topology

    checks = [
        (1 <= s.slots <= 10_000, "slots", "must be between 1 and 10000"),
        (1 <= s.k_paths <= 10, "k_paths", "must be between 1 and 10"),
        (0 <= s.guard_band < s.slots, "guard_band", "must be 0 or more, below the slots"),
        (all(x > 0 for x in s.loads), "loads", "loads must be positive"),
        (0 < s.requests <= MAX_REQUESTS, "requests", f"must be between 1 and {MAX_REQUESTS}"),
        (0 <= s.warmup <= MAX_REQUESTS, "warmup", f"must be between 0 and {MAX_REQUESTS}"),
        (s.seeds > 0, "seeds", "must be positive"),
        (
            s.snapshot_at is None or 0 <= s.snapshot_at < s.warmup + s.requests,
            "snapshot_at",
            "must be a request of the run (0 to warm-up + requests - 1)",
        ),
    ]
    for ok, field, reason in checks:
        if not ok:
            raise SettingInvalid(field, reason)
    for fit in s.fits:
        if fit not in FITS:
            raise SettingInvalid("fits", f"unknown fit {fit!r} (fits: {', '.join(FITS)})")
    try:
        rates = BitRates.parse(s.bitrate)
    except ValueError as exc:
        raise SettingInvalid("bitrate", str(exc)) from None
    try:
        topo = topology(s.topology)
    except ValueError as exc:
        raise SettingInvalid("topology", str(exc)) from None
    return topo, modulation_table(s.modulations), rates


def load_row(load: float, results: Sequence[RMSAResult]) -> dict[str, Any]:
    """The figures of one load over its seeds' runs."""
    service, service_ci = mean_ci([r.blocking for r in results])
    bandwidth, bandwidth_ci = mean_ci([r.bandwidth_blocking for r in results])
    return {
        "load": load,
        "service_blocking": service,
        "ci95": service_ci,
        "bandwidth_blocking": bandwidth,
        "bandwidth_ci95": bandwidth_ci,
        "requests": sum(r.requests for r in results),
        "slot_utilization": mean_ci([r.mean_slot_utilization for r in results])[0],
        "us_per_request": sum(r.seconds for r in results) / sum(r.handled for r in results) * 1e6,
        "external_fragmentation": mean_ci(
            [x.external_fragmentation for r in results for x in r.samples]
        )[0],
        "spectrum_entropy": mean_ci([x.entropy for r in results for x in r.samples])[0],
        "link_utilization": [
            float(sum(col) / len(col))
            for col in zip(*(r.link_utilization for r in results), strict=True)
        ],
    }


@dataclass(frozen=True)
class LightpathExperiment:
    """What the experiment gives: the figures (as ``--json`` prints them), seed 0's samples of
    each fit at the highest load, and the spectrum when request ``snapshot_at`` arrived (first
    fit, highest load, seed 0) as ``(fit, load, snapshot)``."""

    figures: dict[str, Any]
    traces: dict[str, Any]
    snapshot: tuple[str, float, Any] | None
    snapshot_at: int


def run_experiment(
    s: LightpathSettings, progress: Callable[[str, int], None] | None = None
) -> LightpathExperiment:
    """Every fit at every load and seed. ``progress(description, runs done)`` before each run."""
    topo, table, rates = check(s)
    per_fit: dict[str, list[dict[str, Any]]] = {}
    every = max(1, s.requests // 100)
    shot_at = s.snapshot_at if s.snapshot_at is not None else s.warmup + s.requests // 2
    traces: dict[str, Any] = {}
    shot = None
    done = 0
    for fit in s.fits:
        rows = []
        for load in s.loads:
            results = []
            for seed in range(s.seeds):
                if progress is not None:
                    progress(f"{fit} fit at {load:g} Erlang, seed {seed}", done)
                net = topo.network(s.slots, s.k_paths, table, s.guard_band, seed)
                results.append(
                    simulate_lightpaths(
                        net, load, s.requests + s.warmup, seed=seed, gbit_s=rates,
                        fit=fit, warmup=s.warmup, sample_every=every, snapshot_at=shot_at,
                    )
                )  # fmt: skip
                done += 1
            if load == max(s.loads):
                traces[fit] = results[0].samples
                if shot is None:
                    shot = (fit, load, results[0].snapshot)
            rows.append(load_row(load, results))
        per_fit[fit] = rows
    if progress is not None:
        progress("", done)
    figures = {
        "topology": topo.name,
        "topology_source": topo.source,
        "slots": s.slots,
        "k_paths": s.k_paths,
        "guard_band": s.guard_band,
        "modulations": table.name,
        "bitrate": s.bitrate,
        "seeds": s.seeds,
        "requests": s.requests,
        "warmup": s.warmup,
        "links": [f"{a}-{b}" for a, b, _ in topo.links],
        "loads": per_fit[s.fits[0]],
        "fits": per_fit,
    }
    return LightpathExperiment(figures, traces, shot, shot_at)
