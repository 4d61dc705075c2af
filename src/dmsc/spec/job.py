"""The job spec: what to run (training or inference) and with which parallel configuration."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dmsc.spec.sync import SyncSpec

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]
Attention = Literal["flash", "standard"]
Precision = Literal["mixed", "autocast", "pure", "fp8"]
AllReduceAlgo = Literal["auto", "ring", "tree", "hierarchical"]


class JobSpec(BaseModel):
    """A training or inference job and its parallelism.

    Ranks are laid out the Megatron way: tensor-parallel ranks innermost (inside a node), then
    data-parallel (expert-parallel groups are consecutive data-parallel ranks), then pipeline stages
    outermost, so stages are what crosses nodes and datacenters first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["train", "infer"] = "train"
    global_batch: int = Field(gt=0, le=100_000_000, description="Samples per iteration.")
    micro_batch: int = Field(default=1, gt=0)
    tp: int = Field(default=1, gt=0, le=4096, description="Tensor-parallel degree.")
    pp: int = Field(default=1, gt=0, le=100_000, description="Pipeline-parallel degree.")
    dp: int = Field(default=1, gt=0, le=1_000_000, description="Data-parallel degree.")
    ep: int = Field(default=1, gt=0, le=100_000, description="Expert-parallel degree (within dp).")
    expert_imbalance: float = Field(
        default=1.0,
        ge=1.0,
        le=100_000,
        description=(
            "The routed tokens the busiest expert-parallel rank receives over an even share "
            "(1: every rank's experts receive as many; at most ep: one rank's receive all). "
            "Its experts' compute and the all-to-alls through it scale with it; a run measures "
            "it (the step trace's expert tokens)."
        ),
    )
    schedule: Schedule = "1f1b"
    interleave: int = Field(default=1, gt=0, le=1024, description="Model chunks per device.")
    recompute: Recompute = "none"
    attention: Attention = Field(
        default="flash",
        description=(
            "Attention kernel: flash (fused: no s x s scores in memory, recomputed in backward) "
            "or standard (scores, softmax and dropout as separate kernels, kept for backward)."
        ),
    )
    precision: Precision = Field(
        default="mixed",
        description=(
            "Training recipe: mixed (16-bit weights and gradients, fp32 master weights and Adam "
            "moments: Megatron-LM, DeepSpeed), autocast (plain PyTorch: fp32 parameters, "
            "torch.autocast 16-bit compute, unfused loss), pure (weights, gradients and moments "
            "all 16-bit) or fp8 (mixed, with the blocks' GEMMs in fp8: Transformer Engine)."
        ),
    )
    sequence_parallel: bool = False
    sequence_parallel_edges: Literal["gathered", "fused"] = Field(
        default="gathered",
        description=(
            "Under sequence parallelism, the way into the blocks after the embedding and out of "
            "them before the head: gathered (dmsc's runtime: the first block slices the whole "
            "input and its backward all-gathers the gradient; the last block's output is "
            "all-gathered whole for the head: one all-gather a micro-batch each) or fused "
            "(Megatron-LM folds both into the embedding's and the head's own sums: no call of "
            "their own; the published sets are priced so)."
        ),
    )
    zero: int = Field(
        default=0, ge=0, le=3, description="ZeRO stage (optimizer/grad/param sharding)."
    )
    split_counts_embedding_and_loss: bool = Field(
        default=False,
        description=(
            "Count the embedding and the output layer with its loss as one layer each when "
            "splitting the pipeline, so the first and last stages take one block fewer."
        ),
    )
    overlap_dp_comm: bool = Field(
        default=True, description="Overlap the gradient all-reduce with the last backward pass."
    )
    dp_bucket_bytes: int | None = Field(
        default=None,
        gt=0,
        le=1 << 40,
        description=(
            "Gradient bytes (in the model's dtype) per bucket of the overlapped data-parallel "
            "all-reduce, for pricing a job another framework runs (Megatron-Core: "
            "max(40e6, 1e6 x dp) parameters); unset: dmsc's runtime, which always cuts its own "
            "(256 KiB first, then 4 MiB: dmsc.netmodel.dp_buckets)."
        ),
    )
    overlap_tp_comm: bool = Field(
        default=True,
        description=(
            "Run the backward's tensor-parallel all-reduces under the weight-gradient GEMMs "
            "(Megatron-LM's asynchronous all-reduce)."
        ),
    )
    overlap_pp_comm: bool = Field(
        default=True,
        description=(
            "Interleaved schedule: send and receive activations while computing another chunk "
            "(Megatron-Core's overlapped point-to-point communication)."
        ),
    )
    allreduce: AllReduceAlgo = "auto"
    first_device: int = Field(
        default=0, ge=0, description="Index of the first device the job uses."
    )
    stage_layers: list[Annotated[int, Field(gt=0)]] | None = Field(
        default=None,
        description="Blocks per pipeline stage (default: as even as possible); one per stage.",
    )
    sync: SyncSpec = Field(
        default_factory=SyncSpec,
        description=(
            "How the data-parallel replicas agree (every-step, diloco:H, fedavg:H, fedprox:H) "
            "and the compression of what they send (see dmsc.spec.sync)."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.interleave > 1 and self.schedule != "interleaved":
            raise ValueError("interleave: > 1 needs schedule 'interleaved'")
        if self.schedule == "interleaved" and self.pp == 1:
            raise ValueError("schedule: 'interleaved' needs pp > 1")
        if self.dp % self.ep:
            raise ValueError(f"ep: dp={self.dp} is not divisible by ep={self.ep}")
        if self.expert_imbalance > self.ep:
            raise ValueError(
                f"expert_imbalance: {self.expert_imbalance} is more than ep={self.ep} (the "
                "busiest rank receives at most every rank's tokens)"
            )
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(
                f"global_batch: {self.global_batch} is not divisible by "
                f"micro_batch x dp = {self.micro_batch * self.dp}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel: needs tp > 1")
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.pp:
                raise ValueError(
                    f"stage_layers: {len(self.stage_layers)} entries for pp={self.pp} stages"
                )
            if self.schedule == "interleaved":
                raise ValueError("stage_layers: uneven stages need a non-interleaved schedule")
        if self.mode == "infer" and (self.zero or self.recompute != "none"):
            raise ValueError("mode: inference uses neither ZeRO nor recomputation")
        if self.mode == "infer" and self.sync != SyncSpec():
            raise ValueError("sync: inference synchronises no gradients (mode infer)")
        if self.sync.local_steps and self.zero:
            raise ValueError(
                f"sync: {self.sync.mode} keeps a whole optimizer on every replica between "
                f"rounds, which ZeRO shards over them: needs zero 0 (got {self.zero})"
            )
        return self

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline per iteration (gradient accumulation steps)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def chunks(self) -> int:
        """Model chunks per device (virtual stages of the interleaved schedule)."""
        return self.interleave if self.schedule == "interleaved" else 1
