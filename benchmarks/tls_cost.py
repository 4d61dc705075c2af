"""The cost of TLS in one run: the pipeline's step time, decoding tokens/s and the gateway's
requests/s, each with and without TLS, plain and TLS rounds alternated.

Runs the three benchmarks that measure each path, one after the other in this run, each with
its ``--tls`` switch (which alternates plain and TLS deployments ``--rounds`` times, so that
drift on a shared machine hits both alike):

- ``pipeline_vs_torch.py --tls``: gpt-mini in 3 stage processes, 1F1B; mutual TLS between the
  control plane and every worker; ``tls_ratio`` is TLS step time over plain (goal < 1.05).
- ``inference.py --tls``: greedy decoding over 2 stage processes with a KV cache; ``tls_ratio``
  is TLS tokens/s over plain, per path (1 session, N concurrent sessions).
- ``gateway_side_by_side.py --tls``: the gateway over HTTPS (``dmsc up --tls``) against plain
  HTTP under wrk; ``ratio_to_plain`` is HTTPS requests/s over plain (goal > 0.85), and
  ``cpu_ratio_to_plain`` the gateway process's CPU per request over plain HTTP's over HTTPS's.

The 1-, 5- and 15-minute load averages are recorded before and after each benchmark: on a
shared machine a ratio is only as good as the quiet it was measured in. Prints the ratios, or
with --json one object (``benchmarks/results/tls_cost_cpu.json`` is one such run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _run(script: str, *args: str) -> dict[str, Any]:
    before = os.getloadavg()
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HERE / script), "--json", "--tls", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {
        "args": list(args),
        "wall_s": time.perf_counter() - t0,
        "load_before": before,
        "load_after": os.getloadavg(),
        "result": json.loads(done.stdout.strip().splitlines()[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="Plain/TLS pairs per benchmark.")
    parser.add_argument("--steps", type=int, default=20, help="Pipeline steps per deployment.")
    parser.add_argument("--tokens", type=int, default=100, help="Tokens per decoding.")
    parser.add_argument("--seconds", type=float, default=5.0, help="wrk time per target.")
    args = parser.parse_args()
    rounds = str(args.rounds)
    pipeline = _run("pipeline_vs_torch.py", "--steps", str(args.steps), "--rounds", rounds)
    inference = _run(
        "inference.py", "--tokens", str(args.tokens), "--sessions", "4", "--rounds", rounds
    )
    gateway = _run("gateway_side_by_side.py", "--seconds", str(args.seconds), "--rounds", rounds)
    targets = gateway["result"]["targets"]
    ratios = {
        "pipeline_step_time_tls_over_plain": pipeline["result"]["tls_ratio"],
        "inference_tokens_per_s_tls_over_plain": inference["result"]["tls"]["tls_ratio"],
        "gateway_requests_per_s_https_over_plain": {
            name: t["ratio_to_plain"] for name, t in targets.items() if "ratio_to_plain" in t
        },
        # plain's server CPU per request over HTTPS's (the requests/s one core serves)
        "gateway_cpu_per_request_plain_over_https": {
            name: t["cpu_ratio_to_plain"]
            for name, t in targets.items()
            if "cpu_ratio_to_plain" in t
        },
    }
    out: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "ratios": ratios,
        "pipeline": pipeline,
        "inference": inference,
        "gateway": gateway,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(json.dumps(ratios, indent=2))
    for name, part in (("pipeline", pipeline), ("inference", inference), ("gateway", gateway)):
        print(f"{name}: load {part['load_before']} -> {part['load_after']}, {part['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
