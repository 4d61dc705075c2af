"""The Service Mesh Orchestrator: deploys stage workers, hosts the registry, drives the steps.

A :class:`Deployment` starts one worker process per stage replica and tp rank through a
:class:`~dmsc.runtime.control.launch.launchers.Launcher` (the local one by default), waits until
each has registered, then runs training steps (tokens to the first stage, targets to the last, every
replica's ``RunStep`` at once, then ``Commit`` everywhere), evaluation and sampling, and saves and
loads consistent checkpoints. Workers find each other through the registry; the orchestrator only
pushes the data in and collects losses and timings. Every call to a worker is a typed message of
:mod:`dmsc.runtime.transport.messages` carrying the epoch the worker serves.

Failures. While a step runs, every call and every worker is watched
(:func:`dmsc.runtime.control.launch.failures.gather`): a failed call, an exited process or a silent
heartbeat raises :class:`~dmsc.runtime.control.launch.failures.WorkerFailure` at once.
:mod:`dmsc.runtime.control.launch.recovery` then brings the workers back. Since an optimizer step is
applied only by ``Commit`` after every stage finished, no step is applied twice.
"""

from __future__ import annotations

__all__ = ["Checkpoint", "Deployment", "StageLayout"]

import contextlib
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any

import grpc
import torch
from pydantic import BaseModel

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.comm_meter import (
    group_routing,
    replicas_exposed,
    with_commit,
    without_walls,
)
from dmsc.runtime.compute.expert_parallel import expert_parallel_groups
from dmsc.runtime.compute.frames import FrameSpec, check_frame
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch import failures, staging
from dmsc.runtime.control.launch.failures import Key, StepRestartNeeded, key_of
from dmsc.runtime.control.launch.forwarding import ForwardRequests
from dmsc.runtime.control.launch.launchers import Launcher, LocalLauncher, WorkerHandle
from dmsc.runtime.control.launch.layout import Checkpoint, StageLayout
from dmsc.runtime.control.launch.spares import SparePool
from dmsc.runtime.control.launch.tp_ranks import TensorRanks
from dmsc.runtime.transport import batched, logs
from dmsc.runtime.transport.messages import (
    DEFAULT_GRAD_WAIT_S,
    Abort,
    Commit,
    Health,
    LatePolicy,
    Load,
    RunStep,
    Schedule,
    SyncSettings,
)
from dmsc.runtime.transport.rpc import BadRequest, Client, serve
from dmsc.runtime.transport.wire import Kind, encode


