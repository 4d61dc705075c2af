"""``dmsc simulate --lightpaths``: the RMSA experiment of the optical literature from the command
line. Lightpath requests (no training jobs) on a named topology or a cluster's fibers, at several
loads and seeds, under one or more spectrum fits: service and bandwidth blocking with 95%
intervals over the seeds, the time per request, a table, ``--json`` and a ``--plot``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from dmsc.cli.tables import FoldTable
from dmsc.spec import SpecError

MAX_REQUESTS = 10_000_000


@dataclass(frozen=True)
class LightpathSettings:
    """The experiment as the command line gives it (checked by :func:`run_lightpaths`)."""

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


def _check(s: LightpathSettings) -> tuple[Any, Any, Any]:
    """The topology, modulation table and bit rates; SpecError naming the flag otherwise."""
    from dmsc.netmodel.optical import modulation_table
    from dmsc.sim.rmsa import BitRates
    from dmsc.sim.spectrum import FITS
    from dmsc.sim.topologies import topology

    checks = [
        (1 <= s.slots <= 10_000, "--slots", "must be between 1 and 10000"),
        (1 <= s.k_paths <= 10, "--k", "must be between 1 and 10"),
        (0 <= s.guard_band < s.slots, "--guard-band", "must be 0 or more, below --slots"),
        (all(x > 0 for x in s.loads), "--loads", "loads must be positive"),
        (0 < s.requests <= MAX_REQUESTS, "--requests", f"must be between 1 and {MAX_REQUESTS}"),
        (0 <= s.warmup <= MAX_REQUESTS, "--warmup", f"must be between 0 and {MAX_REQUESTS}"),
        (s.seeds > 0, "--seeds", "must be positive"),
        (
            s.snapshot_at is None or 0 <= s.snapshot_at < s.warmup + s.requests,
            "--snapshot-at",
            "must be a request of the run (0 to warm-up + requests - 1)",
        ),
    ]
    for ok, flag, reason in checks:
        if not ok:
            raise SpecError("command line", flag, reason)
    for fit in s.fits:
        if fit not in FITS:
            raise SpecError(
                "command line", "--fit", f"unknown fit {fit!r} (fits: {', '.join(FITS)})"
            )
    try:
        rates = BitRates.parse(s.bitrate)
    except ValueError as exc:
        raise SpecError("command line", "--bitrate", str(exc)) from None
    try:
        topo = topology(s.topology)
    except ValueError as exc:
        raise SpecError("command line", "--topology", str(exc)) from None
    table = modulation_table(s.modulations)
    return topo, table, rates


def run_lightpaths(
    s: LightpathSettings,
    as_json: bool,
    plot: str | None,
    console: Console,
    progress: Any,
    frag_plot: str | None = None,
    heatmap: str | None = None,
) -> dict[str, Any]:
    """Every fit at every load and seed; returns (and prints) the figures. ``frag_plot``:
    utilisation, external fragmentation and entropy over the requests (seed 0 of each fit, at
    the highest load); ``heatmap``: the spectrum of every fiber when request ``snapshot_at``
    arrives (first fit, highest load, seed 0)."""
    from dmsc.sim.metrics import mean_ci
    from dmsc.sim.rmsa import simulate_lightpaths

    topo, table, rates = _check(s)
    per_fit: dict[str, list[dict[str, Any]]] = {}
    every = max(1, s.requests // 100)
    shot_at = s.snapshot_at if s.snapshot_at is not None else s.warmup + s.requests // 2
    traces: dict[str, Any] = {}
    shot = None
    total = len(s.fits) * len(s.loads) * s.seeds
    task = progress.add_task("simulating", total=total)
    for fit in s.fits:
        rows = []
        for load in s.loads:
            results = []
            for seed in range(s.seeds):
                progress.update(task, description=f"{fit} fit at {load:g} Erlang, seed {seed}")
                net = topo.network(s.slots, s.k_paths, table, s.guard_band, seed)
                results.append(
                    simulate_lightpaths(
                        net, load, s.requests + s.warmup, seed=seed, gbit_s=rates,
                        fit=fit, warmup=s.warmup, sample_every=every, snapshot_at=shot_at,
                    )
                )  # fmt: skip
                progress.advance(task)
            if load == max(s.loads):
                traces[fit] = results[0].samples
                if shot is None:
                    shot = (fit, load, results[0].snapshot)
            service, service_ci = mean_ci([r.blocking for r in results])
            bandwidth, bandwidth_ci = mean_ci([r.bandwidth_blocking for r in results])
            rows.append(
                {
                    "load": load,
                    "service_blocking": service,
                    "ci95": service_ci,
                    "bandwidth_blocking": bandwidth,
                    "bandwidth_ci95": bandwidth_ci,
                    "requests": sum(r.requests for r in results),
                    "slot_utilization": mean_ci([r.mean_slot_utilization for r in results])[0],
                    "us_per_request": sum(r.seconds for r in results)
                    / sum(r.handled for r in results)
                    * 1e6,
                    "external_fragmentation": mean_ci(
                        [x.external_fragmentation for r in results for x in r.samples]
                    )[0],
                    "spectrum_entropy": mean_ci([x.entropy for r in results for x in r.samples])[0],
                    "link_utilization": [
                        float(sum(col) / len(col))
                        for col in zip(*(r.link_utilization for r in results), strict=True)
                    ],
                }
            )
        per_fit[fit] = rows
    out = {
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
    if plot:
        _plot(plot, out)
    if frag_plot:
        from dmsc.cli.lightpaths_plots import plot_fragmentation

        plot_fragmentation(frag_plot, traces, out, max(s.loads))
    if heatmap and shot is not None:
        from dmsc.cli.lightpaths_plots import plot_heatmap

        plot_heatmap(heatmap, shot, out, shot_at)
    if not as_json:
        _print(console, out)
    return out


def _print(console: Console, out: dict[str, Any]) -> None:
    table = FoldTable(
        title=f"{out['topology']}: {out['slots']} slots, k={out['k_paths']}, guard band "
        f"{out['guard_band']}, {out['modulations']} formats, {out['bitrate']} Gbit/s, "
        f"{out['seeds']} seed(s) x {out['requests']} requests after {out['warmup']}"
    )
    for col in ("fit", "load", "service blocking", "bandwidth blocking", "slots used", "us/req"):
        table.add_column(col, justify="left" if col == "fit" else "right")
    for fit, rows in out["fits"].items():
        for r in rows:
            table.add_row(
                fit,
                f"{r['load']:g}",
                f"{r['service_blocking']:.4f} ± {r['ci95']:.4f}",
                f"{r['bandwidth_blocking']:.4f} ± {r['bandwidth_ci95']:.4f}",
                f"{r['slot_utilization'] * 100:.1f}%",
                f"{r['us_per_request']:.1f}",
            )
    console.print(table)


def _plot(path: str, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for fit, rows in out["fits"].items():
        loads = [r["load"] for r in rows]
        ys = [max(r["service_blocking"], 1e-6) for r in rows]
        errs = [r["ci95"] for r in rows]
        ax.errorbar(loads, ys, yerr=errs, marker="o", capsize=3, label=f"{fit} fit")
    ax.set_yscale("log")
    ax.set_xlabel("load (Erlang)")
    ax.set_ylabel("service blocking probability")
    ax.set_title(
        f"{out['topology']}, {out['slots']} slots, k={out['k_paths']}, guard {out['guard_band']}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_lightpath_command(
    settings: Any,
    as_json: bool,
    plot: str | None,
    fragmentation: str | None = None,
    heatmap: str | None = None,
) -> dict[str, Any]:
    """``--lightpaths``: the experiment with a progress bar; the JSON object with ``--json``."""
    from dmsc.cli.app import console
    from dmsc.cli.progress import elapsed_bar

    with elapsed_bar(as_json) as progress:
        out = run_lightpaths(settings, as_json, plot, console, progress, fragmentation, heatmap)
    if as_json:
        from dmsc.cli.render import nan_to_null

        print(json.dumps(nan_to_null(out)))
    return out
