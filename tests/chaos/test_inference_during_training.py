"""Inference requests against a deployment that is training (issue 12, item 1): a request's
forward pass ran inside a training step, the workers dropped the step's sends, training rolled
back to its checkpoint (about 90 s lost) and the request failed with ``moved to epoch 1``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from runtime_helpers import control_plane, make_plan, one_box, wait_for
from sqlalchemy import select

from dmsc.data.db import FaultRecord, MetricRecord
from dmsc.planner.plan import Plan
from dmsc.runtime.transport.messages import InferRequest, TrainRequest


def test_inference_takes_turns_between_training_steps_and_costs_training_nothing(
    tmp_path: Path,
) -> None:
    # Two replicas: a step averages gradients across them, so a replica busy with a request
    # holds the other one's step too.
    plan = Plan.model_validate_json(make_plan(tmp_path, one_box(tmp_path, 4), dp=2).read_text())
    with control_plane(plan, tmp_path) as cp:
        report: dict[str, Any] = {}
        trainer = threading.Thread(
            target=lambda: report.update(cp.train(TrainRequest(steps=16, checkpoint_every=4)))
        )
        trainer.start()

        def steps_done() -> int:
            with cp.db.sessions() as s:
                return len(list(s.scalars(select(MetricRecord.step))))

        wait_for(steps_done, 120, "the first training step")
        answers: list[dict[str, Any]] = []
        errors: list[str] = []

        def ask() -> None:  # one token at a time, as often as possible
            while trainer.is_alive():
                try:
                    answers.append(cp.infer(InferRequest(prompt="def ", tokens=1)))
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        askers = [threading.Thread(target=ask) for _ in range(3)]
        for a in askers:
            a.start()
        trainer.join(300)
        for a in askers:
            a.join(60)
        assert report["state"] == "done" and report["steps"] == 16
        assert errors == [] and len(answers) >= 3
        with cp.db.sessions() as s:
            steps = sorted(s.scalars(select(MetricRecord.step).where(MetricRecord.step >= 0)))
            faults = list(s.scalars(select(FaultRecord)))
        assert steps == list(range(16))  # every step once: none lost, none run twice
        assert faults == []
        assert cp.inference.names() == ["replica-0", "replica-1"]  # none left routing
