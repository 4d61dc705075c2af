"""Gradient averaging between the replicas of one stage: the collective, or the leader's star.

Plain averaging runs as a torch.distributed all-reduce among the replicas, bucketed and
overlapped with the backward, its group re-formed per step around a quorum
(:mod:`.dp_collective`, :mod:`.quorum`). :class:`GradientSync` picks it where the deployment
hosts a rendezvous store (``tp_store``) and the config does not ask for the star
(``dp_star``: ``benchmarks/parallel_modes.py`` runs both side by side). At ep > 1 the collective
takes the shared (non-expert) gradients only; the experts' are :mod:`.ep_worker`'s.

The star stays for what needs one party to see every update (the sync modes' secure
aggregation, robust aggregators and central privacy, :mod:`.outer_sync`) and for a worker without
a store. Replicas of one stage average through the stage's leader (replica 0) over the same
``Push`` channel: every replica sends its flattened gradient, the leader waits a bounded time and
sends the average back. The leader keeps the late-gradient policy in one place (``wait``: no bound
but the step's; ``skip``: average what arrived in time, re-weighted by the count, and send that to
everyone, the late replica included; ``restart``: tell every replica to drop the step, so that the
orchestrator runs it again). The averaged gradient stays in the module: the optimizer step is
applied only on ``Commit``, once every stage has finished the step.

The same star carries the sync modes' payloads (:meth:`GradientSync.exchange`: one round of
``SYNC_PART`` to the leader, ``SYNC_DOWN`` back, the leader combining them as the caller says).
A thin link between datacenters is modelled here too: with ``dp_link_mbps`` every data-parallel
send first waits for its bytes to go through a link of that rate (:class:`LinkShaper`), which
is how ``benchmarks/thin_links.py`` shapes the replicas' traffic (no ``tc`` needed: it runs
unprivileged, on one machine, and shapes only the data-parallel frames, not the pipeline's).

Fault injection for rehearsals and tests lives here too: ``slow_grads`` (see
:class:`dmsc.runtime.compute.config.WorkerConfig`) delivers a replica's gradient to its leader
late, as a slow link would (on the collective: its announcement to the step's quorum).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dmsc.runtime.compute.aggregators import summed
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.dp_collective import DataParallel, StepRestart
from dmsc.runtime.compute.expert_parallel import kind_of
from dmsc.runtime.compute.inbox import Inbox
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.compute.waiting import sleep_until
from dmsc.runtime.transport.messages import DEFAULT_GRAD_WAIT_S, LatePolicy, RunStep
from dmsc.runtime.transport.wire import ROUND_SLOTS, Kind, encode


class ExpertGrads(Protocol):
    """What averages the experts' gradients at ep > 1 (:class:`.ep_worker.ExpertRanks`, which
    imports this module through :mod:`.outer_sync`)."""

    def average_expert_grads(self, module: torch.nn.Module) -> None: ...


Combine = Callable[[dict[int, torch.Tensor]], torch.Tensor]
__all__ = ["GradientSync", "LinkShaper", "StepRestart", "assign_grads", "flatten_grads"]


def flatten_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient in one vector (zeros for a parameter without one)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )


def assign_grads(
    params: Sequence[torch.nn.Parameter], flat: torch.Tensor, copy: bool = True
) -> None:
    """Set each parameter's gradient from its slice of ``flat`` (the order of flatten_grads):
    copies, or views of ``flat`` where it is on their device and ``copy`` is False (``flat``
    the caller's own, used by nothing else, as DDP's ``gradient_as_bucket_view``)."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, copy=copy)
        offset += p.numel()


