"""Where a stage computes: device names checked against the machine, the autocast precision,
host staging, and the plan's devices (issue 14, item 3). The GPU path itself runs in
benchmarks/gpu_runtime.py on a machine that has one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dmsc.runtime.compute.devices import HostStaging, autocast_dtype, stage_device
from dmsc.runtime.compute.executor import run_ops
from dmsc.runtime.compute.models.chain import build_stage
from dmsc.runtime.transport.wire import Kind
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model

SPEC = resolve_model("gpt-mini")
assert isinstance(SPEC, TransformerSpec)


def test_device_names_are_checked_against_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stage_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        stage_device("gpu0")
    with pytest.raises(ValueError, match="runs on cpu or cuda"):
        stage_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"no CUDA device.*--device cpu"):
        stage_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert stage_device("cuda") == torch.device("cuda", 0)
    assert stage_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        stage_device("cuda:2")


def test_lower_precision_is_bf16_autocast_on_gpus_only() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    for dtype in ("bf16", "fp16", "fp8"):
        assert autocast_dtype(SPEC.model_copy(update={"dtype": dtype}), gpu) == torch.bfloat16
        assert autocast_dtype(SPEC.model_copy(update={"dtype": dtype}), cpu) is None
    assert autocast_dtype(SPEC, gpu) is None  # gpt-mini is fp32


def test_host_staging_leaves_cpu_tensors_alone() -> None:
    staging = HostStaging(torch.device("cpu"))
    t = torch.randn(3, 4)
    assert staging.to_host(t) is t and staging.to_device(t) is t


class _Loopback:
    """Peers of a one-stage pipeline: tokens and targets from a dict (a unit-test stand-in)."""

    deadline = None  # a step without one: a pipeline group's sends, were there one
    direct = False

    def __init__(self, frames: dict[tuple[Kind, int], torch.Tensor]) -> None:
        self.frames = frames

    def step_failed(self, reason: str) -> None:
        pass

    def recv(self, kind: Kind, step: int, mb: int) -> torch.Tensor:
        return self.frames[(kind, mb)]

    def flush(self) -> None:
        pass


def test_autocast_training_keeps_float32_master_weights_and_loss() -> None:
    """The executor's bf16 autocast path (a GPU's, run here on the CPU's bf16 kernels): the
    loss is computed in float32 from bf16 logits, the gradients land on the float32 weights,
    and the loss is within bf16 rounding of float32 training."""
    torch.manual_seed(0)
    x = torch.randint(0, SPEC.vocab, (2, 32))
    y = torch.randint(0, SPEC.vocab, (2, 32))
    frames = {(Kind.TOKENS, 0): x, (Kind.TARGETS, 0): y}
    losses = []
    for autocast in (None, torch.bfloat16):
        module = build_stage(SPEC, 0, "embedding", "head")
        peers: Any = _Loopback(frames)
        done = run_ops(module, peers, 0, 0, [("F", 0, 0), ("B", 0, 0)], 1, True, autocast=autocast)
        losses.append(done.losses[0])
        grads = [p.grad for p in module.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        assert all(p.dtype == torch.float32 for p in module.parameters())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert losses[1] != losses[0]  # bf16 did run


def test_the_plan_names_each_replicas_gpu_on_its_node(selene: ClusterSpec) -> None:
    from dmsc.planner.solve import plan_job
    from dmsc.runtime.control.training.placement import plan_devices

    job = JobSpec(global_batch=64, micro_batch=1, tp=1, pp=2, dp=4)
    plan = plan_job(selene, resolve_model("gpt3-1.3b"), job, fixed=True).plan
    devices = plan_devices(plan)
    assert set(devices) == {(s, r) for s in range(2) for r in range(4)}
    assert all(d.startswith("cuda:") for d in devices.values())
    # a node's GPUs are cuda:0 .. cuda:7, whatever their global index in the cluster
    assert all(0 <= int(d.split(":")[1]) < 8 for d in devices.values())
    assert len(set(devices.values())) > 1
    assert set(plan_devices(plan, "cpu").values()) == {"cpu"}
    assert set(plan_devices(plan, "cuda:0").values()) == {"cuda:0"}
