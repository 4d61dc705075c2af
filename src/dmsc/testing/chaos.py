"""Rehearsed failures: kill or freeze a stage worker while a deployment trains or serves, and
measure what the runtime does about it (time to detect, time to recover, steps lost, requests
failed). The chaos tests and ``benchmarks/chaos_recovery.py`` run these scenarios on real worker
processes; ``dmsc chaos`` sends the same signals to the workers of a running control plane
(:mod:`dmsc.runtime.control.launch.signals`).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from dmsc.data.corpus import Corpus
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.launchers import Launcher, Process
from dmsc.runtime.control.launch.recovery import heal
from dmsc.runtime.control.launch.signals import SIGNALS
from dmsc.runtime.control.training.report import TrainReport
from dmsc.runtime.control.training.session import Recovering, train
from dmsc.runtime.transport.messages import SyncSettings

Fault = Literal["kill", "freeze"]


@dataclass
class FaultReport:
    """One injected fault and the runtime's answer (times in seconds after the injection)."""

    fault: str
    target: str
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    steps_lost: int = 0
    requests_total: int = 0
    requests_failed: int = 0
    fenced: bool | None = None  # freeze: the thawed instance left by itself
    live_copies: int | None = None  # freeze: live processes of the SID after the thaw
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "target": self.target,
            "detected_after_s": self.detected_after_s,
            "recovered_after_s": self.recovered_after_s,
            "steps_lost": self.steps_lost,
            "requests_failed": self.requests_failed,
            "requests_total": self.requests_total,
        }


def inject(process: Process, fault: Fault) -> float:
    """Send the fault's signal to a worker's process (through its launcher: it may run on
    another machine); returns when (unix time)."""
    process.send_signal(SIGNALS[fault])
    return time.time()


def train_under_fault(
    layout: StageLayout,
    corpus: Corpus,
    valid: Corpus,
    steps: int,
    batch: int,
    microbatches: int,
    fault: Fault,
    stage: int,
    at_step: int,
    replica: int = 0,
    checkpoint_every: int = 4,
    registry_ttl_s: float = 3.0,
    seed: int = 0,
    spares: int = 0,
    launcher: Launcher | None = None,
    sync: SyncSettings | None = None,
) -> tuple[TrainReport, FaultReport]:
    """Train ``steps`` steps (the replicas agreeing as ``sync`` says) and inject ``fault`` into
    (stage, replica) while step ``at_step`` runs (after a random share of a step's time). A
    frozen worker is thawed once training has finished, to check that fencing keeps it out."""
    rng = random.Random(seed)
    target = (stage, replica)
    injected: list[float] = []
    with Deployment(layout, launcher=launcher, registry_ttl_s=registry_ttl_s, spares=spares) as dep:
        victim = dep.handle(target)
        fr = FaultReport(fault, victim.config.sid)
        typical = [0.05]

        def on_step(step: int, out: dict[str, Any]) -> None:
            typical.append(out["step_s"])
            if step + 1 == at_step and not injected:
                delay = rng.uniform(0.1, 0.9) * min(typical[1:] or typical)

                def strike() -> None:
                    time.sleep(delay)
                    injected.append(inject(victim.process, fault))

                threading.Thread(target=strike, daemon=True).start()

        report = train(
            dep,
            corpus,
            valid,
            steps,
            batch,
            microbatches,
            on_step=on_step,
            recovering=Recovering(checkpoint_every=checkpoint_every),
            validate=False,
            sync=sync,
        )
        if injected and report.recoveries:
            first = report.recoveries[0]
            fr.detected_after_s = first.detected_at - injected[0]
            fr.recovered_after_s = first.recovered_at - injected[0]
        fr.steps_lost = report.steps_lost
        if fault == "freeze" and injected:
            victim.process.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 4 * registry_ttl_s
            while victim.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            fr.fenced = victim.process.poll() is not None
            sid = victim.config.sid
            live = [h for h in [*dep.handles, *dep.abandoned] if h.config.sid == sid]
            fr.live_copies = sum(h.process.poll() is None for h in live)
            fr.extra["registered"] = [
                s.address for s in dep.registry.lookup(stage=stage) if s.sid == sid
            ]
            fr.extra["replacement"] = dep.handle(target).address
    return report, fr


