"""The Ray launcher's figures for ``benchmarks/chaos_recovery.py --launcher ray``, beside the local
launcher's on the same layout and machine.

A local Ray cluster (``dmsc.testing.ray_local``): a head offering datacenters dc-0 and
dc-2 and two nodes offering dc-1, on 127.0.0.1. On it:

- a stage worker of dc-1 killed (kill -9) during training, with the local launcher and with Ray,
  each without and with warm spares (one per datacenter);
- the node running that worker lost (its processes killed) and partitioned (frozen, then let go);
- ``dmsc up`` of the same plan (gpt-mini, pp=3 over three datacenters) with each launcher: wall
  time, and the memory (proportional set size) of everything it runs; with Ray, of Ray's own
  processes as well.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from _deployment import home_and_dmsc

from dmsc.data.corpus import Corpus
from dmsc.runtime.control.launch.deployment import StageLayout
from dmsc.runtime.control.launch.ray_launcher import RayLauncher
from dmsc.spec import TransformerSpec
from dmsc.testing.chaos import FaultReport, train_under_fault
from dmsc.testing.ray_local import (
    add_node,
    live_nodes,
    local_cluster,
    pss_mib,
    ray_pids,
    train_through_node_fault,
)

DC1 = "dc:dc-1"


def _kills(
    spec: TransformerSpec, two: list[tuple[str, str]], corpora: Any, steps: int, ttl: float
) -> list[FaultReport]:
    dcs = {(0, 0): "dc-0", (1, 0): "dc-1"}
    out = []
    for spares in (0, 2):
        for name in ("local", "ray"):
            report, fr = train_under_fault(
                StageLayout(spec, two, datacenters=dcs),
                *corpora,
                steps,
                8,
                4,
                "kill",
                stage=1,
                at_step=steps // 2 + 1,
                checkpoint_every=4,
                registry_ttl_s=ttl,
                spares=spares,
                launcher=RayLauncher() if name == "ray" else None,
            )
            fr.fault = f"kill ({name}{', warm spares' if spares else ''})"
            fr.extra["steps_completed"] = len(report.losses)
            out.append(fr)
    return out


def _node_faults(
    c: Any, spec: TransformerSpec, two: list[tuple[str, str]], corpora: Any, steps: int, ttl: float
) -> list[FaultReport]:
    out = []
    for fault in ("lose", "partition"):
        while len(live_nodes(c, DC1)) < 2:  # a dc-1 node to move to
            add_node(c, {DC1: 8})
        layout = StageLayout(spec, two, datacenters={(0, 0): "dc-0", (1, 0): "dc-1"})
        report, fr = train_through_node_fault(
            c, layout, *corpora, steps, 8, 4, fault, at_step=steps // 2,  # type: ignore[arg-type]
            checkpoint_every=4, registry_ttl_s=ttl,
        )  # fmt: skip
        fr.fault = f"{fault} node (ray)"
        fr.extra["moved"] = fr.extra["node_after"] != fr.extra["node_before"]
        fr.extra["steps_completed"] = len(report.losses)
        out.append(fr)
    return out


def _startup(c: Any, rounds: int) -> dict[str, Any]:
    """``dmsc up`` with each launcher, ``rounds`` times each, alternating."""
    home, dmsc = home_and_dmsc("dmsc-bench-ray-")
    root = Path(__file__).resolve().parents[1]
    plan = home / "plan.json"
    dmsc(
        *("plan", "--cluster", str(root / "examples/clusters/local-cpu.yaml")),
        *("--model", "gpt-mini", "--global-batch", "8", "--micro-batch", "2"),
        *("--tp", "1", "--pp", "3", "--dp", "1", "--out", str(plan)),
    )
    args = {"local": [], "ray": ["--launcher", "ray", "--ray-address", c.address]}
    times: dict[str, list[float]] = {"local": [], "ray": []}
    memory: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for name, extra in args.items():
            t0 = time.perf_counter()
            dmsc("up", "--plan", str(plan), *extra)
            times[name].append(time.perf_counter() - t0)
            status = json.loads(dmsc("status", "--json"))
            workers = {int(s["pid"]) for s in status["services"]}
            daemon = int(json.loads((home / "control.json").read_text())["pid"])
            mem = {"dmsc_mib": pss_mib([daemon, *workers])}
            if name == "ray":
                mem["ray_mib"] = pss_mib(ray_pids(c, but=workers))
            memory[name] = mem
            dmsc("down")
    return {
        "up_s": {k: statistics.median(v) for k, v in times.items()},
        "up_ratio_ray_to_local": statistics.median(times["ray"])
        / statistics.median(times["local"]),
        "memory": memory,
        "stages": len(json.loads(plan.read_text())["stages"]),
    }


def ray_figures(
    spec: TransformerSpec, two: list[tuple[str, str]], corpora: tuple[Corpus, Corpus], steps: int,
    ttl: float, rounds: int = 2,
) -> dict[str, Any]:  # fmt: skip
    """Every figure of the module docstring, on one local cluster."""
    t0 = time.perf_counter()
    with local_cluster({"dc:dc-0": 8, "dc:dc-2": 8}, [{DC1: 8}, {DC1: 8}]) as c:
        started = time.perf_counter() - t0
        idle = pss_mib(ray_pids(c))
        startup = _startup(c, rounds)
        faults = [
            *_kills(spec, two, corpora, steps, ttl),
            *_node_faults(c, spec, two, corpora, steps, ttl),
        ]
    return {
        "cluster_start_s": started,
        "cluster_idle_mib": idle,
        "startup": startup,
        "faults": faults,
    }
