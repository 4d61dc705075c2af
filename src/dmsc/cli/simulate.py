"""``dmsc simulate``: run schedulers over loads and seeds, print, save and plot the figures.

The simulator is imported when a simulation runs, not when the command is registered: every other
``dmsc`` command starts without it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from dmsc.cli.app import console, err_console
from dmsc.cli.options import JsonOpt
from dmsc.cli.progress import elapsed_bar
from dmsc.cli.render import nan_to_null
from dmsc.cli.sync_flags import CompressOpt, SyncOpt, job_entry, scenario_with_sync
from dmsc.cli.tables import FoldTable
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.sim.engine import RunResult
    from dmsc.sim.scenario import ScenarioSpec
    from dmsc.sim.sweep import Sweep

FITS = ("first", "best", "last", "random", "exact")
MAX_K_PATHS = 10  # as the scenario file allows
MAX_SLOTS = 10_000  # as a cluster file allows per fiber


def parse_list(text: str, flag: str, kind: type) -> list[Any]:
    """A comma-separated flag value as a list of ``kind``; an error names the flag."""
    try:
        values = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(
            "command line", flag, f"expected a comma-separated list, got {text!r}"
        ) from None
    if not values:
        raise SpecError("command line", flag, "is empty")
    return values


@dataclass(frozen=True)
class Overrides:
    """Scenario settings given on the command line, over the scenario file's."""

    k_paths: int | None = None
    fit: str | None = None
    slots: int | None = None
    mix: str | None = None  # the --mix text: MODEL[=WEIGHT],...
    guard_band: int | None = None
    modulations: str | None = None
    sync: str | None = None  # --sync and --compress: over every job type's (dmsc.cli.sync_flags)
    compress: str | None = None


