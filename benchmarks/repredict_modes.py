"""Stored ``parallel_modes`` runs re-predicted by today's cost model, round by round.

``benchmarks/results/parallel_modes_cpu.json`` keeps, for each stored set of runs, every mode's
measured seconds by round and the calibration each round was predicted from. This program prices
the same layouts again with the cost model as it is now, each round on its own calibration's
collective, and sets the stored measurements against the new predictions: what a change to the
pricing of collectives does to the per-mode goal (within 15%), on runs already made, before new
ones are. A run stored since 2026-12-05 (afternoon) keeps each round's whole calibrated spec
(``calibration.spec_by_round``) and every mode is priced again from it. One stored before kept
only each round's measured collective: its devices and links are then those of a stand-in (by
default the first round's spec of a named stored set that kept one, so that the figures
repeat on any machine; ``--devices`` names a calibrated spec file instead: the tensor-parallel
time depends on the devices' rates too), and only the modes the collective prices are
re-predicted (the tensor-parallel all-reduces, the expert-parallel all-to-alls, the data-
parallel ring without a codec; the star's sends and the codecs' passes stand on the link and
the host's memory bandwidth of the round, which it did not keep; ``--every-mode`` prices them
too, on ``--devices``' link and host, a stand-in). A set stored before each
round kept its calibration prices all its rounds with its one. Prints a table, or with
``--json`` one object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import yaml
from parallel_modes import _spec, predicted, template

from dmsc.spec import ClusterSpec

RESULTS = Path(__file__).parent / "results" / "parallel_modes_cpu.json"
DEFAULT_SETS = ("reruns_2026_12_05_final", "reruns_2026_12_05_in_step_3")
KEYS = {"tp": ("tp_comm",), "dp": ("dp_comm",), "ep": ("ep_comm",)}
COLLECTIVE_FIELDS = (
    "backend",
    "bandwidth_gbit_s",
    "latency_us",
    "bandwidth_awake_gbit_s",
    "latency_awake_us",
    "quorum_us",
    "source",
)


def cluster(collective: dict[str, Any], devices: dict[str, Any]) -> ClusterSpec:
    """The benchmark's node with a stored round's measured collective, its devices, link and
    cores those of the calibrated spec ``devices``."""
    spec = template()
    spec["device_types"] = devices["device_types"]
    spec["shared_cores"] = devices.get("shared_cores")
    node = spec["node_types"]["host"]
    node["link"] = next(iter(devices["node_types"].values()))["link"]
    node["collective"] = {
        k: collective[k] for k in COLLECTIVE_FIELDS if collective.get(k) is not None
    }
    return ClusterSpec.model_validate(spec)


def priced_by_collective(name: str, mode: str) -> bool:
    """Whether ``mode`` of the run ``name`` is priced by the node's collective and devices
    alone (module docstring)."""
    plain_ring = "star" not in name and "int8" not in name
    return mode in ("tp", "ep") or (mode == "dp" and plain_ring)


def repredict(
    run: dict[str, Any], devices: dict[str, Any], every_mode: bool = False
) -> dict[str, dict[str, list[float]]]:
    """One stored run's modes: each round's stored ratio and today's, by ``run/mode``
    (``every_mode``: also those a run without its specs kept too little for, on the stand-in
    spec's link and host)."""
    cal = run["calibration"]
    specs = cal.get("spec_by_round")
    out: dict[str, dict[str, list[float]]] = {}
    for name, row in run["runs"].items():
        for m in row["modes"]:
            kept = specs or every_mode or priced_by_collective(name, m["mode"])
            if m["mode"] not in KEYS or not kept:
                continue
            measured = m.get("by_round") or [m["measured_s"]]
            # a set stored before each round had its own prediction: the one prediction's
            was = m.get("predicted_by_round") or [m["predicted_s"]] * len(measured)
            stored = [a / b for a, b in zip(measured, was, strict=True)]
            if specs:
                clusters = [ClusterSpec.model_validate(s) for s in specs]
            else:
                figures = cal.get("collective_by_round") or [cal["collective"]] * len(measured)
                clusters = [cluster(c, devices) for c in figures]
            now = []
            for seconds, spec in zip(measured, clusters, strict=True):
                model = "moe-mini" if name.startswith("moe") else "gpt-mini"
                shape = (row["tp"], row["stages"], row["dp"], 1, row["ep"])
                star, codec = "star" in name, row.get("compress", "none")
                pred = predicted(spec, _spec(model), *shape, star=star, compress=codec)
                now.append(seconds / sum(pred["breakdown"][k] for k in KEYS[m["mode"]]))
            out[f"{name}/{m['mode']}"] = {"stored": stored, "now": now}
    return out


# The stored set whose first round's spec stands in, by name: the newest one did until a set
# stored later moved every stand-in figure (the summary test failed on 2026-12-05).
STAND_IN_SET = "reruns_2026_12_05_pm"


def stand_in(stored: dict[str, Any]) -> dict[str, Any]:
    """The first round's calibrated spec of :data:`STAND_IN_SET`, else of the newest stored set
    that kept its specs."""
    named = [STAND_IN_SET] if STAND_IN_SET in stored else []
    for key in named + list(reversed(list(stored))):
        for run in stored[key].get("runs", []) if isinstance(stored[key], dict) else []:
            specs = run.get("calibration", {}).get("spec_by_round")
            if specs:
                return dict(specs[0])
    raise ValueError("no stored set of runs kept its calibrated specs")


def summarise(
    stored: dict[str, Any], sets: list[str], devices: dict[str, Any], every_mode: bool = False
) -> dict[str, Any]:
    """The stored ``sets`` priced again (:func:`repredict`): each mode's ratios round by round,
    as stored and now, and how many within 15%."""
    modes: dict[str, dict[str, list[float]]] = {}
    for key in sets:
        for run in stored[key]["runs"]:
            for mode, got in repredict(run, devices, every_mode).items():
                into = modes.setdefault(mode, {"stored": [], "now": []})
                into["stored"] += got["stored"]
                into["now"] += got["now"]
    every = {k: [r for v in modes.values() for r in v[k]] for k in ("stored", "now")}
    summary = {
        k: {
            "mode_rounds": len(v),
            "within_15pct": within(v),
            "median_abs_log_ratio": statistics.median(abs(math.log(r)) for r in v),
        }
        for k, v in every.items()
    }
    return {"sets": sets, "modes": modes, "summary": summary}


def within(ratios: list[float]) -> int:
    return sum(abs(r - 1) <= 0.15 for r in ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="*", default=list(DEFAULT_SETS), help="stored sets' keys")
    ap.add_argument(
        "--devices",
        help="a calibrated spec file whose devices and link stand in for a run that kept none "
        "(default: a named stored set's first round's)",
    )
    ap.add_argument(
        "--every-mode",
        action="store_true",
        help="a run that kept no spec: its star and codec runs too, on --devices' link and host",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    stored = json.loads(RESULTS.read_text())
    missing = [s for s in args.sets if s not in stored or "runs" not in stored[s]]
    if missing:
        ap.error(f"no stored set of runs named {', '.join(missing)} in {RESULTS.name}")
    devices = stand_in(stored)
    if args.devices:
        path = Path(args.devices)
        if not path.is_file():
            ap.error(f"--devices: no calibrated spec at {path} (`dmsc calibrate` writes one)")
        devices = yaml.safe_load(path.read_text())
    out = summarise(stored, args.sets, devices, args.every_mode)
    modes, summary = out["modes"], out["summary"]
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'run/mode':18s} {'within st/now':>13s}  ratios stored -> now, round by round")
    for mode, v in modes.items():
        pairs = " ".join(f"{a:.2f}>{b:.2f}" for a, b in zip(v["stored"], v["now"], strict=True))
        print(f"{mode:18s} {within(v['stored']):>6d}/{within(v['now']):<6d}  {pairs}")
    for k, s in summary.items():
        print(
            f"{k}: {s['within_15pct']} of {s['mode_rounds']} within 15%, "
            f"median |log ratio| {s['median_abs_log_ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
