"""The Service Mesh Orchestrator: deploys stage workers, hosts the registry, drives the steps.

A :class:`Deployment` starts one worker process per stage replica through a :class:`Launcher`
(:class:`LocalLauncher` runs them on this machine), waits until each has registered, then runs
training steps (tokens to the first stage, targets to the last, every replica's ``RunStep`` at
once, then ``Commit`` everywhere) and sampling. Workers find each other through the registry; the
orchestrator only pushes the data in and collects losses and timings.

Failures. While a step runs the orchestrator watches every call and every worker: a call that
fails, a process that exits, or a registry heartbeat older than the TTL (default 10 s, heartbeats
every TTL/3) marks the worker failed at once and raises :class:`WorkerFailure`, which names the
stage and SID. :meth:`Deployment.recover` then fences the failed incarnation (its SID is refused
below the new epoch), moves the survivors to a new epoch (their step in progress fails and their
stale frames are dropped), launches a replacement, and loads the last consistent checkpoint into
every worker. Since an optimizer step is applied only by ``Commit`` after every stage finished,
no step is applied twice; the steps after the checkpoint are run again.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import grpc
import torch

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.transport.messages import STAGE_SERVICE
from dmsc.runtime.transport.rpc import Client, serve
from dmsc.runtime.transport.wire import Kind, encode
from dmsc.spec import TransformerSpec


@dataclass
class WorkerHandle:
    config: WorkerConfig
    process: subprocess.Popen[str]
    address: str


class Launcher(Protocol):
    """Starts and stops worker processes somewhere."""

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle: ...

    def stop(self, handle: WorkerHandle) -> None: ...

    def alive(self, handle: WorkerHandle) -> bool: ...

    def exit_reason(self, handle: WorkerHandle) -> str: ...


class LocalLauncher:
    """Worker processes on this machine (``python -m dmsc.runtime.compute.worker``)."""

    def __init__(self, ready_timeout_s: float = 60.0) -> None:
        self.ready_timeout_s = ready_timeout_s

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle:
        path = workdir / f"{cfg.sid}.json"
        path.write_text(json.dumps(asdict(cfg)))
        with open(workdir / f"{cfg.sid}.log", "w") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                [sys.executable, "-m", "dmsc.runtime.compute.worker", "--config", str(path)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until READY or exit
        if not line.startswith("READY "):
            proc.kill()
            raise RuntimeError(f"worker {cfg.sid} failed to start (see {workdir / cfg.sid}.log)")
        return WorkerHandle(cfg, proc, line.split()[1])

    def stop(self, handle: WorkerHandle) -> None:
        handle.process.terminate()
        try:
            handle.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            handle.process.kill()
            handle.process.wait(timeout=10)

    def alive(self, handle: WorkerHandle) -> bool:
        return handle.process.poll() is None

    def exit_reason(self, handle: WorkerHandle) -> str:
        code = handle.process.poll()
        return f"exited (signal {-code})" if code is not None and code < 0 else f"exited ({code})"


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


Key = tuple[int, int]  # (stage, replica)


class WorkerFailure(RuntimeError):
    """Workers that failed (possibly none identified) and why; ``at`` is the detection time."""

    def __init__(self, failed: dict[Key, str], sids: dict[Key, str], reason: str = "") -> None:
        self.failed = failed
        self.at = time.time()
        parts = [
            f"stage {k[0]} replica {k[1]} ({sids.get(k, '?')}): {r}" for k, r in failed.items()
        ]
        super().__init__("; ".join(parts) or reason or "a step failed")


class StepRestartNeeded(RuntimeError):
    """A stage leader dropped the step (late gradients, policy ``restart``); nothing applied."""


@dataclass
class Checkpoint:
    """A consistent snapshot: every stage saved between the same two steps."""

    step: int
    files: dict[int, tuple[str, str]]  # stage -> (path, sha256)


@dataclass
class Recovery:
    """What one recovery did, for the report and the exception queue."""

    failed: list[str]
    reason: str
    detected_at: float
    recovered_at: float
    checkpoint_step: int
    epoch: int


def _rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


class Deployment:
    """A running pipeline of stage workers and the registry they use."""

    def __init__(
        self,
        layout: StageLayout,
        launcher: Launcher | None = None,
        workdir: Path | None = None,
        registry_ttl_s: float = 10.0,
        step_deadline_s: float = 300.0,
        spares: int = 0,
    ) -> None:
        self.layout = layout
        self.launcher = launcher or LocalLauncher()
        self._tmp = tempfile.TemporaryDirectory(prefix="dmsc-") if workdir is None else None
        self.workdir: Path = Path(self._tmp.name) if self._tmp else Path(str(workdir))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(ttl_s=registry_ttl_s)
        self.step_deadline_s = step_deadline_s
        # The service credential of this deployment: workers refuse calls without it.
        self.token = secrets.token_urlsafe(24)
        self.server, port = serve(
            REGISTRY_SERVICE, registry_methods(self.registry), token=self.token
        )
        self.registry_address = f"127.0.0.1:{port}"
        self.handles: list[WorkerHandle] = []
        self.clients: dict[Key, Client] = {}
        self.epoch = 0  # the newest generation; each worker serves one (``epochs``)
        self.epochs: dict[Key, int] = {}
        self.abandoned: list[WorkerHandle] = []  # failed instances, fenced, reaped at shutdown
        self.recoveries: list[Recovery] = []
        # Warm spares: worker processes started ahead, each can take any stage over (``Assume``)
        # in a fraction of a process start. The pool is refilled after each use.
        self.spares_wanted = spares
        self.spares: list[WorkerHandle] = []
        self._spare_lock = threading.Lock()
        self._spare_count = 0
        self._refills: list[Any] = []
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(layout.ranges) * layout.replicas))

    @property
    def stages(self) -> int:
        return len(self.layout.ranges)

    def sid(self, stage: int, replica: int) -> str:
        base = self.layout.sids[stage] if stage < len(self.layout.sids) else f"stage{stage}"
        return f"{base}-r{replica}"

    def handle(self, key: Key) -> WorkerHandle:
        return next(h for h in self.handles if (h.config.stage, h.config.replica) == key)

    def _config(self, stage: int, replica: int, epoch: int) -> WorkerConfig:
        lay = self.layout
        first, last = lay.ranges[stage]
        sid = self.sid(stage, replica)
        return WorkerConfig(
            sid=sid,
            stage=stage,
            stages=self.stages,
            model=lay.model.model_dump(),
            first=first,
            last=last,
            registry=self.registry_address,
            replica=replica,
            replicas=lay.replicas,
            seed=lay.seed,
            lr=lay.lr,
            epoch=epoch,
            token=self.token,
            faults=lay.faults.get(sid, {}) if epoch == 0 else {},  # the first incarnation's
        )

    def _adopt(self, h: WorkerHandle) -> None:
        key = (h.config.stage, h.config.replica)
        self.handles = [x for x in self.handles if (x.config.stage, x.config.replica) != key]
        self.handles.append(h)
        self.handles.sort(key=lambda x: (x.config.stage, x.config.replica))
        old = self.clients.get(key)
        if old is not None:
            old.close()
        self.clients[key] = Client(h.address, STAGE_SERVICE, token=self.token)
        self.epochs[key] = h.config.epoch

    def start(self) -> None:
        cfgs = [
            self._config(s, r, self.epoch)
            for s in range(self.stages)
            for r in range(self.layout.replicas)
        ]
        cfgs += [self._spare_config() for _ in range(self.spares_wanted)]
        for h in self.pool.map(lambda c: self.launcher.start(c, self.workdir), cfgs):
            if h.config.spare:
                self.spares.append(h)
            else:
                self._adopt(h)

    def _spare_config(self) -> WorkerConfig:
        with self._spare_lock:
            self._spare_count += 1
            n = self._spare_count
        return replace(self._config(0, 0, self.epoch), sid=f"spare-{n}", spare=True)

    def _refill_spares(self) -> None:
        while True:
            with self._spare_lock:
                if len(self.spares) >= self.spares_wanted:
                    return
            h = self.launcher.start(self._spare_config(), self.workdir)
            with self._spare_lock:
                self.spares.append(h)

    def _take_spare(self, cfg: WorkerConfig) -> WorkerHandle | None:
        """A spare that has taken over ``cfg``'s stage, or None when no spare could."""
        while True:
            with self._spare_lock:
                if not self.spares:
                    return None
                spare = self.spares.pop(0)
            client = Client(spare.address, STAGE_SERVICE, token=self.token)
            try:
                client.call("Assume", {"config": asdict(cfg)}, timeout_s=30)
            except grpc.RpcError:  # a dead spare: drop it, try the next
                self.abandoned.append(spare)
                continue
            finally:
                client.close()
            return WorkerHandle(cfg, spare.process, spare.address)

    # -- failure detection ------------------------------------------------------------------
    def suspects(self, keys: Collection[Key] | None = None) -> dict[Key, str]:
        """Workers (of ``keys``, default all) that are not alive: exited, or silent in the
        registry past its TTL."""
        out: dict[Key, str] = {}
        ttl = self.registry.ttl_s
        for h in self.handles:
            key = (h.config.stage, h.config.replica)
            if keys is not None and key not in keys:
                continue
            if not self.launcher.alive(h):
                out[key] = self.launcher.exit_reason(h)
                continue
            age = self.registry.heartbeat_age(h.config.sid)
            if age is None or age > ttl:
                out[key] = (
                    "no heartbeat for the registry TTL"
                    if age is None
                    else (f"no heartbeat for {age:.1f} s (TTL {ttl:g} s)")
                )
        return out

    def probe(self, timeout_s: float, keys: Collection[Key] | None = None) -> dict[Key, str]:
        """Workers (of ``keys``, default all) that do not answer Health within ``timeout_s``: a
        worker can heartbeat and still be stuck."""
        keys = list(self.clients) if keys is None else list(keys)
        futures = {k: self.clients[k].raw_future("Health", b"{}", timeout_s) for k in keys}
        out = {}
        for k, fut in futures.items():
            try:
                fut.result()
            except grpc.RpcError as exc:
                out[k] = f"no answer to Health within {timeout_s:g} s ({exc.code().name})"
        return out

    def _failure(
        self, reason: str, keys: Collection[Key], culprits: dict[Key, str] | None = None
    ) -> WorkerFailure:
        """The failure to raise after ``reason``: the workers of ``keys`` found dead, if any."""
        failed = dict(culprits or {})
        deadline = time.monotonic() + 1.0  # an exit may take a moment to be seen
        while not failed and time.monotonic() < deadline:
            failed = self.suspects(keys)
            if not failed:
                time.sleep(0.05)
        sids = {(h.config.stage, h.config.replica): h.config.sid for h in self.handles}
        return WorkerFailure(failed, sids, reason)

    def _gather(self, futures: dict[Key, Any], deadline_s: float) -> dict[Key, dict[str, Any]]:
        """Wait for calls to every worker in ``futures``, watching the workers meanwhile.
        Raises :class:`WorkerFailure` at the first sign of one, :class:`StepRestartNeeded` when a
        stage leader dropped the step."""
        end = time.monotonic() + deadline_s
        replies: dict[Key, dict[str, Any]] = {}
        pending = dict(futures)
        wake = threading.Event()  # grpc futures are not concurrent.futures ones: a callback
        for fut in futures.values():
            fut.add_done_callback(lambda _: wake.set())
        while pending:
            wake.wait(0.1)
            wake.clear()
            for key in [k for k, f in pending.items() if f.done()]:
                fut = pending.pop(key)
                exc = fut.exception()
                if exc is None:
                    replies[key] = json.loads(fut.result())
                    continue
                details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                if _rpc_code(exc) == grpc.StatusCode.ABORTED and details.startswith("restart:"):
                    raise StepRestartNeeded(details)
                if _rpc_code(exc) == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RuntimeError(f"stage {key[0]} replica {key[1]} refused: {details}")
                raise self._failure(f"stage {key[0]} replica {key[1]}: {details}", futures)
            found = self.suspects(futures)
            if found:
                raise self._failure("", futures, found)
            if time.monotonic() > end:
                slow = {k: "missed the step deadline" for k in pending}
                raise self._failure("step deadline", futures, slow)
        return replies

    def _calls(
        self, method: str, req: dict[str, Any], keys: list[Key], timeout_s: float
    ) -> dict[Key, Any]:
        futures = {}
        for key in keys:
            body = json.dumps({**req, "epoch": self.epochs[key]}).encode()
            futures[key] = self.clients[key].raw_future(method, body, timeout_s=timeout_s)
        return futures

    # -- data in ----------------------------------------------------------------------------
    def _push(
        self, stage: int, replica: int, kind: Kind, step: int, mb: int, t: torch.Tensor
    ) -> Any:
        frame = encode(kind, step, mb, t, self.epochs[(stage, replica)])
        return self.clients[(stage, replica)].raw_future("Push", frame)

    def _feed(self, step: int, tokens: torch.Tensor, targets: torch.Tensor | None, m: int) -> None:
        """Tokens to the first stage and targets to the last, all frames in flight at once."""
        sent = []
        R = self.layout.replicas
        for r, (xr, yr) in enumerate(
            zip(
                tokens.chunk(R),
                (targets.chunk(R) if targets is not None else [None] * R),
                strict=True,
            )
        ):
            for i, x in enumerate(xr.chunk(m)):
                sent.append(((0, r), self._push(0, r, Kind.TOKENS, step, i, x)))
            if yr is not None:
                for i, y in enumerate(yr.chunk(m)):
                    sent.append(
                        (
                            (self.stages - 1, r),
                            self._push(self.stages - 1, r, Kind.TARGETS, step, i, y),
                        )
                    )
        for key, fut in sent:
            try:
                fut.result()
            except grpc.RpcError as exc:
                keys = {k for k, _ in sent}
                raise self._failure(
                    f"stage {key[0]} replica {key[1]}: {exc.details()}", keys
                ) from None

    def train_step(
        self,
        step: int,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        microbatches: int,
        schedule: str = "1f1b",
        late_policy: str = "wait",
        grad_wait_s: float = 5.0,
    ) -> dict[str, Any]:
        """One training step of the global batch; returns the loss and timings. The step is
        applied (``Commit``) only once every stage has finished it."""
        t0 = time.perf_counter()
        if len(set(self.epochs.values())) > 1:  # a replica was healed alone: align everyone
            self._move_to_epoch(list(self.clients), self.epoch)
        self._feed(step, tokens, targets, microbatches)
        req = {
            "step": step,
            "microbatches": microbatches,
            "schedule": schedule,
            "train": True,
            "late_policy": late_policy,
            "grad_wait_s": grad_wait_s,
        }
        keys = list(self.clients)
        try:
            replies = self._gather(
                self._calls("RunStep", req, keys, self.step_deadline_s), self.step_deadline_s
            )
        except StepRestartNeeded:
            # Drop the step everywhere: a new epoch fails what still runs and empties inboxes.
            self.epoch += 1
            self._move_to_epoch(keys, self.epoch)
            raise
        commits = self._gather(self._calls("Commit", {"step": step}, keys, 30.0), 30.0)
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
        }

    def eval_step(
        self, step: int, tokens: torch.Tensor, targets: torch.Tensor, microbatches: int
    ) -> float:
        """Loss of a batch without training (every replica, forward only)."""
        self._feed(step, tokens, targets, microbatches)
        req = {"step": step, "microbatches": microbatches, "train": False, "eval": True}
        replies = self._gather(self._calls("RunStep", req, list(self.clients), 300.0), 300.0)
        losses = [float(r["loss"]) for r in replies.values() if r.get("loss") is not None]
        return sum(losses) / len(losses)

    def logits(
        self, step: int, tokens: torch.Tensor, replica: int = 0, timeout_s: float = 120.0
    ) -> torch.Tensor:
        """Next-token logits of every sequence (forward only, through one replica's pipeline).
        A failure raises :class:`WorkerFailure` naming the stage that failed."""
        try:
            self._push(0, replica, Kind.TOKENS, step, 0, tokens).result()
        except grpc.RpcError as exc:
            keys = [(s, replica) for s in range(self.stages)]
            raise self._failure(f"stage 0 replica {replica}: {exc.details()}", keys) from None
        req = {"step": step, "microbatches": 1, "train": False}
        keys = [(s, replica) for s in range(self.stages)]
        replies = self._gather(self._calls("RunStep", req, keys, timeout_s), timeout_s)
        return torch.tensor(replies[(self.stages - 1, replica)]["logits"])

    def generate(
        self,
        prompt: bytes,
        tokens: int,
        step_base: int = 1_000_000,
        temperature: float = 0.8,
        seed: int = 0,
        replica: int = 0,
        cancel: Any = None,
    ) -> bytes:
        """Sample ``tokens`` bytes after ``prompt``. ``cancel`` (an Event) stops it between
        tokens (the slower copy of a redundant request)."""
        g = torch.Generator().manual_seed(seed)
        seq = self.layout.model.seq
        out = bytearray(prompt)
        for k in range(tokens):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled: another replica answered first")
            ctx = torch.tensor([list(out[-seq:])], dtype=torch.int64)
            logits = self.logits(step_base + k, ctx, replica)[0] / max(temperature, 1e-6)
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            out.append(nxt)
        return bytes(out[len(prompt) :])

    # -- checkpoints and recovery -----------------------------------------------------------
    def checkpoint(self, step: int, folder: Path | None = None) -> Checkpoint:
        """Save every stage (replica 0: replicas hold the same weights) between two steps."""
        folder = folder or self.workdir / "checkpoints" / f"step{step}"
        keys = [(s, 0) for s in range(self.stages)]
        futures = {
            k: self.clients[k].raw_future(
                "Save", json.dumps({"path": str(folder / f"stage{k[0]}.pt")}).encode(), 120.0
            )
            for k in keys
        }
        out = self._gather(futures, 120.0)
        return Checkpoint(step, {k[0]: (r["path"], r["sha256"]) for k, r in out.items()})

    def restore(self, ckpt: Checkpoint, keys: list[Key] | None = None) -> None:
        """Load ``ckpt`` into the workers (all by default); each file's hash is checked."""
        keys = keys if keys is not None else list(self.clients)
        futures = {
            k: self.clients[k].raw_future(
                "Load",
                json.dumps({"path": ckpt.files[k[0]][0], "sha256": ckpt.files[k[0]][1]}).encode(),
                120.0,
            )
            for k in keys
        }
        self._gather(futures, 120.0)

    def _move_to_epoch(self, keys: list[Key], epoch: int) -> list[Key]:
        """Abort the step in progress on ``keys`` and move them to ``epoch``; returns the
        workers that did not answer."""
        futures = {
            k: self.clients[k].raw_future("Abort", json.dumps({"epoch": epoch}).encode(), 5.0)
            for k in keys
        }
        lost = []
        for k, fut in futures.items():
            try:
                fut.result()
                self.epochs[k] = epoch
            except grpc.RpcError:
                lost.append(k)
        return lost

    def _fence(self, keys: Collection[Key]) -> None:
        """Refuse the current instances at ``keys`` in the registry (their records go): a peer
        looking them up from now on finds their replacement or nothing, never a dead address."""
        for key in keys:
            self.registry.fence(self.sid(*key), self.epoch)

    def replace(self, keys: list[Key]) -> None:
        """Fence the instances at ``keys`` and launch replacements at the current epoch. A
        failed instance is not killed: if it comes back it finds itself fenced and leaves."""
        self._fence(keys)
        self.abandoned.extend(self.handle(key) for key in keys)
        launch = []
        for cfg in (self._config(k[0], k[1], self.epoch) for k in keys):
            taken = self._take_spare(cfg)
            if taken is None:
                launch.append(cfg)
            else:
                self._adopt(taken)
        for h in self.pool.map(lambda c: self.launcher.start(c, self.workdir), launch):
            self._adopt(h)
        if self.spares_wanted:
            self._refills.append(self.pool.submit(self._refill_spares))

    def recover(self, failure: WorkerFailure, ckpt: Checkpoint | None) -> Recovery:
        """Replace the failed workers, move everyone to a new epoch and back to ``ckpt`` (with
        none, every worker must still hold its initial weights, as a replacement does)."""
        self.epoch += 1
        failed = set(failure.failed)
        self._fence(failed)  # before the survivors, moving on, look their peers up again
        survivors = [k for k in self.clients if k not in failed]
        failed |= set(self._move_to_epoch(survivors, self.epoch))
        sids = [self.sid(*k) for k in sorted(failed)]
        self.replace(sorted(failed))
        if ckpt is not None:
            self.restore(ckpt)
        step = ckpt.step if ckpt is not None else 0
        rec = Recovery(sids, str(failure), failure.at, time.time(), step, self.epoch)
        self.recoveries.append(rec)
        return rec

    def heal(self, failure: WorkerFailure, replica: int, ckpt: Checkpoint | None) -> Recovery:
        """Repair one replica's pipeline (inference): its survivors move to a new epoch, the
        failed workers are replaced, and the pipeline loads ``ckpt`` (when there is one)."""
        self.epoch += 1
        keys = [(s, replica) for s in range(self.stages)]
        failed = {k for k in failure.failed if k[1] == replica}
        self._fence(failed)  # before the survivors, moving on, look their peers up again
        failed |= set(self._move_to_epoch([k for k in keys if k not in failed], self.epoch))
        self.replace(sorted(failed))
        if ckpt is not None:
            self.restore(ckpt, keys)
        rec = Recovery(
            [self.sid(*k) for k in sorted(failed)],
            str(failure),
            failure.at,
            time.time(),
            ckpt.step if ckpt else 0,
            self.epoch,
        )
        self.recoveries.append(rec)
        return rec

    def health(self) -> list[dict[str, Any]]:
        return [c.call("Health", timeout_s=5) for c in self.clients.values()]

    def shutdown(self) -> None:
        for fut in self._refills:  # a spare being started must not outlive the deployment
            with contextlib.suppress(Exception):
                fut.result(timeout=60)
        for h in [*self.handles, *self.spares]:
            self.launcher.stop(h)
        for h in self.abandoned:  # fenced instances (a frozen one cannot act on SIGTERM)
            with contextlib.suppress(Exception):
                h.process.kill()
                h.process.wait(timeout=10)
        for c in self.clients.values():
            c.close()
        self.server.stop(grace=1)
        self.pool.shutdown(wait=False)
        if self._tmp:
            self._tmp.cleanup()

    def __enter__(self) -> Deployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class Cancelled(RuntimeError):
    """A request given up because another replica answered first."""
