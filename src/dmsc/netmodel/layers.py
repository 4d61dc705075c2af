"""Per-layer costs of a model for one micro-batch on one device: FLOPs, GEMMs, bytes, memory.

The model becomes a chain ``embedding, block_0 .. block_{L-1}, head`` (or the spec's own layer
list). Counts follow Narayanan et al. (SC'21, eq. 3: 24bsh^2 + 4bs^2h forward FLOPs per block) and
the activation memory of Korthikanti et al., "Reducing Activation Recomputation in Large$
Transformer Models" (MLSys 2023, sec. 4), generalised to grouped-query attention, SwiGLU and
mixtures of experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmsc.netmodel.constants import DTYPE_BYTES
from dmsc.spec.job import JobSpec
from dmsc.spec.model import LayerListSpec, TransformerSpec


@dataclass(frozen=True)
class Gemm:
    """``batch`` matrix products of (m x k) by (k x n), forward pass.

    ``kind`` is ``linear`` (a weight matrix), ``attention`` (scores or probabilities x values as
    separate kernels) or ``flash`` (the same products inside one fused attention kernel);
    ``dtype`` is set when the product runs in another type than the model's (fp8).
    """

    m: int
    n: int
    k: int
    batch: int = 1
    kind: str = "linear"
    dtype: str | None = None

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch


BLOCKS = ("block", "moe_block")  # the kinds of a transformer block (dense, or a mixture)


@dataclass(frozen=True)
class LayerCost:
    """One layer on one device for one micro-batch (its tensor/expert-parallel share)."""

    name: str
    kind: str  # "embedding", "block", "moe_block", "head" or "layer"
    params: float  # whole layer, all ranks together
    params_per_device: float
    expert_params_per_device: float  # part of params_per_device averaged over dp/ep only
    gemms: tuple[Gemm, ...]
    extra_flops: float  # forward FLOPs not in GEMMs (explicit layer lists)
    elementwise_bytes: float  # forward memory traffic of non-GEMM kernels
    elementwise_kernels: int
    recompute_flops: float  # extra forward FLOPs of recomputation (selective, or flash's)
    recompute_bytes: float  # extra element-wise bytes of selective recomputation
    activation_bytes: float  # kept for backward under the job's recompute policy
    output_bytes: float  # boundary activation one device sends to the next stage
    working_bytes: float  # transient buffers of its backward (gradients, the loss's logits)
    tp_allreduce_bytes: float  # size of each tensor-parallel all-reduce (fwd and bwd)
    tp_allreduces_fwd: int
    tp_allreduces_bwd: int
    ep_alltoall_bytes: float  # size of each expert-parallel all-to-all (one way)
    # GEMMs the backward pass runs again whatever the recompute policy: a fused (flash)
    # attention kernel keeps no scores and recomputes Q K^T in its backward.
    backward_recompute: tuple[Gemm, ...] = ()
    # Added to one of a mixture's backward all-reduces at tp > 1: the gradient of the router's
    # weights (tokens x top_k numbers) is summed over the ranks in the same call as its tokens'.
    tp_router_grad_bytes: float = 0.0
    # The vocabulary-parallel loss's all-reduces in a training forward (on the head): the
    # maximum, the target's logit and the sum of exponentials, one number per token each.
    tp_loss_allreduces: int = 0
    tp_loss_allreduce_bytes: float = 0.0
    # A mixture at ep > 1 first tells each rank how many tokens it will get for each of its
    # experts (an all-to-all of one int64 per expert) and then sends them, as the runtime
    # (compute/expert_parallel.py) and Megatron-Core's all-to-all token dispatcher do.
    ep_counts_bytes: float = 0.0
    # An inference forward at tp > 1 gathers the head's logits over the vocabulary (the whole
    # buffer's bytes), as the runtime's vocabulary-parallel head does (compute/vocab_parallel.py).
    tp_logits_gather_bytes: float = 0.0
    # Under sequence parallelism a block's parameters that stay whole on every rank (the norms,
    # the row-parallel biases) see only the rank's tokens: each one's gradient is summed over the
    # ranks (an all-reduce of its own), as Megatron sums its sequence-parallel parameters' and
    # the runtime does (compute/sequence_parallel.py).
    tp_whole_grads: int = 0
    tp_whole_grad_bytes: float = 0.0
    # A mixture's routed elements in a micro-batch on the device: its tokens times their top-k
    # choices times the hidden size, what the runtime's routing gathers, sends to its experts
    # and combines back (dmsc.netmodel.compute: ``dispatch_s``); 0 for other layers.
    routed_elements: float = 0.0
    # A mixture's expert GEMMs are the busiest expert-parallel rank's (JobSpec.expert_imbalance:
    # its share of the routed tokens); these are their forward FLOPs beyond an even share, in
    # the layer's time on the critical path but not in the job's FLOPs (every token is computed
    # once, on whichever rank).
    busiest_extra_flops: float = 0.0

    @property
    def forward_flops(self) -> float:
        """The device's even share of the job's forward FLOPs."""
        return sum(g.flops for g in self.gemms) + self.extra_flops - self.busiest_extra_flops


def _expert_gemms(
    tokens: int, up: int, h: int, down: int, experts: int, dtype: str | None
) -> tuple[Gemm, Gemm]:
    """A device's ``experts`` experts on ``tokens`` tokens each: the gate and up projections
    (``up`` wide), then the down one (from ``down``)."""
    return (
        Gemm(tokens, up, h, experts, dtype=dtype),
        Gemm(tokens, h, down, experts, dtype=dtype),
    )


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of 128 x tp, as Megatron-LM pads it for its kernels."""
    unit = 128 * tp
    return -(-vocab // unit) * unit


def _transformer_layers(model: TransformerSpec, job: JobSpec) -> list[LayerCost]:
    B = DTYPE_BYTES[model.dtype]
    b, s, h, t = job.micro_batch, model.seq, model.hidden, job.tp
    T = b * s  # tokens in the micro-batch
    a, d, f = model.heads, model.head_dim, model.ffn_size
    V = padded_vocab(model.vocab, t)
    kv = model.kv_heads_count * d  # width of K (and of V)
    kvr = model.kv_heads_count / model.heads
    sp = job.sequence_parallel
    rep = t if sp else 1  # replicated (non tensor-parallel) regions are split only under SP
    mlp_mats = 3 if model.mlp == "swiglu" else 2
    norm_params = 2 * h if model.mlp == "gelu" else h  # LayerNorm has a bias, RMSNorm has none
    flash = job.attention == "flash"
    drop = model.dropout > 0
    fp8 = job.precision == "fp8"
    autocast = job.precision == "autocast"
    # Transformer Engine runs the blocks' linear layers in fp8 and keeps their inputs for the
    # backward in fp8 (1 byte); the attention core, norms, embedding and output layer stay 16-bit.
    lin = "fp8" if fp8 else None
    L = 1 if fp8 else B  # bytes per element of a saved linear-layer input

    attn_params = h * (h + 2 * kv) + h * h + 2 * norm_params
    if model.mlp == "gelu":
        attn_params += (h + 2 * kv) + h  # biases
    mlp_params = mlp_mats * h * f + (f + h if model.mlp == "gelu" else 0)
    # Whole on every tensor-parallel rank (Megatron-LM, and the runtime's tensor_parallel.py):
    # the norms, and a row-parallel layer's bias (the output projection's, the MLP's second).
    attn_whole = 2 * norm_params + (h if model.mlp == "gelu" else 0)
    mlp_whole = h if model.mlp == "gelu" else 0

    # Forward GEMMs of one block on one tensor-parallel rank.
    core = "flash" if flash else "attention"
    attn_gemms = (
        Gemm(T, (h + 2 * kv) // t, h, dtype=lin),  # QKV projection
        Gemm(s, s, d, b * a // t, kind=core),  # scores Q K^T
        Gemm(s, d, s, b * a // t, kind=core),  # probabilities x V
        Gemm(T, h, h // t, dtype=lin),  # output projection
    )
    dense_mlp = (Gemm(T, (mlp_mats - 1) * f // t, h, dtype=lin), Gemm(T, h, f // t, dtype=lin))

    # Non-GEMM kernels, forward bytes (read + write): two norms, two residual adds (with bias and
    # dropout when there is dropout), the MLP activation; standard attention adds the softmax and
    # its dropout over the s x s scores, which a flash kernel (Dao et al., NeurIPS 2022 and
    # ICLR 2024) does on chip. fp8 adds a cast of each linear input; autocast a cast of each
    # fp32 weight to 16 bits.
    scores = b * (a // t) * s * s
    mask = 1 if drop else 0
    eltwise = (
        2 * (2 * B * T * h) / rep
        + (0 if flash else scores * (2 * B) + (scores * (2 * B + 1) if drop else 0))
        + 2 * (3 * B + mask) * T * h / rep
        + (mlp_mats - 1 + 1) * B * T * f / t
    )
    kernels = 5 + (0 if flash else 1 + (1 if drop else 0))
    if fp8:
        eltwise += (B + 1) * T * (3 * h / rep + f) / t
        kernels += 4
    # Activations kept for backward (bytes), per Korthikanti et al. (sec. 4.1): the two norm
    # inputs, the QKV and first MLP inputs and the dropout masks are replicated across tensor
    # ranks unless sequence parallel splits them; Q, K, V, the output projection input and the
    # MLP's intermediates are split.
    # Under autocast the residual stream stays fp32 (the parameters are), so the norm inputs
    # are 4 bytes each.
    N = 4 if autocast else B
    unsplit = (2 * N + 2 * L + 2 * mask) * T * h
    split_attn = (B * (1 + 2 * kvr) + L) * T * h
    split_mlp = (B + L) * f * T if model.mlp == "gelu" else (2 * B + L) * f * T
    # The attention core kept for backward: the softmax output (and with dropout its mask and
    # output) under standard attention, only the fp32 log-sum-exp of each row under flash.
    attn_core = 4 * b * a * s if flash else (B + (1 + B if drop else 0)) * b * a * s * s

    layers: list[LayerCost] = []
    emb_params = V * h + (s * h if model.mlp == "gelu" else 0)  # learned positions for GPT
    layers.append(
        LayerCost(
            name="embedding",
            kind="embedding",
            params=emb_params,
            params_per_device=V * h / t + (s * h if model.mlp == "gelu" else 0),
            expert_params_per_device=0.0,
            gemms=(),
            extra_flops=0.0,
            elementwise_bytes=3 * B * T * h,
            elementwise_kernels=3,
            recompute_flops=0.0,
            recompute_bytes=0.0,
            activation_bytes=mask * T * h / rep if job.recompute != "full" else 0.0,
            output_bytes=B * T * h / t,
            working_bytes=B * T * h,
            tp_allreduce_bytes=B * T * h if t > 1 else 0.0,
            tp_allreduces_fwd=1,
            tp_allreduces_bwd=0,
            ep_alltoall_bytes=0.0,
        )
    )
    for i in range(model.layers):
        moe = model.is_moe_layer(i)
        if moe:
            E, k, ep = model.experts, model.top_k, job.ep
            shape = ((mlp_mats - 1) * f // t, h, f // t, E // ep, lin)
            even = _expert_gemms(max(1, T * k * ep // E), *shape)
            # the busiest rank's experts: its share of the routed tokens (JobSpec)
            busiest = _expert_gemms(max(1, round(T * k * ep * job.expert_imbalance / E)), *shape)
            busiest_extra = sum(g.flops for g in busiest) - sum(g.flops for g in even)
            mlp_gemms: tuple[Gemm, ...] = (Gemm(T, E, h), *busiest)  # the router first
            expert_p = E * mlp_params / (t * ep)
            params = float(attn_params + E * mlp_params + h * E)
            per_dev = (attn_params - attn_whole) / t + attn_whole + expert_p + h * E
            a2a = float(B * T * h * k) * job.expert_imbalance  # through the busiest rank
            mlp_act = split_mlp * k
        else:
            mlp_gemms = dense_mlp
            busiest_extra = 0.0
            expert_p = 0.0
            params = float(attn_params + mlp_params)
            whole = attn_whole + mlp_whole
            per_dev = (attn_params + mlp_params - whole) / t + whole
            a2a = 0.0
            mlp_act = split_mlp
        full_act = unsplit / rep + (split_attn + mlp_act) / t + attn_core / t
        if job.recompute == "full":
            act = B * T * h / rep
        else:
            act = unsplit / rep + (split_attn + mlp_act) / t
            if job.recompute == "none" or flash:  # selective recomputation drops the s x s core
                act += attn_core / t
        # Backward of one block at a time: the gradients of its widest intermediate and of its
        # input, and under full recomputation the block's activations recomputed for it.
        working = B * T * ((mlp_mats - 1) * f / t + 2 * h / rep)
        if job.recompute == "full":
            working += full_act
        cast = per_dev * (4 + B) if autocast else 0.0  # fp32 weights cast to 16 bits
        layers.append(
            LayerCost(
                name=f"block_{i}",
                kind="moe_block" if moe else "block",
                params=params,
                params_per_device=per_dev,
                expert_params_per_device=expert_p,
                gemms=attn_gemms + mlp_gemms,
                extra_flops=0.0,
                elementwise_bytes=eltwise + cast,
                elementwise_kernels=kernels + (2 + mlp_mats if autocast else 0),
                # Selective recomputation redoes the attention core (Korthikanti et al.); flash
                # never kept it, and redoes Q K^T in its backward under every policy.
                recompute_flops=(
                    attn_gemms[1].flops
                    if flash
                    else attn_gemms[1].flops + attn_gemms[2].flops
                    if job.recompute == "selective"
                    else 0
                ),
                recompute_bytes=(
                    scores * (4 * B + 1) if job.recompute == "selective" and not flash else 0
                ),
                backward_recompute=(attn_gemms[1],) if flash else (),
                activation_bytes=act,
                output_bytes=B * T * h / t,
                working_bytes=working,
                tp_allreduce_bytes=B * T * h if t > 1 else 0.0,
                tp_allreduces_fwd=2,
                tp_allreduces_bwd=2,
                ep_alltoall_bytes=a2a if job.ep > 1 else 0.0,
                tp_router_grad_bytes=B * T * model.top_k if moe and t > 1 else 0.0,
                ep_counts_bytes=8.0 * model.experts if moe and job.ep > 1 else 0.0,
                tp_whole_grads=(attn_whole + (0 if moe else mlp_whole)) // h if sp and t > 1 else 0,
                tp_whole_grad_bytes=float(B * h) if sp and t > 1 else 0.0,
                routed_elements=float(T * model.top_k * h) if moe else 0.0,
                busiest_extra_flops=busiest_extra,
            )
        )
    head_params = (0 if model.tied_embeddings else V * h) + norm_params
    # A tied output layer still holds a copy of the embedding when it sits on another stage.
    head_on_device = (V * h if (not model.tied_embeddings or job.pp > 1) else 0) + norm_params
    # The loss over the vocabulary. Megatron-class stacks (mixed, pure, fp8) run a fused
    # vocabulary-parallel cross-entropy: fp32 logits kept for the backward (4 bytes per logit),
    # the gradient written in place and cast to 16 bits, in four passes over the fp32 logits.
    # Plain PyTorch (autocast) keeps the 16-bit logits the caller holds and the fp32
    # log-probabilities F.cross_entropy saves, and its backward makes an fp32 and a 16-bit
    # gradient of them (Megatron-LM's cross_entropy.py; torch's log_softmax/nll_loss).
    logits = T * V / t
    if autocast:
        loss_kept, loss_working, loss_traffic = (B + 4) * logits, (4 + B) * logits, 28 * logits
    else:
        loss_kept, loss_working, loss_traffic = 4 * logits, B * logits, 16 * logits
    layers.append(
        LayerCost(
            name="head",
            kind="head",
            params=head_params,
            params_per_device=(head_on_device - norm_params) / t + norm_params,
            expert_params_per_device=0.0,
            gemms=(Gemm(T, V // t, h),),
            extra_flops=0.0,
            elementwise_bytes=2 * B * T * h / rep + loss_traffic,
            elementwise_kernels=5,
            recompute_flops=0.0,
            recompute_bytes=0.0,
            activation_bytes=B * T * h / rep + loss_kept,
            output_bytes=0.0,
            working_bytes=loss_working,
            tp_allreduce_bytes=B * T * h if t > 1 else 0.0,
            tp_allreduces_fwd=0,
            tp_allreduces_bwd=1,
            ep_alltoall_bytes=0.0,
            # Megatron-LM's vocab_parallel_cross_entropy (and the runtime's, compute/
            # vocab_parallel.py) all-reduces three per-token numbers: fp32 in a fused loss, the
            # logits' 16 bits under autocast.
            tp_loss_allreduces=3 if t > 1 else 0,
            tp_loss_allreduce_bytes=(B if autocast else 4) * T if t > 1 else 0.0,
            tp_logits_gather_bytes=B * T * V if t > 1 else 0.0,
        )
    )
    return layers


def _explicit_layers(model: LayerListSpec, job: JobSpec) -> list[LayerCost]:
    b = job.micro_batch
    out: list[LayerCost] = []
    for i, layer in enumerate(model.layer_list):
        out.append(
            LayerCost(
                name=layer.name if layer.name != "layer" else f"layer_{i}",
                kind="layer",
                params=layer.params,
                params_per_device=layer.params,
                expert_params_per_device=0.0,
                gemms=(),
                extra_flops=layer.forward_gflop * 1e9 * b,
                elementwise_bytes=float(layer.activation_bytes * b),
                elementwise_kernels=1,
                recompute_flops=0.0,
                recompute_bytes=0.0,
                activation_bytes=(
                    layer.activation_bytes * b
                    if job.recompute != "full"
                    else layer.output_bytes * b
                ),
                output_bytes=float(layer.output_bytes * b),
                working_bytes=float(layer.activation_bytes * b),
                tp_allreduce_bytes=0.0,
                tp_allreduces_fwd=0,
                tp_allreduces_bwd=0,
                ep_alltoall_bytes=0.0,
            )
        )
    return out


# A strategy search costs the same layers for many strategies (they differ in pp, dp, schedule):
# built once per model and the job fields the layers depend on. Specs are frozen, so the key is
# their value; cleared when it grows past _CACHE_SIZE.
_CACHE_SIZE = 1024
_built: dict[tuple[object, ...], tuple[LayerCost, ...]] = {}


def layer_key(job: JobSpec) -> tuple[object, ...]:
    """The fields of ``job`` a model's layer costs depend on (and nothing else)."""
    return (
        job.tp,
        job.ep,
        job.expert_imbalance,
        job.micro_batch,
        job.sequence_parallel,
        job.recompute,
        job.attention,
        job.precision,
        job.pp > 1,
    )


def build_layer_costs(model: TransformerSpec | LayerListSpec, job: JobSpec) -> list[LayerCost]:
    """The model as a chain of layer costs for one micro-batch on one device of ``job``."""
    if not isinstance(model, TransformerSpec):  # a layer list holds lists: not hashable
        return _explicit_layers(model, job)
    key = (model, *layer_key(job))
    hit = _built.get(key)
    if hit is None:
        hit = tuple(_transformer_layers(model, job))
        if len(_built) >= _CACHE_SIZE:
            _built.clear()
        _built[key] = hit
    return list(hit)


def count_params(model: TransformerSpec | LayerListSpec) -> float:
    """Total parameters of the model."""
    job = JobSpec(global_batch=1)
    return sum(layer.params for layer in build_layer_costs(model, job))


_MATRICES: dict[int, tuple[LayerCost, float]] = {}


def matrix_elements(lc: LayerCost) -> float:
    """Elements of a block's weight matrices (0 for other layers), by the layer's identity (the
    layers of a strategy search are shared: build_layer_costs)."""
    hit = _MATRICES.get(id(lc))
    if hit is not None and hit[0] is lc:
        return hit[1]
    n = (
        float(sum(g.k * g.n * g.batch for g in lc.gemms if g.kind == "linear"))
        if lc.kind in BLOCKS
        else 0.0
    )
    if len(_MATRICES) >= 4096:
        _MATRICES.clear()
    _MATRICES[id(lc)] = (lc, n)
    return n
