"""What a deployment runs (:class:`StageLayout`) and a consistent snapshot of it
(:class:`Checkpoint`): plain data, shared by the orchestrator and the modules around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dmsc.spec import TransformerSpec


@dataclass
class StageLayout:
    """What to deploy: a model, its stage layer ranges, data parallelism."""

    model: TransformerSpec
    ranges: list[tuple[str, str]]  # first and last layer of each stage
    replicas: int = 1
    seed: int = 0
    lr: float = 1e-3
    sids: list[str] = field(default_factory=list)
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)  # SID -> worker faults
    devices: dict[tuple[int, int], str] = field(default_factory=dict)  # (stage, replica): cpu
    datacenters: dict[tuple[int, int], str] = field(default_factory=dict)  # "local" if none
    # a bandwidth limit on what data-parallel replicas send each other (0: none); a thin
    # link between datacenters, shaped in the data plane (benchmarks/thin_links.py)
    dp_link_mbps: float = 0.0


@dataclass
class Checkpoint:
    """A consistent snapshot: every stage saved between the same two steps."""

    step: int
    files: dict[int, tuple[str, str]]  # stage -> (path, sha256)
    id: int | None = None  # its database record, when it has one
