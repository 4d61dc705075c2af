"""How fast `dmsc estimate` answers for GPT-3 175B on the 3072-GPU Selene example.

Measures the estimate in-process (median of repeats, topology built each time as the command
does) and the whole command as a user runs it (process start included). Prints a table, or with
--json one object with the same figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dmsc.netmodel import Topology, estimate_iteration
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "a100-selene.yaml"
JOBS = {
    "issue example (tp8 pp8 dp1, v=3)": dict(
        tp=8, pp=8, dp=1, global_batch=64, schedule="interleaved", interleave=3, recompute="full"
    ),
    "full machine (tp8 pp16 dp24, v=3)": dict(
        tp=8,
        pp=16,
        dp=24,
        global_batch=1536,
        schedule="interleaved",
        interleave=3,
        recompute="full",
    ),
}


def _time_in_process(cluster: ClusterSpec, job: JobSpec, repeats: int) -> float:
    model = resolve_model("gpt3-175b")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        estimate_iteration(cluster, model, job, topology=Topology(cluster))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_command(repeats: int) -> float:
    args = [
        sys.executable,
        "-m",
        "dmsc",
        "estimate",
        "--cluster",
        str(CLUSTER),
        "--model",
        "gpt3-175b",
        "--tp",
        "8",
        "--pp",
        "8",
        "--dp",
        "1",
        "--global-batch",
        "64",
        "--schedule",
        "interleaved",
        "--interleave",
        "3",
        "--recompute",
        "full",
        "--json",
    ]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cluster = load_spec(ClusterSpec, CLUSTER)
    figures = {
        f"in-process: {name}": _time_in_process(cluster, JobSpec(**kw), args.repeats)  # type: ignore[arg-type]
        for name, kw in JOBS.items()
    }
    figures["whole command: issue example"] = _time_command(args.repeats)
    if args.json:
        print(json.dumps({"seconds": figures, "target_s": 0.5}))
        return
    for name, seconds in figures.items():
        print(f"{name:45s} {seconds * 1e3:8.1f} ms")
    print("target: under 500 ms for the estimate")


if __name__ == "__main__":
    main()
