"""Memory per device: weights, gradients, optimizer states (with ZeRO), activations in flight.

Mixed-precision Adam keeps an fp32 master copy and two fp32 moments: 12 bytes per parameter on
top of the 16-bit weights and gradients (Rajbhandari et al., "ZeRO", SC'20: the 2+2+12 split).
ZeRO stage 1 shards the optimizer states over the data-parallel group, stage 2 also the
gradients, stage 3 also the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmsc.netmodel.constants import DTYPE_BYTES
from dmsc.spec.job import JobSpec


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device of a stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def inflight_microbatches(job: JobSpec, stage: int) -> float:
    """Micro-batch chunks whose activations a stage holds at its peak, in units of its layers.

    GPipe holds every micro-batch; 1F1B holds ``pp - stage``; the interleaved schedule holds
    ``2(pp - stage - 1) + (v - 1) pp + 1`` chunks of ``1/v`` of the stage's layers (Megatron-LM's
    warm-up count).
    """
    m, p, v = job.microbatches, job.pp, job.chunks
    if job.mode == "infer":
        return 1.0
    if job.schedule == "gpipe":
        return float(m)
    if job.schedule == "1f1b":
        return float(min(m, p - stage))
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v


def stage_memory(
    job: JobSpec,
    dtype: str,
    stage: int,
    dense_params: float,
    expert_params: float,
    activation_bytes: float,
) -> MemoryBreakdown:
    """Memory of one device of ``stage``.

    ``dense_params`` and ``expert_params`` are the device's parameters replicated over the whole
    data-parallel group and over ``dp / ep`` replicas; ``activation_bytes`` is what one micro-batch
    leaves on the device across all its layers.
    """
    B = DTYPE_BYTES[dtype]
    dp_dense, dp_expert = job.dp, job.dp // job.ep
    weights = dense_params * B + expert_params * B
    if job.mode == "infer":
        return MemoryBreakdown(weights, 0.0, 0.0, activation_bytes)
    opt_per_param = 12.0 if B < 4 else 8.0  # fp32 master + moments, or just the moments

    def sharded(per_param: float, on: bool) -> float:
        if not on:
            return dense_params * per_param + expert_params * per_param
        return dense_params * per_param / dp_dense + expert_params * per_param / dp_expert

    weights = sharded(B, job.zero >= 3)
    grads = sharded(B, job.zero >= 2)
    optimizer = sharded(opt_per_param, job.zero >= 1)
    acts = activation_bytes * inflight_microbatches(job, stage)
    return MemoryBreakdown(weights, grads, optimizer, acts)