def serve_under_fault(
    layout: StageLayout,
    requests: int,
    tokens: int,
    stage: int,
    kill_after: int,
    deadline_s: float = 20.0,
    registry_ttl_s: float = 3.0,
    redundant: bool = False,
) -> tuple[list[dict[str, Any]], FaultReport]:
    """Send ``requests`` generation requests, one at a time, across the replicas (round robin,
    failing over to the next replica when one fails); kill -9 ``stage`` of replica 0 when
    ``kill_after`` requests have been answered. With ``redundant``, every request goes to two
    replicas and the first answer wins. Each outcome: answered (by which replica) or the error."""
    outcomes: list[dict[str, Any]] = []
    with Deployment(layout, registry_ttl_s=registry_ttl_s) as dep:
        replicas = layout.replicas
        victim = dep.handle((stage, 0))
        fr = FaultReport("kill", victim.config.sid)
        down: set[int] = set()
        injected_at = 0.0
        lock = threading.Lock()
        pool = ThreadPoolExecutor(max_workers=2 * replicas)

        def one(r: int, k: int, cancel: threading.Event | None) -> str:
            base = 5_000_000 + k * 1000 + r * 100
            return bytes(
                dep.generate(b"def ", tokens, step_base=base, replica=r, cancel=cancel)
            ).hex()

        for k in range(requests):
            if k == kill_after:
                injected_at = inject(victim.process, "kill")
            t0 = time.monotonic()
            order = [r for r in (k % replicas, *range(replicas)) if r not in down]
            order = list(dict.fromkeys(order))
            outcome: dict[str, Any] = {"request": k}
            tried = order[:2] if redundant else order[:1]
            rest = [r for r in order if r not in tried]
            while tried and "replica" not in outcome:
                cancel = threading.Event()
                futures = {pool.submit(one, r, k, cancel): r for r in tried}
                errors = []
                left = max(0.1, deadline_s - (time.monotonic() - t0))
                for fut in _first_done(list(futures), left):
                    try:
                        fut.result(timeout=0)
                    except WorkerFailure as exc:
                        errors.append(str(exc))
                        with lock:
                            if futures[fut] not in down:
                                down.add(futures[fut])
                                fr.detected_after_s = fr.detected_after_s or (exc.at - injected_at)
                        continue
                    except Exception as exc:  # a timeout or a cancelled copy
                        errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    outcome["replica"] = futures[fut]
                    cancel.set()  # the other copy stops at its next token
                    break
                if "replica" not in outcome:
                    outcome["error"] = "; ".join(errors) or "deadline passed"
                    tried, rest = rest[:1], rest[1:]
            outcome["seconds"] = time.monotonic() - t0
            outcomes.append(outcome)
        pool.shutdown(wait=True, cancel_futures=True)
        if 0 in down:  # heal replica 0 (a replacement at a new epoch) and check it serves again
            failure = WorkerFailure(dep.suspects(), {})
            heal(dep, failure, 0, None)
            fr.recovered_after_s = time.time() - injected_at
            fr.extra["healed_serves"] = len(dep.generate(b"def ", 2, step_base=9_000_000)) == 2
    fr.requests_total = len(outcomes)
    fr.requests_failed = sum("replica" not in o for o in outcomes)
    return outcomes, fr


def _first_done(futures: list[Any], timeout_s: float) -> list[Any]:
    """The futures in the order they finish (those done within ``timeout_s``)."""
    from concurrent.futures import as_completed

    out = []
    try:
        for fut in as_completed(futures, timeout=timeout_s):
            out.append(fut)
            if fut.exception() is None:
                break
    except TimeoutError:
        pass
    return out