def parse_mix(text: str) -> list[tuple[str, float | None]]:
    """``--mix``: comma-separated job types, each ``NAME`` or ``NAME=WEIGHT``."""
    picks: list[tuple[str, float | None]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, weight = item.partition("=")
        try:
            picks.append((name.strip(), float(weight) if eq else None))
        except ValueError:
            raise SpecError(
                "command line", "--mix", f"expected NAME or NAME=WEIGHT, got {item!r}"
            ) from None
    if not picks:
        raise SpecError("command line", "--mix", "is empty")
    return picks


def apply_overrides(scenario: ScenarioSpec, over: Overrides) -> ScenarioSpec:
    """The scenario with the command line's values on top; an error names the flag."""
    from dmsc.sim.scenario import mix_jobs

    update: dict[str, Any] = {}
    if over.k_paths is not None:
        if not 1 <= over.k_paths <= MAX_K_PATHS:
            raise SpecError("command line", "--k", f"must be between 1 and {MAX_K_PATHS}")
        update["k_paths"] = over.k_paths
    if over.fit is not None:
        if over.fit not in FITS:
            raise SpecError(
                "command line", "--fit", f"expected one of {', '.join(FITS)}, got {over.fit!r}"
            )
        update["fit"] = over.fit
    if over.guard_band is not None:
        if not 0 <= over.guard_band <= 64:
            raise SpecError("command line", "--guard-band", "must be between 0 and 64")
        update["guard_band"] = over.guard_band
    if over.modulations is not None:
        from dmsc.netmodel.optical import modulation_table

        modulation_table(over.modulations)  # a wrong name or file: SpecError, now
        update["modulations"] = over.modulations
    if over.slots is not None and not 1 <= over.slots <= MAX_SLOTS:
        raise SpecError("command line", "--slots", f"must be between 1 and {MAX_SLOTS}")
    if over.mix is not None:
        try:
            update["jobs"] = mix_jobs(scenario.jobs, parse_mix(over.mix))
        except ValueError as exc:
            raise SpecError("command line", "--mix", str(exc)) from None
    return scenario_with_sync(scenario.model_copy(update=update), over.sync, over.compress)


def simulate(
    scenario: Annotated[
        str | None, typer.Option(help="Scenario file (YAML or JSON) of training jobs.")
    ] = None,
    lightpaths: Annotated[
        bool,
        typer.Option(help="Lightpath requests alone (the RMSA experiment), not training jobs."),
    ] = False,
    topology: Annotated[
        str, typer.Option(help="--lightpaths: a named topology (nsfnet) or a cluster file.")
    ] = "nsfnet",
    scheduler: Annotated[str, typer.Option(help="baseline, cba or joint.")] = "cba",
    compare: Annotated[
        str | None, typer.Option(help="Comma-separated schedulers to run side by side.")
    ] = None,
    loads: Annotated[str | None, typer.Option(help="Comma-separated loads in Erlang.")] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per point (confidence intervals).")] = 1,
    arrivals: Annotated[int | None, typer.Option(help="Job arrivals per run.")] = None,
    k: Annotated[
        int | None,
        typer.Option("--k", help="Shortest routes tried per datacenter pair (scenario: k_paths)."),
    ] = None,
    fit: Annotated[
        str | None,
        typer.Option(
            help="Spectrum fit: first, best, last, random or exact (scenario: fit); "
            "--lightpaths: a comma-separated list, one curve each."
        ),
    ] = None,
    slots: Annotated[
        int | None, typer.Option(help="Frequency slots on every fiber (cluster: links' slots).")
    ] = None,
    guard_band: Annotated[
        int | None,
        typer.Option(help="Guard-band slots above every lightpath (scenario: guard_band; 1)."),
    ] = None,
    modulations: Annotated[
        str | None,
        typer.Option(
            help="Modulation table: dmsc, optical-rl-gym or a YAML/JSON file "
            "(scenario: modulations)."
        ),
    ] = None,
    bitrate: Annotated[
        str,
        typer.Option(help="--lightpaths: bit rates, uniform:A:B or R1[=W1],R2[=W2],... Gbit/s."),
    ] = "uniform:25:100",
    requests: Annotated[
        int, typer.Option(help="--lightpaths: requests counted per run, after the warm-up.")
    ] = 30_000,
    warmup: Annotated[
        int, typer.Option(help="--lightpaths: requests first, not counted.")
    ] = 10_000,
    fragmentation: Annotated[
        str | None,
        typer.Option(help="--lightpaths: draw fragmentation over the requests to this PNG."),
    ] = None,
    heatmap: Annotated[
        str | None,
        typer.Option(help="--lightpaths: draw every fiber's spectrum (links x slots) to this PNG."),
    ] = None,
    snapshot_at: Annotated[
        int | None,
        typer.Option(help="--lightpaths: the request the heat map shows (default: the middle)."),
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option(
            help="Job mix: comma-separated job types of the scenario, NAME or NAME=WEIGHT "
            "(NAME: model preset, or model/ppN); the others are left out (scenario: jobs)."
        ),
    ] = None,
    sync: SyncOpt = None,
    compress: CompressOpt = None,
    plot: Annotated[str | None, typer.Option(help="Draw blocking vs load to this PNG.")] = None,
    csv_out: Annotated[str | None, typer.Option("--csv", help="Per-run rows to this CSV.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate training jobs arriving over a multi-datacenter optical network, or (with
    --lightpaths) lightpath requests alone."""
    from dmsc.cli.paths import check_output

    check_output(plot, "--plot", image=True)
    check_output(csv_out, "--csv")
    check_output(fragmentation, "--fragmentation", image=True)
    check_output(heatmap, "--heatmap", image=True)
    if lightpaths:
        from dmsc.cli.lightpaths import LightpathSettings, run_lightpath_command

        run_lightpath_command(
            LightpathSettings(
                topology=topology,
                slots=100 if slots is None else slots,
                k_paths=5 if k is None else k,
                guard_band=1 if guard_band is None else guard_band,
                modulations=modulations or "dmsc",
                bitrate=bitrate,
                loads=tuple(parse_list(loads, "--loads", float)) if loads else (100, 200, 300, 400),
                requests=requests,
                warmup=warmup,
                seeds=seeds,
                fits=tuple(parse_list(fit, "--fit", str)) if fit else ("first",),
                snapshot_at=snapshot_at,
            ),
            as_json,
            plot,
            fragmentation,
            heatmap,
        )
        return
    if scenario is None:
        raise SpecError("command line", "--scenario", "is needed (or --lightpaths)")
    names = parse_list(compare, "--compare", str) if compare else [scheduler]
    load_list = parse_list(loads, "--loads", float) if loads else None
    run_simulation(
        scenario,
        names,
        load_list,
        seeds,
        arrivals,
        as_json,
        plot,
        csv_out,
        console,
        err_console,
        Overrides(k, fit, slots, mix, guard_band, modulations, sync, compress),
    )


def run_simulation(
    scenario_path: str,
    schedulers: list[str],
    loads: list[float] | None,
    seeds: int,
    arrivals: int | None,
    as_json: bool,
    plot: str | None,
    csv_path: str | None,
    console: Console,
    err_console: Console,
    overrides: Overrides | None = None,
) -> dict[str, Any]:
    """Every scheduler at every load and seed; prints (or writes) the summaries and returns them.
    ``overrides``: settings from the command line over the scenario file's."""
    from dmsc.sim import SCHEDULERS, load_scenario
    from dmsc.sim.sweep import ScenarioInvalid, sweep

    for name in schedulers:
        if name not in SCHEDULERS:
            raise SpecError(
                "command line",
                "--scheduler/--compare",
                f"unknown scheduler {name!r} (known: {', '.join(SCHEDULERS)})",
            )
    if seeds <= 0:
        raise SpecError("command line", "--seeds", "must be positive")
    if loads is not None and any(x <= 0 for x in loads):
        raise SpecError("command line", "--loads", "loads must be positive")
    if arrivals is not None and arrivals <= 0:
        raise SpecError("command line", "--arrivals", "must be positive")
    scenario, cluster = load_scenario(scenario_path)
    over = overrides or Overrides()
    scenario = apply_overrides(scenario, over)
    n = arrivals or scenario.arrivals
    total = len(schedulers) * len(loads or [scenario.load_erlang]) * seeds * n
    with elapsed_bar(as_json, err_console) as progress:
        task = progress.add_task("simulating", total=total)

        def report(description: str, done: int) -> None:
            if description:
                progress.update(task, description=description, completed=done)
            else:
                progress.update(task, completed=done)

        try:
            result = sweep(scenario, cluster, schedulers, loads, seeds, n, over.slots, report)
        except ScenarioInvalid as exc:
            field, _, reason = str(exc).partition(": ")
            raise SpecError(scenario_path, field, reason or str(exc)) from None
    out = result.to_dict()
    out["jobs"] = [job_entry(j) for j in scenario.jobs]
    if csv_path:
        _write_csv(csv_path, result.runs)
    if plot:
        _plot(plot, schedulers, list(result.loads), result.summaries, result.runs)
    if as_json:
        print(json.dumps(nan_to_null(out)))
    else:
        _print(console, out, schedulers, list(result.loads), result)
    return out


def _write_csv(path: str, runs: dict[tuple[str, float], list[RunResult]]) -> None:
    fields = [
        "scheduler",
        "load_erlang",
        "seed",
        "arrivals",
        "blocked",
        "blocking_probability",
        "transfer_requests",
        "transfer_blocked",
        "mean_iteration_time_s",
        "p95_iteration_time_s",
        "bubble_ratio",
        "spectrum_utilization",
        "gpu_utilization",
        "events",
        "wall_s",
    ]
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(fields)
        for results in runs.values():
            for r in results:
                w.writerow([r.scheduler if f == "scheduler" else getattr(r, f) for f in fields])


def _plot(
    path: str,
    schedulers: list[str],
    loads: list[float],
    summaries: dict[tuple[str, float], dict[str, Any]],
    runs: dict[tuple[str, float], list[RunResult]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in schedulers:
        ys = [summaries[(name, x)]["blocking_probability"] for x in loads]
        es = [summaries[(name, x)]["blocking_probability_ci95"] for x in loads]
        left.errorbar(loads, ys, yerr=es, marker="o", capsize=3, label=name)
    left.set_xlabel("offered load (Erlang)")
    left.set_ylabel("blocking probability")
    left.set_title("Blocking vs load (95% CI over seeds)")
    left.legend()
    data = [[t for r in runs[(name, loads[-1])] for t in r.iteration_times] for name in schedulers]
    right.boxplot(data, showfliers=False)
    right.set_xticks(range(1, len(schedulers) + 1), schedulers)
    right.set_ylabel("iteration time (s)")
    right.set_title(f"Iteration time per job at {loads[-1]:g} Erlang")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(
    console: Console,
    out: dict[str, Any],
    schedulers: list[str],
    loads: list[float],
    result: Sweep,
) -> None:
    summaries = result.summaries
    ci = out["seeds"] > 1
    t = FoldTable(
        title=f"{out['scenario']}: {out['seeds']} seed(s) x {out['arrivals']} arrivals"
        + (" (± 95% CI)" if ci else "")
    )
    for col in (
        "scheduler",
        "load",
        "blocking",
        "xfer blk",
        "iter (s)",
        "p95 (s)",
        "bubble",
        "spectrum",
        "GPU",
        "wall",
    ):
        t.add_column(col, justify="right")
    for name in schedulers:
        for load in loads:
            s = summaries[(name, load)]
            t.add_row(
                name,
                f"{load:g}",
                f"{s['blocking_probability']:.3f}"
                + (f" ±{s['blocking_probability_ci95']:.3f}" if ci else ""),
                f"{s['transfer_blocking_probability']:.3f}",
                f"{s['mean_iteration_time_s']:.2f}"
                + (f" ±{s['mean_iteration_time_s_ci95']:.2f}" if ci else ""),
                f"{s['p95_iteration_time_s']:.2f}",
                f"{s['bubble_ratio'] * 100:.0f}%",
                f"{s['spectrum_utilization'] * 100:.1f}%",
                f"{s['gpu_utilization'] * 100:.0f}%",
                f"{s['wall_s']:.1f}s",
            )
    console.print(t)
    rel = out.get("relative_to_baseline_pct")
    if rel:
        r = FoldTable(title="change against baseline")
        for col in ("scheduler", "load", "blocking", "mean iteration", "p95 iteration", "spectrum"):
            r.add_column(col, justify="right")
        for name in schedulers:
            if name == "baseline":
                continue
            for load in loads:
                c = result.relative(name, load)
                r.add_row(
                    name,
                    f"{load:g}",
                    f"{c['blocking_probability']:+.1f}%",
                    f"{c['mean_iteration_time_s']:+.1f}%",
                    f"{c['p95_iteration_time_s']:+.1f}%",
                    f"{c['spectrum_utilization']:+.1f}%",
                )
        console.print(r)
