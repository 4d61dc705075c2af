"""What the Ray launcher checks of a cluster: whether it can hold a plan's workers at all (before
a placement group would wait for room that never comes), what is free on a datacenter's nodes,
and whether a head joined on a loopback address keeps every node on this machine; and what
Ray's own security settings leave open on a cluster dmsc joins (:func:`exposure`)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from dmsc.runtime.compute.config import WorkerConfig


def ray_module() -> Any:
    """The ``ray`` module (imported on first use, as by the launcher)."""
    import importlib

    return importlib.import_module("ray")


def bundle(cfg: WorkerConfig) -> dict[str, float]:
    """What one stage worker holds on its node: its datacenter's unit and a CPU (or a GPU)."""
    device = "GPU" if cfg.device.startswith("cuda") else "CPU"
    return {device: 1, f"dc:{cfg.datacenter}": 1}


def pipeline_bundles(
    cfgs: list[WorkerConfig],
) -> tuple[list[dict[str, float]], dict[int, int]]:
    """One pipeline replica's placement-group bundles: one per stage, holding the units of its
    ``tp`` ranks together (a bundle lies on one node, so a tensor-parallel group does too), and
    each stage's bundle index."""
    bundles: list[dict[str, float]] = []
    index: dict[int, int] = {}
    for cfg in sorted(cfgs, key=lambda c: (c.stage, c.tp_rank)):
        if cfg.stage not in index:
            index[cfg.stage] = len(bundles)
            bundles.append({})
        held = bundles[index[cfg.stage]]
        for key, units in bundle(cfg).items():
            held[key] = held.get(key, 0) + units
    return bundles, index


def shortfall(
    cfgs: list[WorkerConfig], total: dict[str, float], nodes: list[dict[str, float]]
) -> str | None:
    """Why the cluster cannot hold the workers ``cfgs`` (each takes a CPU, or a GPU, on a node
    of its datacenter), or None. The cluster's total comes first ("needs 3 CPUs, the cluster has
    2"); then every set of datacenters, smallest first: the workers of a set need at least as
    many CPUs as the nodes offering any of its datacenters have (Hall's condition; the nodes of
    datacenters that share them count once). These are the checks placement groups would
    otherwise wait ``place_timeout_s`` on."""
    for kind in ("CPU", "GPU"):
        want: dict[str, int] = {}
        for c in cfgs:
            if bundle(c).get(kind):
                want[c.datacenter] = want.get(c.datacenter, 0) + 1
        n, have = sum(want.values()), int(total.get(kind, 0))
        each = f"each stage worker{' and warm spare' if _spares(cfgs) else ''} holds one"
        if n > have:
            return (
                f"the plan needs {n} {kind}s, the cluster has {have} ({each}): add nodes, or "
                "plan fewer stages or replicas"
            )
        dcs = sorted(want)
        for size in range(1, min(len(dcs), 12) + 1):  # 4095 sets at most
            for group in itertools.combinations(dcs, size):
                need = sum(want[d] for d in group)
                keys = [f"dc:{d}" for d in group]
                has = int(sum(r.get(kind, 0) for r in nodes if any(r.get(k) for k in keys)))
                if need > has and size == 1:
                    return (
                        f"datacenter {group[0]} needs {need} {kind}s, its nodes have {has} ({each})"
                    )
                if need > has:
                    return (
                        f"datacenters {', '.join(group)} need {need} {kind}s, their nodes have "
                        f"{has} (they share nodes; {each})"
                    )
    return None


def free_on(dcs: list[str]) -> dict[str, float]:
    """What is free now on the alive nodes that offer any of the resources ``dcs``."""
    ray = ray_module()
    from ray._private import state  # no public view of a node's free resources

    offering = {
        n["NodeID"] for n in ray.nodes() if n["Alive"] and any(n["Resources"].get(d) for d in dcs)
    }
    out: dict[str, float] = {}
    per_node: dict[str, dict[str, float]] = state.available_resources_per_node()  # type: ignore[no-untyped-call]
    for node, free in per_node.items():
        if node in offering:
            for k, v in free.items():
                out[k] = out.get(k, 0) + v
    return out


def on_loopback(address: str, here: str) -> bool:
    """Whether the head ``address`` is a loopback address and every alive node of the cluster
    is on this machine (registered on ``here``, this process's node address)."""
    import ipaddress

    host = address.rpartition(":")[0].strip("[]") or address
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
    nodes = [n for n in ray_module().nodes() if n["Alive"]]
    return loopback and all(n["NodeManagerAddress"] in (here, "127.0.0.1") for n in nodes)


def _spares(cfgs: list[WorkerConfig]) -> bool:
    return any(c.spare for c in cfgs)


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a Ray head's HOST:PORT (``dmsc up --ray-address``), or None."""
    if re.fullmatch(r"[^\s:\[\]]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}", address):
        return None
    return (
        "expected the Ray head's HOST:PORT (`auto` would join whichever cluster this machine "
        "last started, maybe another user's); leave it out for a private cluster"
    )


def exposure(env: Mapping[str, str]) -> list[str]:
    """What Ray's own settings in ``env`` (those of ``dmsc up``, which every Ray client of the
    cluster must share) leave open on a cluster joined with ``--ray-address``: one sentence per
    gap, none when token authentication and TLS are both on. dmsc cannot turn them on for a
    cluster it did not start: each node's processes read them when ``ray start`` runs."""
    gaps = []
    if env.get("RAY_AUTH_MODE", "").lower() != "token":
        gaps.append(
            "RAY_AUTH_MODE is not token: any client that reaches the head can run code beside "
            "the workers (and read their keys)"
        )
    if env.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        gaps.append(
            "RAY_USE_TLS is off: Ray's own traffic (and its token) crosses the network in clear"
        )
    return gaps
