"""The Service Mesh Orchestrator: deploys stage workers, hosts the registry, drives the steps.

A :class:`Deployment` starts one worker process per stage replica through a :class:`Launcher`
(:class:`LocalLauncher` runs them on this machine), waits until each has registered, then runs
training steps (tokens to the first stage, targets to the last, every replica's ``RunStep`` at
once) and sampling. Workers find each other through the registry; the orchestrator only pushes
the data in and collects losses and timings.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dmsc.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.business.rpc import Client, serve
from dmsc.compute.wire import Kind, encode
from dmsc.compute.worker import STAGE_SERVICE, WorkerConfig
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


class LocalLauncher:
    """Worker processes on this machine (``python -m dmsc.compute.worker``)."""

    def __init__(self, ready_timeout_s: float = 60.0) -> None:
        self.ready_timeout_s = ready_timeout_s

    def start(self, cfg: WorkerConfig, workdir: Path) -> WorkerHandle:
        path = workdir / f"{cfg.sid}.json"
        path.write_text(json.dumps(asdict(cfg)))
        with open(workdir / f"{cfg.sid}.log", "w") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                [sys.executable, "-m", "dmsc.compute.worker", "--config", str(path)],
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


@dataclass
class StageLayout:
    """What to deploy: a model, its stage layer ranges, data parallelism."""

    model: TransformerSpec
    ranges: list[tuple[str, str]]  # first and last layer of each stage
    replicas: int = 1
    seed: int = 0
    lr: float = 1e-3
    sids: list[str] = field(default_factory=list)


class Deployment:
    """A running pipeline of stage workers and the registry they use."""

    def __init__(
        self,
        layout: StageLayout,
        launcher: Launcher | None = None,
        workdir: Path | None = None,
        registry_ttl_s: float = 10.0,
    ) -> None:
        self.layout = layout
        self.launcher = launcher or LocalLauncher()
        self._tmp = tempfile.TemporaryDirectory(prefix="dmsc-") if workdir is None else None
        self.workdir: Path = Path(self._tmp.name) if self._tmp else Path(str(workdir))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(ttl_s=registry_ttl_s)
        # The service credential of this deployment: workers refuse calls without it.
        self.token = secrets.token_urlsafe(24)
        self.server, port = serve(
            REGISTRY_SERVICE, registry_methods(self.registry), token=self.token
        )
        self.registry_address = f"127.0.0.1:{port}"
        self.handles: list[WorkerHandle] = []
        self.clients: dict[tuple[int, int], Client] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(layout.ranges) * layout.replicas))

    @property
    def stages(self) -> int:
        return len(self.layout.ranges)

    def start(self) -> None:
        lay = self.layout
        import socket

        for s, (first, last) in enumerate(lay.ranges):
            dp_init = None
            if lay.replicas > 1:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    dp_init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
            cfgs = []
            for r in range(lay.replicas):
                sid = lay.sids[s] if s < len(lay.sids) else f"stage{s}"
                cfgs.append(
                    WorkerConfig(
                        sid=f"{sid}-r{r}",
                        stage=s,
                        stages=self.stages,
                        model=lay.model.model_dump(),
                        first=first,
                        last=last,
                        registry=self.registry_address,
                        replica=r,
                        replicas=lay.replicas,
                        seed=lay.seed,
                        lr=lay.lr,
                        dp_init=dp_init,
                        token=self.token,
                    )
                )
            # Replicas of a stage join one gloo group: start them together.
            started = list(self.pool.map(lambda c: self.launcher.start(c, self.workdir), cfgs))
            for h in started:
                self.handles.append(h)
                self.clients[(h.config.stage, h.config.replica)] = Client(
                    h.address, STAGE_SERVICE, token=self.token
                )

    def _push(
        self, stage: int, replica: int, kind: Kind, step: int, mb: int, t: torch.Tensor
    ) -> Any:
        return self.clients[(stage, replica)].raw_future("Push", encode(kind, step, mb, t))

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
                sent.append(self._push(0, r, Kind.TOKENS, step, i, x))
            if yr is not None:
                for i, y in enumerate(yr.chunk(m)):
                    sent.append(self._push(self.stages - 1, r, Kind.TARGETS, step, i, y))
        for fut in sent:
            fut.result()

    def train_step(
        self,
        step: int,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        microbatches: int,
        schedule: str = "1f1b",
    ) -> dict[str, Any]:
        """One training step of the global batch; returns the loss and timings."""
        t0 = time.perf_counter()
        self._feed(step, tokens, targets, microbatches)
        req = {"step": step, "microbatches": microbatches, "schedule": schedule, "train": True}
        replies = list(
            self.pool.map(lambda c: c.call("RunStep", req, timeout_s=300), self.clients.values())
        )
        losses = [r["loss"] for r in replies if r.get("loss") is not None]
        return {
            "loss": sum(losses) / len(losses),
            "step_s": time.perf_counter() - t0,
            "compute_s": {f"{r['stage']}/{r['replica']}": r["compute_s"] for r in replies},
        }

    def eval_step(
        self, step: int, tokens: torch.Tensor, targets: torch.Tensor, microbatches: int
    ) -> float:
        """Loss of a batch without training (every replica, forward only)."""
        self._feed(step, tokens, targets, microbatches)
        req = {"step": step, "microbatches": microbatches, "train": False, "eval": True}
        replies = list(
            self.pool.map(lambda c: c.call("RunStep", req, timeout_s=300), self.clients.values())
        )
        losses = [float(r["loss"]) for r in replies if r.get("loss") is not None]
        return sum(losses) / len(losses)

    def logits(self, step: int, tokens: torch.Tensor, replica: int = 0) -> torch.Tensor:
        """Next-token logits of every sequence (forward only, through one replica's pipeline)."""
        self._push(0, replica, Kind.TOKENS, step, 0, tokens).result()
        req = {"step": step, "microbatches": 1, "train": False}
        stage_clients = [self.clients[(s, replica)] for s in range(self.stages)]
        replies = list(
            self.pool.map(lambda c: c.call("RunStep", req, timeout_s=120), stage_clients)
        )
        return torch.tensor(replies[-1]["logits"])

    def generate(
        self,
        prompt: bytes,
        tokens: int,
        step_base: int = 1_000_000,
        temperature: float = 0.8,
        seed: int = 0,
        replica: int = 0,
    ) -> bytes:
        g = torch.Generator().manual_seed(seed)
        seq = self.layout.model.seq
        out = bytearray(prompt)
        for k in range(tokens):
            ctx = torch.tensor([list(out[-seq:])], dtype=torch.int64)
            logits = self.logits(step_base + k, ctx, replica)[0] / max(temperature, 1e-6)
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            out.append(nxt)
        return bytes(out[len(prompt) :])

    def health(self) -> list[dict[str, Any]]:
        return [c.call("Health", timeout_s=5) for c in self.clients.values()]

    def shutdown(self) -> None:
        for h in self.handles:
            self.launcher.stop(h)
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
