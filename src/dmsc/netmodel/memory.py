"""Memory per device: weights, gradients, optimizer states (with ZeRO), activations in flight,
the transient buffers of a backward pass, and what the framework holds outside tensors.

Bytes per parameter by training recipe (``JobSpec.precision``), as weights + gradients +
optimizer states:

- ``mixed`` (Megatron-LM, DeepSpeed): 16-bit weights and gradients, an fp32 master copy and two
  fp32 Adam moments: 2 + 2 + 12 (Rajbhandari et al., "ZeRO", SC'20, sec. 3.1).
- ``autocast`` (plain PyTorch with torch.autocast): fp32 parameters, fp32 gradients, two fp32
  moments: 4 + 4 + 8, and the 16-bit copies of the weight matrices autocast makes in the forward
  and keeps for the backward (torch.amp docs: the cast cache lives for the autocast region).
- ``pure``: weights, gradients and both moments in the model's 16-bit type: 2 + 2 + 4.
- ``fp8`` (Transformer Engine with Megatron-LM): ``mixed``, plus an fp8 copy of each block
  weight matrix and of its transpose for the backward's input-gradient GEMM: 2 more bytes.

A model in fp32 keeps everything in fp32 (4 + 4 + 8) whatever the recipe. ZeRO stage 1 shards the
optimizer states over the data-parallel group, stage 2 also the gradients, stage 3 also the
weights.
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
    working: float = 0.0  # transient buffers at the peak: one backward's gradients, the loss
    framework: float = 0.0  # outside tensors: CUDA context, cuBLAS workspaces, NCCL buffers
    # What the caching allocator holds beyond the live tensors at the peak (fragmentation).
    fragmentation: float = 0.0

    @property
    def tensors(self) -> float:
        """What the framework's allocator hands out at the peak (torch's max_memory_allocated)."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.working

    @property
    def required(self) -> float:
        """What must fit in the device: the tensors and the framework's own memory. The
        allocator's fragmentation is not counted: before it reports out of memory the caching
        allocator frees its cached blocks and retries, and with expandable segments
        (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which dmsc's GPU workers set and
        NVIDIA's Megatron Bridge memory-tuning guide names the first fix for fragmentation OOMs,
        "most Slurm launch templates already include it") a segment grows in place instead of
        leaving gaps."""
        return self.tensors + self.framework

    @property
    def total(self) -> float:
        """The peak the device shows in use (torch's max_memory_reserved plus the framework's
        memory, what nvidia-smi reports)."""
        return self.tensors + self.framework + self.fragmentation


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter of one recipe, and what its optimizer step moves per parameter."""

    weights: float
    gradients: float
    optimizer: float
    cast_copies: float  # per parameter of the weight matrices (autocast / fp8 copies)
    step_traffic: float  # read and write of the Adam step per parameter it owns


def precision_bytes(precision: str, dtype: str) -> PrecisionBytes:
    """The recipe's bytes per parameter for a model whose activations are in ``dtype``."""
    B = DTYPE_BYTES[dtype]
    if B >= 4:  # an fp32 model: no master copy, no casts
        return PrecisionBytes(4, 4, 8, 0, 28)
    if precision == "autocast":
        # Adam reads p, g, m, v and writes p, m, v, all fp32.
        return PrecisionBytes(4, 4, 8, B, 28)
    if precision == "pure":
        return PrecisionBytes(B, B, 2 * B, 0, 7 * B)
    # mixed and fp8, as Megatron-LM's mixed-precision optimizer steps (its optimizer.py): copy
    # the 16-bit gradients to fp32 main gradients (B + 4), unscale them and check for inf/nan
    # (4 + 4), clip by the global norm (4), Adam (read g, p, m, v; write p, m, v: 28), copy the
    # fp32 main parameters to the 16-bit ones (4 + B), zero the gradients (B): 3B + 48.
    return PrecisionBytes(B, B, 12, 2 if precision == "fp8" else 0, 3 * B + 48)


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
    working_bytes: float = 0.0,
    matrix_params: float = 0.0,
    framework_bytes: float = 0.0,
    allocator_overhead: float = 0.0,
) -> MemoryBreakdown:
    """Memory of one device of ``stage``.

    ``dense_params`` and ``expert_params`` are the device's parameters replicated over the whole
    data-parallel group and over ``dp / ep`` replicas (``matrix_params`` of them are weight
    matrices a recipe may keep cast copies of); ``activation_bytes`` is what one micro-batch
    leaves on the device across all its layers, ``working_bytes`` the largest transient of one of
    its layers' backward. ``framework_bytes`` and ``allocator_overhead`` (a share of the tensors)
    are the device generation's.
    """
    B = DTYPE_BYTES[dtype]
    dp_dense, dp_expert = job.dp, job.dp // job.ep
    if job.mode == "infer":
        weights = (dense_params + expert_params) * B
        tensors = weights + activation_bytes + working_bytes
        return MemoryBreakdown(
            weights,
            0.0,
            0.0,
            activation_bytes,
            working_bytes,
            framework_bytes,
            allocator_overhead * tensors,
        )
    pb = precision_bytes(job.precision, dtype)

    def sharded(per_param: float, on: bool) -> float:
        if not on:
            return dense_params * per_param + expert_params * per_param
        return dense_params * per_param / dp_dense + expert_params * per_param / dp_expert

    weights = sharded(pb.weights, job.zero >= 3) + matrix_params * pb.cast_copies
    grads = sharded(pb.gradients, job.zero >= 2)
    optimizer = sharded(pb.optimizer, job.zero >= 1)
    acts = activation_bytes * inflight_microbatches(job, stage)
    tensors = weights + grads + optimizer + acts + working_bytes
    return MemoryBreakdown(
        weights,
        grads,
        optimizer,
        acts,
        working_bytes,
        framework_bytes,
        allocator_overhead * tensors,
    )
