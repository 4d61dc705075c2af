"""Local data: each datacenter's replicas train on their own shard of a task's files.

The control plane only decides which files each site keeps (:func:`dmsc.data.shards.shard_files`,
by datacenter, with the task's skew); the replicas' first and last stages read them from their
own disk (``LoadShard``) and draw every step's batch there, so no training text crosses the
network. Replicas of one datacenter share its shard and draw different samples from it (their
batches are seeded by replica).
"""

from __future__ import annotations

from pathlib import Path

from dmsc.data.shards import shard_files, training_files
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.control.training.params import TrainParams
from dmsc.runtime.transport.messages import LoadShard


def site_shards(dep: Deployment, data: Path, skew: float, seed: int = 0) -> dict[int, list[str]]:
    """Each replica's files: its datacenter's shard of ``data``'s training files (ValueError
    when the directory has fewer files than the deployment has datacenters)."""
    lay = dep.layout
    sites = list(dict.fromkeys(lay.datacenters.get((0, r), "local") for r in range(lay.replicas)))
    shards = shard_files(training_files(data), len(sites), skew, seed)
    return {
        r: [str(f) for f in shards[sites.index(lay.datacenters.get((0, r), "local"))]]
        for r in range(lay.replicas)
    }


def load_shards(dep: Deployment, shards: dict[int, list[str]], batch: int, seed: int = 0) -> None:
    """Send each replica's first and last stage its files; from then on a training step
    without tokens has them draw ``batch`` samples per step from their shard."""
    keys = [(s, r) for r in range(dep.layout.replicas) for s in sorted({0, dep.stages - 1})]
    futures = {
        k: dep.calls(
            "LoadShard",
            lambda e, k=k: LoadShard(files=shards[k[1]], seed=seed, epoch=e),  # type: ignore[misc]
            [k],
            120.0,
        )[k]
        for k in keys
    }
    dep.gather(futures, 120.0)
    dep.local_batch = batch


def load_task_shards(dep: Deployment, params: TrainParams) -> None:
    """A training task's local data: its directory shared out by datacenter with its skew,
    each replica drawing ``batch / dp`` samples a step from its own part."""
    if params.data is None:
        raise ValueError("local data needs a directory of files (data)")
    shards = site_shards(dep, Path(params.data), params.sync.skew, params.seed)
    load_shards(dep, shards, params.batch // dep.layout.replicas, params.seed)
