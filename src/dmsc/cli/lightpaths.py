"""``dmsc simulate --lightpaths``: the RMSA experiment of the optical literature from the command
line. Lightpath requests (no training jobs) on a named topology or a cluster's fibers, at several
loads and seeds, under one or more spectrum fits: service and bandwidth blocking with 95%
intervals over the seeds, the time per request, a table, ``--json`` and a ``--plot``."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from dmsc.cli.tables import FoldTable
from dmsc.sim.lightpath_experiment import LightpathSettings, SettingInvalid
from dmsc.spec import SpecError

__all__ = ["LightpathSettings", "run_lightpath_command", "run_lightpaths"]

# the command-line flag of each setting, as errors name it
FLAGS = {
    "slots": "--slots",
    "k_paths": "--k",
    "guard_band": "--guard-band",
    "loads": "--loads",
    "requests": "--requests",
    "warmup": "--warmup",
    "seeds": "--seeds",
    "snapshot_at": "--snapshot-at",
    "fits": "--fit",
    "bitrate": "--bitrate",
    "topology": "--topology",
}


def run_lightpaths(
    s: LightpathSettings,
    as_json: bool,
    plot: str | None,
    console: Console,
    progress: Any,
    frag_plot: str | None = None,
    heatmap: str | None = None,
) -> dict[str, Any]:
    """The experiment (:func:`dmsc.sim.lightpath_experiment.run_experiment`); returns (and
    prints) the figures. ``frag_plot``: utilisation, external fragmentation and entropy over the
    requests (seed 0 of each fit, at the highest load); ``heatmap``: the spectrum of every fiber
    when request ``snapshot_at`` arrives (first fit, highest load, seed 0)."""
    from dmsc.sim.lightpath_experiment import check, run_experiment

    try:
        check(s)
    except SettingInvalid as exc:
        reason = exc.reason.replace("below the slots", "below --slots")
        raise SpecError("command line", FLAGS[exc.field], reason) from None
    task = progress.add_task("simulating", total=len(s.fits) * len(s.loads) * s.seeds)

    def report(description: str, done: int) -> None:
        if description:
            progress.update(task, description=description, completed=done)
        else:
            progress.update(task, completed=done)

    got = run_experiment(s, report)
    out = got.figures
    if plot:
        _plot(plot, out)
    if frag_plot:
        from dmsc.cli.lightpaths_plots import plot_fragmentation

        plot_fragmentation(frag_plot, got.traces, out, max(s.loads))
    if heatmap and got.snapshot is not None:
        from dmsc.cli.lightpaths_plots import plot_heatmap

        plot_heatmap(heatmap, got.snapshot, out, got.snapshot_at)
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
