"""``dmsc train`` warns before it sends a task whose privacy noise outweighs its updates (issue
29, point 9: FedAvg with ``--privacy-noise 0.8`` took the validation loss from 2.98 to 31.39 with no
warning). The figure it gives is checked against the mechanism itself (clipping and noise of
:mod:`dmsc.runtime.compute.privacy`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dmsc.cli import main
from dmsc.cli.privacy_effect import noise_to_update, noise_warning, stage_params
from dmsc.runtime.transport.replies import TrainReply
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_noise_norm_is_the_mechanism_s() -> None:
    from dmsc.runtime.compute.privacy import add_noise, clip_update

    d, n, clip, sigma = 40_000, 4, 1.0, 0.8
    g = torch.Generator().manual_seed(0)
    updates = [clip_update(torch.randn(d, generator=g) * 10, clip)[0] for _ in range(n)]
    total = torch.stack(updates).sum(0)
    noisy = add_noise(total.clone(), sigma, clip, torch.Generator().manual_seed(1)) / n
    measured = float(torch.linalg.vector_norm(noisy - total / n)) / clip
    assert measured == pytest.approx(noise_to_update(sigma, n, d), rel=0.02)
    assert float(torch.linalg.vector_norm(total / n)) <= clip * (1 + 1e-6)


def test_no_warning_where_the_noise_is_smaller_than_the_update() -> None:
    assert noise_warning(0.01, 1.0, 4, 10_000) is None  # 0.25 of the update
    assert noise_warning(0.1, 1.0, 4, 10_000) is not None  # 2.5 times


class _Answers:
    """The control plane's Train call, answered at once (the warning comes before it)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.err_before_sending = ""

    def train_future(self, req: object) -> _Answers:
        self.err_before_sending = self.capsys.readouterr().err
        return self

    def done(self) -> bool:
        return True

    def result(self) -> TrainReply:  # the fields a cancelled task's line reads
        return TrainReply.model_construct(task=1, state="cancelled", steps=0, model_version=None)


@pytest.mark.parametrize("noise", ["0.8", "0.0001"])
def test_train_warns_before_sending_noise_that_outweighs_the_update(
    noise: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dmsc.cli import tasks
    from dmsc.data.db import Database, control_file
    from dmsc.planner.solve import plan_job

    monkeypatch.setenv("DMSC_HOME", str(tmp_path))
    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "two-sites-cpu.yaml")
    job = JobSpec(global_batch=16, micro_batch=4, pp=2, dp=2)
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    run = Database().new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    control_file().write_text(json.dumps({"run": run.id, "pid": os.getpid()}))
    answers = _Answers(capsys)
    monkeypatch.setattr(tasks, "control_client", lambda: answers)
    flags = [
        "--sync",
        "fedavg:5",
        "--privacy-clip",
        "1.0",
        "--privacy-noise",
        noise,
        "--steps",
        "10",
    ]
    with pytest.raises(SystemExit) as exit_:
        main(["train", *flags])
    assert not exit_.value.code, capsys.readouterr().err
    said = " ".join(answers.err_before_sending.split())
    ratio = noise_to_update(float(noise), 2, stage_params(plan))
    if ratio <= 1:
        assert said == ""
        return
    assert (
        f"warning: --privacy-noise 0.8 over 2 replicas adds noise of L2 norm about {ratio:,.1f}"
        in said
    )
    assert "expect the loss to stay or rise" in said
