"""What a deployment runs (:class:`StageLayout`) and a consistent snapshot of it
(:class:`Checkpoint`): plain data, shared by the orchestrator and the modules around it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dmsc.runtime.transport.messages import Load
from dmsc.spec import TransformerSpec


@dataclass
class StageLayout:
    """What to deploy: a model, its stage layer ranges, data parallelism."""

    model: TransformerSpec
    ranges: list[tuple[str, str]]  # first and last layer of each stage (its first chunk's)
    # an interleaved pipeline's chunks: each stage's layer ranges, in chain order (chunk c of
    # stage s is the model's chunk c pp + s); empty: each stage runs its one range
    chunks: list[list[tuple[str, str]]] = field(default_factory=list)
    replicas: int = 1
    tp: int = 1  # tensor-parallel ranks of each replica: one worker process each
    ep: int = 1  # expert-parallel degree: runs of ep replicas share out the experts
    sequence_parallel: bool = False  # at tp > 1, the blocks' sequence split over the ranks too
    # each stage's data-parallel all-reduce (the plan's stages[].allreduce); none: auto (ring)
    allreduce: dict[int, str] = field(default_factory=dict)
    seed: int = 0
    lr: float = 1e-3
    sids: list[str] = field(default_factory=list)
    faults: dict[str, dict[str, Any]] = field(default_factory=dict)  # SID -> worker faults
    devices: dict[tuple[int, int], str] = field(default_factory=dict)  # (stage, replica): cpu
    datacenters: dict[tuple[int, int], str] = field(default_factory=dict)  # "local" if none
    # (stage, replica): the cores its workers run on, its nodes' cpusets (none: not pinned)
    cpus: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    # the workers run on this machine: where the spec's devices share its cores, packed onto them
    pack_cores: bool = False
    # a bandwidth limit on what data-parallel replicas send each other (0: none); a thin
    # link between datacenters, shaped in the data plane (benchmarks/thin_links.py)
    dp_link_mbps: float = 0.0
    # thin links between datacenters for the pipeline's sends: {(dc, dc): Mbit/s}, either way
    link_mbps: dict[tuple[str, str], float] = field(default_factory=dict)
    # a replica whose stages share one datacenter sends its training steps' activations and
    # gradients over gloo point-to-point (dmsc.runtime.compute.pipe_group); off by default: it
    # measured no faster than gRPC on this 2-core machine (benchmarks/pipeline_vs_torch.py
    # --gloo, quiet machine: 0.98 of gRPC's step, inside the rounds' spread), and a gloo group
    # would bypass the workers' mutual TLS
    pp_gloo: bool = False
    # the same over a TCP stream to each neighbouring stage (dmsc.runtime.compute.pipe_stream,
    # mutual TLS where the workers hold certificates); on by default: a step of
    # benchmarks/pipeline_vs_torch.py --stream took 0.865 of gRPC's (by round 0.78-0.93)
    pp_stream: bool = True

    @property
    def tokens_in_flight(self) -> int:
        """Tokens of different requests a replica's pipeline works on at once: one at each
        stage and one being drawn at the control plane, where each worker runs the calls that
        reach it in any order (:class:`~dmsc.runtime.control.serving.turns.FairLock`'s width).
        One where a call's order matters: tensor-parallel ranks pair their all-reduces and
        expert-parallel replicas their all-to-alls call by call, and an interleaved stage waits
        inside a call for its own chunk's input from a later stage."""
        if self.tp > 1 or self.ep > 1 or self.chunks:
            return 1
        return len(self.ranges) + 1

    def stage_fields(self, stage: int, replica: int = 0) -> dict[str, Any]:
        """A worker configuration's fields of ``stage`` (of ``replica``): its layers (first and
        last, and its chunks), the all-reduce its replicas average with, and whether its
        pipeline sends go over a gloo group (:meth:`pp_group`)."""
        chunks = self.chunks[stage] if self.chunks else []
        first, last = chunks[0] if chunks else self.ranges[stage]
        allreduce = self.allreduce.get(stage, "auto")
        return {"first": first, "last": last, "chunks": [list(c) for c in chunks],
                "allreduce": allreduce, "pp_group": self.pp_group(replica),
                "pp_stream": self.pp_stream_of(replica)}  # fmt: skip

    def _one_site(self, replica: int) -> bool:
        """Whether the stages of ``replica`` are all in one datacenter (so that no link
        between them is shaped)."""
        places = {self.datacenters.get((s, replica), "local") for s in range(len(self.ranges))}
        return len(places) == 1

    def pp_group(self, replica: int) -> bool:
        """Whether the pipeline of ``replica`` (of several stages) meets in a gloo group."""
        return self.pp_gloo and len(self.ranges) > 1 and self._one_site(replica)

    def pp_stream_of(self, replica: int) -> bool:
        """Whether the workers of ``replica`` listen for streams (gloo's group first): their
        pipeline's frames, and the step calls made to them (also with a single stage)."""
        return self.pp_stream and not self.pp_gloo and self._one_site(replica)

    def pp_groups(self) -> bool:
        """Whether any replica's pipeline meets in a gloo group or over streams (the store
        must be hosted)."""
        return any(self.pp_group(r) or self.pp_stream_of(r) for r in range(self.replicas))

    def pp_link_mbps(self, stage: int, replica: int, stages: int) -> dict[str, float]:
        """The rate of the link from worker (stage, replica) to each neighbouring stage's
        replica, where ``link_mbps`` names the two datacenters (none: no limit); interleaved,
        the last stage and the first are neighbours too (chunk to chunk)."""
        here = self.datacenters.get((stage, replica), "local")
        out = {}
        around = (stage - 1) % stages, (stage + 1) % stages
        for other in (stage - 1, stage + 1, *(around if self.chunks else ())):
            there = self.datacenters.get((other, replica), "local")
            mbps = self.link_mbps.get((here, there)) or self.link_mbps.get((there, here))
            if 0 <= other < stages and here != there and mbps:
                out[str(other)] = mbps
        return out


@dataclass
class Checkpoint:
    """A consistent snapshot: every stage saved between the same two steps."""

    step: int
    files: dict[int, tuple[str, str]]  # stage -> (path, sha256)
    id: int | None = None  # its database record, when it has one
    # (stage, replica) -> (path, sha256) of the other replicas, when every one was saved
    replicas: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, step: int, saved: dict[tuple[int, int], dict[str, Any]]) -> Checkpoint:
        """The checkpoint of the workers' ``Save`` answers, by (stage, replica)."""
        files = {k: (r["path"], r["sha256"]) for k, r in saved.items()}
        stages = {s: f for (s, r), f in files.items() if not r}
        return cls(step, stages, replicas={k: f for k, f in files.items() if k[1]})

    def load(self, stage: int, replica: int, epoch: int) -> Load:
        """The ``Load`` of worker (stage, replica): its own file (replica 0's of its stage when
        it has none), with every stage file of replica 0 beside it, where a stage cut
        otherwise than the checkpoint's (interleaved or plain) finds the rest of its layers."""
        own = self.files.get(stage) or self.files[min(self.files)]
        path, sha = self.replicas.get((stage, replica), own)
        others = {p: s for p, s in self.files.values() if p != path}
        return Load(path=path, sha256=sha, epoch=epoch, others=others)

    def files_json(self) -> str:
        """Its files as the database keeps them: ``{"STAGE": [path, sha], "S/REPLICA": ...}``."""
        out = {str(s): list(f) for s, f in self.files.items()}
        return json.dumps(out | {f"{s}/{r}": list(f) for (s, r), f in self.replicas.items()})

    @classmethod
    def from_json(cls, step: int, files_json: str, id: int | None = None) -> Checkpoint:
        """A checkpoint of the database (:meth:`files_json`)."""
        files: dict[int, tuple[str, str]] = {}
        replicas: dict[tuple[int, int], tuple[str, str]] = {}
        for key, (path, sha) in json.loads(files_json).items():
            stage, _, replica = key.partition("/")
            if replica:
                replicas[(int(stage), int(replica))] = (path, sha)
            else:
                files[int(stage)] = (path, sha)
        return cls(step, files, id, replicas)
