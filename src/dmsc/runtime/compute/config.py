"""A stage worker's configuration: what the launcher writes as a JSON file for each process.

It lives apart from :mod:`dmsc.runtime.compute.worker` (the process entry, which re-exports it)
because the server builds one from an ``Assume`` request, and the worker module imports the
server: one module each way would be an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerConfig:
    """What a worker needs to start (written by the launcher as a JSON file)."""

    sid: str
    stage: int
    stages: int
    model: dict[str, Any]
    first: str
    last: str
    registry: str
    # an interleaved stage's chunks, [first, last] each in chain order (first .. last being the
    # first chunk's); empty: the one range first .. last
    chunks: list[list[str]] = field(default_factory=list)
    replica: int = 0
    replicas: int = 1
    # tensor parallelism: this process is rank tp_rank of its replica's tp ranks, whose
    # process group meets through the deployment's TCPStore at tp_store (host:port); the
    # replicas' data-parallel groups meet there too
    tp: int = 1
    tp_rank: int = 0
    tp_store: str = ""
    # expert parallelism: replica r holds share r % ep of the experts and exchanges tokens with
    # its expert-parallel group of ep replicas (dmsc.runtime.compute.ep_worker), met at tp_store
    ep: int = 1
    # at tp > 1, the residual stream between the blocks' sub-layers split along the sequence
    # over the tp ranks (dmsc.runtime.compute.sequence_parallel)
    sequence_parallel: bool = False
    # average plain data-parallel gradients through the stage leader (the star) rather than
    # by all-reduce (benchmarks/parallel_modes.py compares the two)
    dp_star: bool = False
    # the plan's all-reduce algorithm for the replicas' gradients: ring, tree or hierarchical
    # (by datacenter), dmsc.runtime.compute.allreduce; auto is the ring
    allreduce: str = "auto"
    seed: int = 0
    lr: float = 1e-3
    epoch: int = 0  # the deployment generation this worker was launched in
    spare: bool = False  # a warm spare: registered as such, takes a stage over on ``Assume``
    datacenter: str = "local"
    host: str = "127.0.0.1"  # the address it serves on and registers (its node's, on Ray)
    recv_timeout_s: float = 60.0
    max_message_bytes: int = 64 * 1024 * 1024
    threads: int = 1
    # the cores it runs on (its node's cpuset, .cpuset; empty: wherever the OS puts it)
    cpus: list[int] = field(default_factory=list)
    # cpu, or cuda:N (the plan's GPU on this node); several stages may share one GPU
    device: str = "cpu"
    # Inference sessions a stage keeps keys and values for, and how long an idle one is kept.
    max_sessions: int = 64
    session_idle_s: float = 300.0
    token: str | None = None  # the deployment's service credential
    # Its leaf certificate (SID@epoch), key and CA, PEM (dmsc.runtime.transport.authority):
    # issued by the control plane at its start, never written to a file others may read.
    tls: dict[str, str] | None = None
    # The checkpoint key (hex) when checkpoints are sealed (.sealing), delivered the same way.
    checkpoint_key: str | None = None
    # The process that launched it (0: its parent): once that one is gone and the registry no
    # longer answers, the worker leaves.
    owner_pid: int = 0
    # A parent whose end must kill the worker at once (0: none): the Ray actor that started it,
    # so a worker whose actor went with its node does not serve on as an orphan.
    die_with_parent: int = 0
    log_file: str = ""
    # The deployment's directory: Save writes only below it (empty: anywhere, for tests that
    # build a worker by hand).
    root: str = ""  # JSON log lines go here, rotated (see dmsc.runtime.transport.logs)
    # Fault injection for rehearsals and tests: {"slow_grads": {"steps": [3], "seconds": 2.0}}
    # delivers this replica's gradient to the stage leader late, as a slow link would;
    # {"hang_health": 60} makes Health hang that long while heartbeats go on (a stuck worker);
    # {"poison": {"scale": -100}} multiplies every update this replica sends under a sync mode
    # (sign-flipped and scaled: the attack robust aggregators are for).
    faults: dict[str, Any] = field(default_factory=dict)
    # A bandwidth limit on this replica's data-parallel sends (gradients, sync payloads), in
    # Mbit/s (0: none): a thin link between datacenters, modelled in the data plane.
    dp_link_mbps: float = 0.0
    # The same for its pipeline sends, by neighbouring stage ("1": 20.0): the link between
    # this worker's datacenter and that stage's, when it is a thin one.
    pp_link_mbps: dict[str, float] = field(default_factory=dict)
    # Its replica's stages share one datacenter and no shaped link: a training step's
    # activations and gradients go over a gloo group of the pipeline met at tp_store
    # (dmsc.runtime.compute.pipe_group), not over gRPC (StageLayout.pp_gloo asked for it).
    pp_group: bool = False
    # The same, over a TCP stream to each neighbouring stage (dmsc.runtime.compute.pipe_stream),
    # whose listener also answers step calls (dmsc.runtime.transport.stream_calls), a single
    # stage's too
    pp_stream: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def ranges(self) -> list[tuple[str, str]]:
        """The layer ranges this worker holds: its chunks, or first .. last."""
        return [(a, b) for a, b in self.chunks] if self.chunks else [(self.first, self.last)]
