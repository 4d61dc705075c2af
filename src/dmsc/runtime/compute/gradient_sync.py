"""Gradient averaging between the replicas of one stage, through the stage's leader.

Replicas of one stage average their gradients through the stage's leader (replica 0) over the same
``Push`` channel: every replica sends its flattened gradient, the leader waits a bounded time and
sends the average back. A torch.distributed (gloo) all-reduce did this before; it was replaced
because a gloo group is fixed at start: a collective with a dead or late member can only time out
the whole group, it cannot skip the late replica, and admitting a replacement means re-forming the
group on every member. The leader keeps the late-gradient policy in one place (``wait``: no bound
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
late, as a slow link would.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.inbox import Inbox
from dmsc.runtime.compute.peers import Peers
from dmsc.runtime.transport.messages import LatePolicy
from dmsc.runtime.transport.rpc import Abandoned
from dmsc.runtime.transport.wire import ROUND_SLOTS, Kind, encode

Combine = Callable[[dict[int, torch.Tensor]], torch.Tensor]


class StepRestart(Abandoned):
    """The stage leader dropped the step (late gradients, policy ``restart``)."""


def flatten_grads(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient in one vector (zeros for a parameter without one)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )


def assign_grads(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set each parameter's gradient from its slice of ``flat`` (the order of flatten_grads)."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, copy=True)
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

    def take(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            if self.rate <= 0:
                return
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.rate
            until = self._free_at
        time.sleep(max(0.0, until - time.monotonic()))


class GradientSync:
    """This replica's part in averaging its stage's gradients: the leader's or a follower's."""

    def __init__(
        self, cfg: WorkerConfig, module: torch.nn.Module, peers: Peers, inbox: Inbox
    ) -> None:
        self.cfg = cfg
        self.module = module
        self.peers = peers
        self.inbox = inbox
        self._faults_fired: set[int] = set()
        self.link = LinkShaper(cfg.dp_link_mbps)

    def sync(self, step: int, policy: LatePolicy, wait_s: float) -> list[int]:
        """Average the gradients of this stage's replicas through replica 0 (the leader).
        Returns the replicas whose gradient was left out (policy ``skip``)."""
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
        avg = torch.empty(0) if late and policy == "restart" else torch.stack(parts).mean(0)
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