class Deployment(ForwardRequests):
    """A running pipeline of stage workers and the registry they use. Worker logs go under
    ``home``/logs (default: the working directory)."""

    def __init__(
        self,
        layout: StageLayout,
        launcher: Launcher | None = None,
        workdir: Path | None = None,
        registry_ttl_s: float = 10.0,
        step_deadline_s: float = 300.0,
        spares: int = 0,
        home: Path | None = None,
    ) -> None:
        self.layout = layout
        self._tmp = tempfile.TemporaryDirectory(prefix="dmsc-") if workdir is None else None
        self.workdir: Path = Path(self._tmp.name) if self._tmp else Path(str(workdir))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.home: Path = home if home is not None else self.workdir
        self.launcher: Launcher = launcher or LocalLauncher(home=self.home)
        self.registry = Registry(ttl_s=registry_ttl_s)
        self.step_deadline_s = step_deadline_s
        self.start_s: float | None = None  # how long start() took its workers to serve
        self.token = secrets.token_urlsafe(24)  # the service credential: workers ask for it
        # the launcher says where workers can reach the registry (this machine's address)
        host = getattr(self.launcher, "control_host", "127.0.0.1")
        self.tp = TensorRanks(layout.tp, host, layout.replicas, layout.pp_groups(), self.token)
        self.server, port = serve(
            REGISTRY_SERVICE, registry_methods(self.registry), f"{host}:0", token=self.token
        )
        self.registry_address = f"{host}:{port}"
        self.handles: list[WorkerHandle] = []
        self._ending: set[Any] = set()  # EndSession calls in flight
        self.clients: dict[Key, Client] = {}
        self.epoch = 0  # the newest generation; each worker serves one (``epochs``)
        self.epochs: dict[Key, int] = {}
        self.abandoned: list[WorkerHandle] = []  # failed instances, fenced, reaped at shutdown
        self.spares = SparePool(
            spares,
            self.launcher,
            self.workdir,
            self.token,
            lambda sid: replace(self.config(0, 0), sid=sid, spare=True, log_file="", faults={}),
            datacenters=list(
                dict.fromkeys(layout.datacenters[k] for k in sorted(layout.datacenters))
            ),
        )
        # forwarding.ForwardRequests.in_turn: one lock per expert-parallel group (ep > 1)
        self.group_locks = [threading.RLock() for _ in range(0, layout.replicas, layout.ep)]
        self.local_batch = 0  # a replica's batch from its own shard (control.training.local_data)
        self.applied = False  # a training step was applied (see applies_in_step)
        self.threads = ThreadPoolExecutor(
            max_workers=max(4, 2 * len(layout.ranges) * layout.replicas * layout.tp)
        )

    @property
    def stages(self) -> int:
        return len(self.layout.ranges)

    def sid(self, stage: int, replica: int, tp_rank: int = 0) -> str:
        base = self.layout.sids[stage] if stage < len(self.layout.sids) else f"stage{stage}"
        return f"{base}-r{replica}" + (f"-t{tp_rank}" if self.layout.tp > 1 else "")

    def handle(self, key: Key) -> WorkerHandle:
        return next(h for h in self.handles if key_of(h) == key)

    def pipeline(self, replica: int) -> list[Key]:
        """The workers of one replica's pipeline, first stage first."""
        return [(s, replica) for s in range(self.stages)]

    def config(self, stage: int, replica: int, tp_rank: int = 0) -> WorkerConfig:
        """The configuration of the worker at (stage, replica, tp rank), at the current epoch."""
        lay = self.layout
        sid = self.sid(stage, replica, tp_rank)
        return WorkerConfig(
            sid=sid,
            stage=stage,
            stages=self.stages,
            model=lay.model.model_dump(),
            **lay.stage_fields(stage, replica),  # its layers, its all-reduce, its pipeline group
            registry=self.registry_address,
            replica=replica,
            replicas=lay.replicas,
            tp=lay.tp,
            tp_rank=tp_rank,
            tp_store=self.tp.address,
            ep=lay.ep,
            sequence_parallel=lay.sequence_parallel,
            seed=lay.seed,
            lr=lay.lr,
            epoch=self.epoch,
            token=self.token,
            log_file=str(logs.log_file(self.home, sid)),
            root=str(self.home),
            device=lay.devices.get((stage, replica), "cpu"),
            datacenter=lay.datacenters.get((stage, replica), "local"),
            cpus=lay.cpus.get((stage, replica), []),
            dp_link_mbps=lay.dp_link_mbps,
            pp_link_mbps=lay.pp_link_mbps(stage, replica, self.stages),
            faults=lay.faults.get(sid, {}) if self.epoch == 0 else {},  # the first incarnation's
        )

    def launch(self, cfgs: list[WorkerConfig]) -> list[WorkerHandle]:
        """Start a worker process for each of ``cfgs``, all at once."""
        return list(self.threads.map(lambda c: self.launcher.start(c, self.workdir), cfgs))

    def adopt(self, h: WorkerHandle) -> None:
        """Serve through ``h`` at its (stage, replica), in place of the worker there."""
        key = key_of(h)
        self.handles = [x for x in self.handles if key_of(x) != key]
        self.handles.append(h)
        self.handles.sort(key=key_of)
        old = self.clients.get(key)
        if old is not None:
            old.close()
        self.clients[key] = self.tp.client(h.address, self.token)
        self.epochs[key] = h.config.epoch

    def start(self) -> None:
        ranks = product(range(self.stages), range(self.layout.replicas), range(self.layout.tp))
        cfgs = [self.config(*k) for k in ranks]
        cfgs += [self.spares.new_config() for _ in range(self.spares.wanted)]
        self.launcher.prepare(cfgs)
        t0 = time.perf_counter()
        started = self.launch(cfgs)
        self.start_s = time.perf_counter() - t0  # all its workers serving (a move's restart)
        for h in started:  # a replica's ranks all at once: they meet in a group
            if h.config.spare:
                self.spares.add(h)
            elif h.config.tp_rank:
                self.tp.adopt(h, self.token)
            else:
                self.adopt(h)

    # -- failure detection (see dmsc.runtime.control.launch.failures) ---------------------------
    def suspects(self, keys: Collection[Key] | None = None) -> dict[Key, str]:
        """Workers (of ``keys``, default all) that exited or stopped heartbeating."""
        return failures.suspects(self, keys)

    def probe(self, timeout_s: float, keys: Collection[Key] | None = None) -> dict[Key, str]:
        """Workers (of ``keys``, default all) that do not answer Health within ``timeout_s``."""
        return failures.probe(self, timeout_s, keys)

    def gather(
        self, futures: dict[Key, Any], deadline_s: float, watch: Collection[Key] | None = None
    ) -> dict[Key, dict[str, Any]]:
        return failures.gather(self, futures, deadline_s, watch)

    def calls(
        self,
        method: str,
        message: Callable[[int], BaseModel],
        keys: Collection[Key],
        timeout_s: float,
    ) -> dict[Key, Any]:
        """Send ``method`` to every worker of ``keys`` without waiting; ``message(epoch)``
        builds each one's request with the epoch that worker serves."""
        return {
            k: self.tp.send(k, self.clients[k], method, message(self.epochs[k]), timeout_s)
            for k in keys
        }

    # -- data in ----------------------------------------------------------------------------
    def checked(self, key: Key, kind: Kind, t: torch.Tensor) -> torch.Tensor:
        """``t``, refused here as the worker at ``key`` would (the other stages would wait)."""
        m, s = self.layout.model, key[0]
        try:
            at = FrameSpec(s, s == 0, s == self.stages - 1, m.seq, m.vocab, m.hidden, n_params=0)
            check_frame(at, kind, t)
        except BadRequest as exc:
            raise failures.failure(self, f"stage {s} replica {key[1]}: {exc}", [key]) from None
        return t

    def started(
        self,
        run: Callable[[int], RunStep],
        tokens: torch.Tensor | None,
        targets: torch.Tensor | None,
        timeout_s: float,
    ) -> dict[Key, Any]:
        """A step's calls to every worker, sent at once: ``run(epoch)`` as a ``RunStep``, or as
        a ``RunWith`` carrying its replica's part of the batch where the stage starts from it
        (``tokens`` to the first stage, ``targets`` to the last: :mod:`...transport.batched`,
        one call where the frames were a ``Push`` each and the step another)."""
        keys, last = list(self.clients), self.stages - 1
        if tokens is None:
            return self.calls("RunStep", run, keys, timeout_s)
        xs = tokens.chunk(self.layout.replicas)
        ys = targets.chunk(self.layout.replicas) if targets is not None else None
        calls = {}
        for key in keys:
            m, (stage, r) = run(self.epochs[key]), key
            carried = [(Kind.TOKENS, xs[r])] if stage == 0 else []
            carried += [(Kind.TARGETS, ys[r])] if stage == last and ys is not None else []
            if not carried:
                calls[key] = self.tp.send(key, self.clients[key], "RunStep", m, timeout_s)
                continue
            frames = [
                encode(kind, m.step, 0, self.checked(key, kind, t), self.epochs[key])
                for kind, t in carried
            ]
            data = batched.pack(m, frames)
            calls[key] = self.tp.fan(key, self.clients[key], _pooled("RunWith", data, timeout_s))
        return calls

    # -- steps ------------------------------------------------------------------------------
    def train_step(
        self,
        step: int,
        tokens: torch.Tensor | None,
        targets: torch.Tensor | None,
        microbatches: int,
        schedule: Schedule = "1f1b",
        late_policy: LatePolicy = "wait",
        grad_wait_s: float = DEFAULT_GRAD_WAIT_S,
        lr: float | None = None,
        sync: SyncSettings | None = None,
        outer: bool = False,
    ) -> dict[str, Any]:
        """One training step of the global batch (drawn by each replica from its own shard when
        ``tokens`` is None); returns the loss and timings. The step is applied (``Commit``, at
        rate ``lr`` if given; ``outer`` ends a round of ``sync``) once every stage finished it,
        or by each stage as it finishes where :meth:`applies_in_step` says so."""
        t0 = time.perf_counter()
        if len(set(self.epochs.values())) > 1:  # a replica was healed alone: align everyone
            self.move_to_epoch(list(self.clients), self.epoch)
        at_once = self.applies_in_step(late_policy, sync, outer)

        def run(epoch: int) -> RunStep:
            return RunStep(
                step=step,
                microbatches=microbatches,
                schedule=schedule,
                train=True,
                late_policy=late_policy,
                grad_wait_s=grad_wait_s,
                epoch=epoch,
                sync=sync,
                local_batch=None if tokens is not None else self.local_batch,
                commit=Commit(step=step, epoch=epoch, lr=lr) if at_once else None,
            )

        keys = list(self.clients)
        try:  # the data goes with the calls (a round trip less a step)
            with self.in_turn():  # at ep > 1, no request's forward among the groups' calls
                calls = self.started(run, tokens, targets, self.step_deadline_s)
                replies = self.gather(calls, self.step_deadline_s)
        except StepRestartNeeded:
            # Drop the step everywhere: a new epoch fails what still runs and empties inboxes.
            self.epoch += 1
            self.move_to_epoch(keys, self.epoch)
            raise
        wait = self.step_deadline_s if outer else 30.0  # a round's exchange crosses the DCI
        if at_once:
            commits = {k: r["commit"] for k, r in replies.items()}
        else:
            commit = self.calls(
                "Commit", lambda e: Commit(step=step, epoch=e, lr=lr, outer=outer), keys, wait
            )
            commits = self.gather(commit, wait)
        self.applied = True
        losses = [r["loss"] for r in replies.values() if r.get("loss") is not None]
        skipped = sorted(
            {(k[0], x) for k, r in replies.items() for x in r.get("skipped_replicas", [])}
        )
        return {
            "loss": sum(losses) / len(losses),
            "step_s": time.perf_counter() - t0,
            "compute_s": {
                f"{k[0]}/{k[1]}": r["compute_s"] + commits[k]["compute_s"]
                for k, r in replies.items()
            },
            "skipped": skipped,
            "dp_bytes": sum(r.get("dp_bytes", 0) for r in commits.values()),
            "traces": {k: (r.get("spans", []), r.get("sent", {})) for k, r in replies.items()},
            "telemetry": {k: r["telemetry"] for k, r in replies.items() if "telemetry" in r},
            "comm": self.step_comm(replies, commits),
        }

    def step_comm(
        self, replies: dict[Key, dict[str, Any]], commits: dict[Key, dict[str, Any]]
    ) -> dict[Key, dict[str, dict[str, Any]]]:
        """Each worker's figures by mode, with a round's exchange its Commit ran, and the
        expert-parallel all-to-alls at each group's exposed time (:mod:`...comm_meter`)."""
        comm = {
            k: with_commit(r["comm"], commits[k].get("comm", {}))
            for k, r in replies.items()
            if "comm" in r
        }
        if self.layout.ep > 1:
            groups = expert_parallel_groups(self.layout.replicas, self.layout.ep)
            comm = group_routing(replicas_exposed(comm, "ep", groups), groups)
        return {k: without_walls(c) for k, c in comm.items()}

    def applies_in_step(
        self, late_policy: LatePolicy, sync: SyncSettings | None, outer: bool
    ) -> bool:
        """Whether each stage applies a training step as soon as its part is done, without a
        ``Commit`` round after the last stage finished (a round trip and a call per stage less
        a step; on this 2-core machine the last 6.8 ms of a 3-stage step of gpt-mini). Where a
        step fails half-way, some stages have then applied it and others not; the recovery
        brings the whole group back to a checkpoint, so no step is applied twice. That holds
        once a step was applied (a group that never applied one must hold its initial weights
        where no checkpoint exists) and where a step is dropped only by a failure: not under the
        ``restart`` policy (data-parallel replicas drop a late step and run it again, without a
        checkpoint), nor in a sync mode of rounds (a round's end exchanges the models)."""
        restarts = late_policy == "restart" and self.layout.replicas > 1
        return self.applied and not restarts and not (sync is not None and sync.outer) and not outer

    def eval_step(
        self, step: int, tokens: torch.Tensor, targets: torch.Tensor, microbatches: int
    ) -> float:
        """Loss of a batch without training (every replica, forward only)."""

        def run(epoch: int) -> RunStep:
            return RunStep(
                step=step, microbatches=microbatches, train=False, eval=True, epoch=epoch
            )

        with self.in_turn():
            replies = self.gather(self.started(run, tokens, targets, 300.0), 300.0)
        losses = [float(r["loss"]) for r in replies.values() if r.get("loss") is not None]
        return sum(losses) / len(losses)

    # -- checkpoints and epochs --------------------------------------------------------------
    def checkpoint(self, step: int, folder: Path | None = None, every: bool = False) -> Checkpoint:
        """Save every stage between two steps: replica 0 (replicas hold the same weights), or
        ``every`` replica (mid-round their weights and inner optimizers differ: sync modes)."""
        folder = folder or self.home / "checkpoints" / f"step{step}"  # Save writes below home
        with self.in_turn():  # at ep > 1 a Save gathers the experts over each group
            return staging.save_checkpoint(self, step, folder, every)  # whole, or nothing left

    def restore(self, ckpt: Checkpoint, keys: Collection[Key] | None = None) -> None:
        """Load ``ckpt`` into the workers (all by default); each file's hash is checked. A file
        missing or corrupt raises :class:`~dmsc.runtime.control.launch.failures.CheckpointRefused`
        naming every worker that refused, once every Load is over (so that no Load of this
        checkpoint lands after one of another)."""
        keys = list(self.clients) if keys is None else list(keys)

        def load(k: Key) -> Callable[[int], Load]:
            return lambda epoch: ckpt.load(*k, epoch)

        futures = {k: self.calls("Load", load(k), [k], 120.0)[k] for k in keys}
        try:
            self.gather(futures, 120.0)
        except failures.CheckpointRefused:
            refused = {}
            for k, fut in futures.items():
                exc = fut.exception()  # waits for the call to end
                if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DATA_LOSS:
                    refused[k] = str(exc.details())
            raise failures.CheckpointRefused(refused, ckpt.step) from None

    def move_to_epoch(self, keys: Collection[Key], epoch: int) -> list[Key]:
        """Abort the step in progress on ``keys`` and move them to ``epoch``; returns the
        workers that did not answer."""
        futures = self.calls("Abort", lambda _: Abort(epoch=epoch), keys, 5.0)
        lost = []
        for k, fut in futures.items():
            try:
                fut.result()
                self.epochs[k] = epoch
            except grpc.RpcError:
                lost.append(k)
        return lost

    def health(self) -> list[dict[str, Any]]:
        return [c.send("Health", Health(), timeout_s=5) for c in self.clients.values()]

    def shutdown(self) -> None:
        self.spares.wait_refills()  # a spare being started must not outlive the deployment
        for h in [*self.handles, *self.spares.handles]:
            self.launcher.stop(h)
        self.tp.stop(self.launcher)
        for h in [*self.abandoned, *self.spares.dead]:  # fenced (a frozen one ignores SIGTERM)
            with contextlib.suppress(Exception):
                h.process.kill()
                h.process.wait(timeout=10)
        self.launcher.close()
        for c in self.clients.values():
            c.close()
        self.server.stop(grace=1)
        self.threads.shutdown(wait=False)
        if self._tmp:
            self._tmp.cleanup()

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:  # what did start (workers, reserved devices) must not leak
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pooled(method: str, data: bytes, timeout_s: float) -> Callable[[Client], Any]:
    """The call of ``method`` with ``data`` on a client, without waiting (its future)."""
    return lambda c: c.raw_pooled(method, data, timeout_s)