class LinkShaper:
    """A link of ``mbps`` Mbit/s out of this replica: a send of n bytes waits until the bytes
    before it and its own have gone through (serialisation at the link's rate, as a token
    bucket with no burst). ``mbps`` 0 is no limit."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6 / 8  # bytes/s
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes = 0  # sent through it, shaped or not

    def reserve(self, nbytes: int) -> float:
        """Book a send of ``nbytes`` without waiting: when (``time.monotonic()``) it is
        through the link (0: no limit)."""
        with self._lock:
            self.bytes += nbytes
            if self.rate <= 0:
                return 0.0
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.rate
            return self._free_at

    def take(self, nbytes: int) -> None:
        sleep_until(self.reserve(nbytes))


class SyncMode(Protocol):
    """A task's sync mode as :meth:`GradientSync.prepare` reads it
    (:class:`.outer_sync.ReplicaSync`)."""

    @property
    def quorum_ahead(self) -> bool: ...


class GradientSync:
    """This replica's part in averaging its stage's gradients: the leader's or a follower's."""

    def __init__(
        self,
        cfg: WorkerConfig,
        module: torch.nn.Module,
        peers: Peers,
        inbox: Inbox,
        tied: torch.nn.Parameter | None = None,
        experts: ExpertGrads | None = None,
    ) -> None:
        self.cfg = cfg
        self.module = module
        self.peers = peers
        self.inbox = inbox
        self._faults_fired: set[int] = set()
        self.link = LinkShaper(cfg.dp_link_mbps)
        self.round_policy: tuple[LatePolicy, float] = ("wait", DEFAULT_GRAD_WAIT_S)
        self.collective: DataParallel | None = None
        self.experts = experts  # ep > 1: the experts' gradients are averaged apart
        if cfg.replicas > 1 and cfg.tp_store and not cfg.dp_star:
            params = [p for n, p in module.named_parameters() if kind_of(n) == "dense"]
            self.collective = DataParallel(cfg, params, tied, peers, inbox, self.link)

    def prepare(self, m: RunStep, sync: SyncMode | None) -> None:
        """Before a training step: keep its late policy (a round's, ended by ``Commit``, takes
        it too) and arm the collective's hooks when the step's gradients are averaged plainly
        (no ``sync`` mode of :mod:`.outer_sync`, and not this replica's own task head), or,
        where the mode's exchange runs whole after the backward every step (its
        ``quorum_ahead``: a codec's by collective), arm them to agree on its quorum in the
        backward, as the buckets' is; else keep them quiet. Each chunk's parameters see one
        backward per micro-batch."""
        plain, ahead = sync is None, sync is not None and sync.quorum_ahead
        self.round_policy = (m.late_policy, m.grad_wait_s)
        own_head = (
            m.sync is not None and m.sync.task_heads and getattr(self.module, "is_last", False)
        )
        if self.collective is not None:
            if plain and not own_head:
                self.collective.begin(m.step, m.microbatches, m.late_policy, m.grad_wait_s)
            elif ahead and not own_head:  # restart is not a round's policy: read as wait
                policy = "wait" if m.late_policy == "restart" else m.late_policy
                self.collective.begin(m.step, m.microbatches, policy, m.grad_wait_s, False)
            else:
                self.collective.disarm()

    def sync(self, step: int, policy: LatePolicy, wait_s: float) -> list[int]:
        """Average the gradients of this stage's replicas: the collective's buckets armed by
        :meth:`prepare`, else through replica 0 (the leader). Returns the replicas whose
        gradient was left out (policy ``skip``). The step's exposed data-parallel time, what
        it waits here after the backward, goes on the step's meter (:mod:`.comm_meter`)."""
        with METER.timed("dp"):
            return self._sync(step, policy, wait_s)

    def _sync(self, step: int, policy: LatePolicy, wait_s: float) -> list[int]:
        if self.collective is not None and self.collective.armed:
            left_out = self.collective.finish()  # at ep > 1 the shared gradients only
            if self.experts is not None:
                self.experts.average_expert_grads(self.module)
            return left_out
        if self.experts is not None:  # the star would average one share's experts with another's
            raise ValueError(f"ep={self.cfg.ep}: the experts' gradients average by collective")
        params = list(self.module.parameters())
        flat = flatten_grads(params).cpu()  # averaged on the host, where the frames are
        late: list[int] = []
        if self.cfg.replica == 0:
            avg, late = self._lead(step, flat, policy, wait_s)
        else:
            avg = self._follow(step, flat)
        assign_grads(params, avg)
        return late

    def _lead(
        self, step: int, flat: torch.Tensor, policy: LatePolicy, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        cfg = self.cfg
        self.inbox.drop(Kind.GRAD_PART, before_step=step)
        bound = cfg.recv_timeout_s if policy == "wait" else wait_s
        deadline = time.monotonic() + bound
        parts, late = [flat], []
        for r in range(1, cfg.replicas):
            try:
                left = max(0.0, deadline - time.monotonic())
                parts.append(self.inbox.get(Kind.GRAD_PART, step, r, left))
            except TimeoutError:
                late.append(r)
        if late and policy == "wait":
            raise TimeoutError(f"stage {cfg.stage}: no gradient from replicas {late}")
        avg = torch.empty(0) if late and policy == "restart" else summed(parts) / len(parts)
        for r in range(1, cfg.replicas):
            frame = encode(Kind.GRAD_AVG, step, 0, avg, self.peers.epoch)
            self.link.take(len(frame))
            self.peers.count(Kind.GRAD_AVG, len(frame))
            if r not in late:
                self.peers.push((cfg.stage, r), frame)
            else:  # a late replica may be stalled: do not wait on it
                self.peers.push_detached((cfg.stage, r), frame)
        self.peers.flush()
        if not avg.numel():
            raise StepRestart(f"restart: stage {cfg.stage}, gradients of replicas {late} late")
        return avg, late

    def _follow(self, step: int, flat: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        slow = cfg.faults.get("slow_grads", {})
        if step in slow.get("steps", []) and step not in self._faults_fired:
            # A slow link: the gradient reaches the leader ``seconds`` late (once: a step run
            # again is on time). This replica goes on to wait for the average meanwhile.
            self._faults_fired.add(step)
            self._deliver_late(step, flat, float(slow.get("seconds", 0.0)))
        else:
            self.link.take(flat.numel() * flat.element_size())
            self.peers.send(cfg.stage, Kind.GRAD_PART, step, cfg.replica, flat, replica=0)
            self.peers.flush()
        avg = self.peers.recv(Kind.GRAD_AVG, step, 0)
        if not avg.numel():
            raise StepRestart(f"restart: stage {self.cfg.stage}, the leader dropped step {step}")
        return avg

    def _deliver_late(self, step: int, flat: torch.Tensor, seconds: float) -> None:
        frame = encode(Kind.GRAD_PART, step, self.cfg.replica, flat, self.peers.epoch)
        leader = self.peers.client(self.cfg.stage, 0)

        def deliver() -> None:
            with contextlib.suppress(Exception):
                leader.raw("Push", frame, timeout_s=10)

        threading.Timer(seconds, deliver).start()

    def exchange(
        self,
        step: int,
        round_: int,
        payload: torch.Tensor,
        combine: Combine,
        policy: LatePolicy,
        wait_s: float,
    ) -> tuple[torch.Tensor, list[int]]:
        """One round of a sync mode through the leader: every replica sends ``payload``; the
        leader calls ``combine`` with the payloads that arrived (by replica, its own included)
        and every replica gets its answer back. Returns the answer and the replicas left out
        (policy ``skip``; ``wait`` waits the receive timeout and then fails the step)."""
        cfg = self.cfg
        if cfg.replica != 0:
            self.link.take(payload.numel() * payload.element_size())
            mb = round_ * ROUND_SLOTS + cfg.replica
            self.peers.send(cfg.stage, Kind.SYNC_PART, step, mb, payload, replica=0)
            self.peers.flush()
            return self.peers.recv(Kind.SYNC_DOWN, step, round_ * ROUND_SLOTS), []
        bound = cfg.recv_timeout_s if policy != "skip" else wait_s
        deadline = time.monotonic() + bound
        parts, late = {0: payload}, []
        for r in range(1, cfg.replicas):
            try:
                left = max(0.0, deadline - time.monotonic())
                mb = round_ * ROUND_SLOTS + r
                parts[r] = self.inbox.get(Kind.SYNC_PART, step, mb, left)
            except TimeoutError:
                late.append(r)
        if late and policy != "skip":
            raise TimeoutError(f"stage {cfg.stage}: no update from replicas {late}")
        answer = combine(parts)
        for r in range(1, cfg.replicas):
            frame = encode(Kind.SYNC_DOWN, step, round_ * ROUND_SLOTS, answer, self.peers.epoch)
            self.link.take(len(frame))
            self.peers.count(Kind.SYNC_DOWN, len(frame))
            if r not in late:
                self.peers.push((cfg.stage, r), frame)
            else:
                self.peers.push_detached((cfg.stage, r), frame)
        self.peers.flush()
        return answer, late
