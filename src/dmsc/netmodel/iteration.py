"""Iteration time of a job on a cluster: compute, communication per mode, bubble, memory, traffic.

The pipeline is costed per device: one micro-batch on stage ``i`` takes ``t_i`` (compute of all its
chunks, its tensor- and expert-parallel collectives, and the blocking send/receive of activations
and gradients at each chunk boundary). With ``m`` micro-batches and ``v`` chunks per device, the
pipeline runs ``m x max(t_i) + (pp - 1) / v x mean(t_i)`` (Narayanan et al. SC'21, sec. 2.2: the
bubble is ``(p - 1) / v`` micro-batch times for 1F1B and interleaved, as for GPipe). Then the
data-parallel gradient reduction (minus what its buckets hide under the last backward pass,
:mod:`dmsc.netmodel.dp_buckets`; once per round of the job's sync mode and compressed as it
says: :mod:`dmsc.netmodel.sync`) and the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmsc.netmodel.comm import ZERO_COST, CommCost, CommModel
from dmsc.netmodel.compute import DtypeUnsupported, LayerTime, layer_time, peak_flops
from dmsc.netmodel.constants import DEFAULT_CALIBRATION, DTYPE_BYTES, Calibration
from dmsc.netmodel.layers import LayerCost, build_layer_costs, matrix_elements
from dmsc.netmodel.memory import MemoryBreakdown, precision_bytes, stage_memory
from dmsc.netmodel.parallel import Layout, split_layers
from dmsc.netmodel.sync import (
    bucketed_exposed_s,
    exchange,
    exposed_s,
    stage_payload,
    vocab_matrix,
)
from dmsc.netmodel.topology import Topology
from dmsc.netmodel.tp_calls import tp_allreduce_calls
from dmsc.spec.cluster import ClusterSpec
from dmsc.spec.job import JobSpec
from dmsc.spec.model import LayerListSpec, TransformerSpec

MODES = ("dp", "pp", "tp", "ep")
BREAKDOWN_KEYS = ("compute", "tp_comm", "pp_comm", "dp_comm", "ep_comm", "bubble", "optimizer")
GIB = 1024**3


class DoesNotFit(ValueError):
    """The job cannot run on the cluster as configured; ``reasons`` says why."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage: its layers, time per micro-batch and memory per device."""

    index: int
    layers: tuple[str, ...]
    compute_s: float
    tp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    memory: MemoryBreakdown
    memory_capacity: float

    @property
    def microbatch_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.ep_comm_s + self.pp_comm_s


@dataclass(frozen=True)
class Estimate:
    """Everything the cost model predicts for one iteration of a job."""

    iteration_time_s: float
    breakdown_s: dict[str, float]
    flops_per_iteration: float  # executed, recomputation included
    model_flops_per_iteration: float  # without recomputation
    devices: int
    peak_flops_per_device: float
    tokens_per_iteration: float
    stages: tuple[StageEstimate, ...]
    traffic_bytes: dict[str, float]
    traffic_by_link: dict[int, dict[str, float]] = field(repr=False)
    params: float = 0.0

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_iteration / self.iteration_time_s / self.devices / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful FLOP/s over the peak of the devices used."""
        return self.model_flops_per_iteration / (
            self.iteration_time_s * self.devices * self.peak_flops_per_device
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.iteration_time_s

    @property
    def memory_per_device(self) -> float:
        """Bytes on the fullest device."""
        return max(s.memory.total for s in self.stages)


def check_fit(
    cluster: ClusterSpec, model: TransformerSpec | LayerListSpec, job: JobSpec
) -> list[str]:
    """Reasons (possibly none) why ``job`` cannot run ``model`` on ``cluster`` before costing."""
    reasons: list[str] = []
    available = cluster.device_count - job.first_device
    if job.devices > available:
        reasons.append(
            f"needs tp x pp x dp = {job.devices} devices, the cluster has {available}"
            + (f" from device {job.first_device}" if job.first_device else "")
        )
    n_layers = model.layers if isinstance(model, TransformerSpec) else len(model.layer_list)
    if job.stage_layers is not None and sum(job.stage_layers) != n_layers:
        reasons.append(f"stage_layers add up to {sum(job.stage_layers)}, the model has {n_layers}")
    slots = n_layers + (2 if job.split_counts_embedding_and_loss else 0)
    if slots < job.pp * job.chunks:
        reasons.append(
            f"{n_layers} layers cannot fill pp x interleave = {job.pp * job.chunks} chunks"
        )
    if isinstance(model, TransformerSpec):
        shapes = [("heads", model.heads), ("ffn", model.ffn_size)]
        if model.kv_heads_count != model.heads:
            shapes.insert(1, ("kv_heads", model.kv_heads_count))
        for name, value in shapes:
            if value % job.tp:
                reasons.append(f"{name}={value} is not divisible by tp={job.tp}")
        if job.ep > 1 and (not model.is_moe or model.experts % job.ep):
            reasons.append(f"ep={job.ep} needs a mixture of experts with experts divisible by ep")
        if job.precision in ("fp8", "autocast", "pure") and DTYPE_BYTES[model.dtype] != 2:
            reasons.append(
                f"precision {job.precision} needs a 16-bit model (dtype bf16 or fp16), "
                f"the model is {model.dtype}"
            )
        if job.sequence_parallel and model.seq % job.tp:
            reasons.append(f"seq={model.seq} is not divisible by tp={job.tp} (sequence parallel)")
    else:
        if job.tp > 1 or job.ep > 1:
            reasons.append("tp and ep need a transformer model (a layer list has no shapes)")
        if job.precision == "fp8":
            reasons.append("precision fp8 needs a transformer model (a layer list has no GEMMs)")
    return reasons


def assign_stage_layers(layers: list[LayerCost], job: JobSpec) -> list[list[LayerCost]]:
    """Layers of each stage, embedding with the first chunk and head with the last.

    With ``split_counts_embedding_and_loss`` the embedding and the head each count as one layer
    of the split, so the first and last chunks take one block fewer (Llama 3's balancing;
    Megatron-Core's account-for-embedding/loss-in-pipeline-split).
    """
    body = [lc for lc in layers if lc.kind not in ("embedding", "head")]
    ends = job.split_counts_embedding_and_loss and layers[0].kind == "embedding"
    ends = ends and layers[-1].kind == "head"
    stages: list[list[LayerCost]] = [[] for _ in range(job.pp)]
    if job.stage_layers is not None:
        starts = [sum(job.stage_layers[:i]) for i in range(job.pp + 1)]
        chunks = [range(starts[i], starts[i + 1]) for i in range(job.pp)]
    elif ends:
        items = [layers[0], *body, layers[-1]]
        for c, rng in enumerate(split_layers(len(items), job.pp * job.chunks)):
            stages[c % job.pp].extend(items[i] for i in rng)
        return stages
    else:
        chunks = split_layers(len(body), job.pp * job.chunks)
    for c, rng in enumerate(chunks):
        stages[c % job.pp].extend(body[i] for i in rng)
    if layers[0].kind == "embedding":
        stages[0].insert(0, layers[0])
    if layers[-1].kind == "head":
        stages[-1].append(layers[-1])
    return stages


def _types(cluster: ClusterSpec, topo: Topology, devices: list[int]) -> set[str]:
    """The device types among ``devices`` (a cluster of one type needs no look)."""
    if len(cluster.device_types) == 1:
        return set(cluster.device_types)
    return {topo.devices[d].type_name for d in devices}


def _check_memory(
    cluster: ClusterSpec,
    topo: Topology,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    stage_layers: list[list[LayerCost]],
    calib: Calibration,
) -> list[tuple[MemoryBreakdown, float]]:
    """Memory and capacity per device of every stage; :class:`DoesNotFit` if one overflows."""
    layout = Layout.of(job)
    B = DTYPE_BYTES[model.dtype]
    train = job.mode == "train"
    out: list[tuple[MemoryBreakdown, float]] = []
    for s, members in enumerate(stage_layers):
        types = _types(cluster, topo, layout.stage_devices(s))
        dense = sum(lc.params_per_device - lc.expert_params_per_device for lc in members)
        expert = sum(lc.expert_params_per_device for lc in members)
        # Weight matrices of the blocks, of which autocast and fp8 keep cast copies.
        matrices = sum(matrix_elements(lc) for lc in members)
        if train:
            acts = sum(lc.activation_bytes for lc in members)
        else:  # forward only: one layer's working set at a time
            acts = max((lc.activation_bytes for lc in members), default=0.0)
        if not train and isinstance(model, TransformerSpec):  # KV cache of the prompt
            n_blocks = sum(1 for lc in members if lc.kind in ("block", "moe_block"))
            kv = 2 * n_blocks * job.micro_batch * model.seq * model.kv_heads_count
            acts += kv * model.head_dim * B / job.tp
        working = max((lc.working_bytes for lc in members), default=0.0) if train else 0.0
        worst_type = min(types, key=lambda t: cluster.device_types[t].memory_gib)
        dc = calib.for_device(cluster.device_types[worst_type])
        mem = stage_memory(
            job,
            model.dtype,
            s,
            dense,
            expert,
            acts,
            working,
            matrices,
            dc.framework_bytes,
            dc.allocator_overhead,
        )
        capacity = cluster.device_types[worst_type].memory_gib * GIB
        out.append((mem, capacity))
    worst = max(range(len(out)), key=lambda i: out[i][0].required - out[i][1])
    mem, capacity = out[worst]
    if mem.required > capacity:
        raise DoesNotFit(
            [
                f"stage {worst} needs {mem.required / GIB:.1f} GiB per device, "
                f"devices have {capacity / GIB:.0f} GiB"
            ]
        )
    return out


@dataclass(frozen=True)
class _StageCompute:
    """One micro-batch's compute on a stage: its seconds (its slowest device type's), the
    weight-gradient window of each layer, FLOPs (with recomputation, and as the model counts
    them) on one device, and the fastest peak among its device types."""

    seconds: float
    windows: dict[str, float]
    backward: list[float]  # each layer's backward (and recomputation), its slowest type's
    flops: float
    model_flops: float
    peak: float


def _stage_compute(
    cluster: ClusterSpec,
    topo: Topology,
    job: JobSpec,
    dtype: str,
    members: list[LayerCost],
    devices: list[int],
    calib: Calibration,
) -> _StageCompute:
    train = job.mode == "train"
    types = _types(cluster, topo, devices)
    compute_s = flops = model_flops = peak = 0.0
    windows: dict[str, float] = {}
    backward = [0.0] * len(members)
    for tname in types:
        dtype_spec = cluster.device_types[tname]
        t_total = 0.0
        for i, lc in enumerate(members):
            policy = job.recompute if lc.kind in ("block", "moe_block", "layer") else "none"
            try:
                lt: LayerTime = layer_time(lc, dtype_spec, dtype, policy, calib)
            except DtypeUnsupported as exc:
                raise DoesNotFit([f"device type {tname!r}: {exc}"]) from None
            t_total += lt.forward + (lt.backward + lt.recompute if train else 0.0)
            backward[i] = max(backward[i], lt.backward + lt.recompute)
            windows[lc.name] = min(windows.get(lc.name, lt.wgrad_window), lt.wgrad_window)
            if tname == min(types):
                f_fwd = lc.forward_flops
                flash_again = sum(g.flops for g in lc.backward_recompute)
                extra = f_fwd + flash_again if policy == "full" else lc.recompute_flops
                flops += (3 * f_fwd + extra) if train else f_fwd
                model_flops += 3 * f_fwd if train else f_fwd
        compute_s = max(compute_s, t_total)
        peak = max(peak, peak_flops(dtype_spec, dtype))
    return _StageCompute(compute_s, windows, backward, flops, model_flops, peak)


def compute_bound(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    calib: Calibration = DEFAULT_CALIBRATION,
    topology: Topology | None = None,
) -> float:
    """A lower bound of :func:`estimate_iteration`'s iteration time from the stages' compute
    alone (the busiest stage's micro-batches and the pipeline's fill and drain, with no
    communication); raises :class:`DoesNotFit` as it does, memory included. A strategy search
    costs a strategy in full only when this bound can still beat what it has."""
    reasons = check_fit(cluster, model, job)
    if reasons:
        raise DoesNotFit(reasons)
    topo = topology if topology is not None else Topology(cluster)
    layout = Layout.of(job)
    stage_layers = assign_stage_layers(build_layer_costs(model, job), job)
    _check_memory(cluster, topo, model, job, stage_layers, calib)
    per_mb = [
        _stage_compute(cluster, topo, job, model.dtype, ms, layout.stage_devices(s), calib).seconds
        for s, ms in enumerate(stage_layers)
    ]
    p = job.pp
    return job.microbatches * max(per_mb) + (p - 1) / job.chunks * (sum(per_mb) / p)


def estimate_iteration(
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    calib: Calibration = DEFAULT_CALIBRATION,
    topology: Topology | None = None,
    comm_model: CommModel | None = None,
) -> Estimate:
    """Predict one iteration of ``job``; raises :class:`DoesNotFit` when it cannot run.

    ``topology`` and ``comm_model`` may be shared between calls on the same cluster (a strategy
    search): the communication model caches the link loads of each set of groups.
    """
    reasons = check_fit(cluster, model, job)
    if reasons:
        raise DoesNotFit(reasons)
    topo = topology if topology is not None else Topology(cluster)
    comm = comm_model if comm_model is not None else CommModel(topo, calib)
    layout = Layout.of(job)
    dtype = model.dtype
    B = DTYPE_BYTES[dtype]
    train = job.mode == "train"
    m, p, v = job.microbatches, job.pp, job.chunks
    layers = build_layer_costs(model, job)
    stage_layers = assign_stage_layers(layers, job)
    memories = _check_memory(cluster, topo, model, job, stage_layers, calib)
    traffic: dict[str, dict[int, float]] = {mode: {} for mode in MODES}
    sent: dict[str, float] = dict.fromkeys(MODES, 0.0)

    def account(mode: str, cost: CommCost, times: float) -> None:
        sent[mode] += cost.bytes_sent * times
        for lid, nbytes in cost.link_bytes.items():
            traffic[mode][lid] = traffic[mode].get(lid, 0.0) + nbytes * times

    # Pipeline boundaries: every activation that leaves a stage (all chunk boundaries at once).
    boundary_bytes = max((lc.output_bytes for lc in layers if lc.kind != "head"), default=0.0)
    pp_cost = ZERO_COST
    if p > 1:
        flows = [f for s in range(p) for f in layout.pp_flows(s) if s < p - 1]
        if v > 1:  # the last stage sends its chunk outputs around to the first
            flows += [(b, a) for a, b in layout.pp_flows(0)]
        pp_cost = comm.p2p(flows, boundary_bytes)
        # Each micro-batch crosses each of the (pp x v - 1) chunk boundaries forward and back.
        boundaries = p * v - 1
        physical = len(flows) / (job.tp * job.dp)  # stage-to-stage links the flows stand for
        account("pp", pp_cost, m * (2 if train else 1) * boundaries / physical)

    stages: list[StageEstimate] = []
    backwards: list[list[float]] = []  # each stage's layers' backward seconds
    flops = 0.0
    model_flops = 0.0
    peak = 0.0
    for s, members in enumerate(stage_layers):
        devices = layout.stage_devices(s)
        sc = _stage_compute(cluster, topo, job, model.dtype, members, devices, calib)
        compute_s, windows = sc.seconds, sc.windows
        backwards.append(sc.backward)
        flops += sc.flops * m * len(devices)
        model_flops += sc.model_flops * m * len(devices)
        peak = max(peak, sc.peak)
        # Tensor-parallel collectives of one micro-batch on this stage (:mod:`.tp_calls`).
        tp_s = 0.0
        if job.tp > 1:
            costs: dict[tuple[str, float], tuple[CommCost, int]] = {}  # its cost, its calls
            bwd_s: dict[str, float] = {}
            for call in tp_allreduce_calls(members, train, job.recompute):
                key = (call.kind, call.nbytes)  # few distinct ones
                c, n = costs.get(key) or (
                    comm.collective(call.kind, layout.tp_groups(s), call.nbytes, job.allreduce),
                    0,
                )
                costs[key] = (c, n + call.count)
                if call.phase == "backward":
                    bwd_s[call.layer] = bwd_s.get(call.layer, 0.0) + c.time_s * call.count
                else:
                    tp_s += c.time_s * call.count
            for name, t in bwd_s.items():  # less what the weight-gradient GEMMs cover
                tp_s += max(0.0, t - windows.get(name, 0.0)) if job.overlap_tp_comm else t
            for c, n in costs.values():
                account("tp", c, n * m)
        ep_s = 0.0
        if job.ep > 1:  # per mixture: its tokens out and back (and their gradients); counts
            moe = [lc for lc in members if lc.ep_alltoall_bytes]
            a2a = max((lc.ep_alltoall_bytes for lc in moe), default=0.0), 4 if train else 2
            for nbytes, calls in (a2a, (max((lc.ep_counts_bytes for lc in moe), default=0.0), 1)):
                c = comm.collective("all_to_all", layout.ep_groups(s), nbytes)
                ep_s += c.time_s * calls * len(moe)
                account("ep", c, calls * len(moe) * m)
        pp_s = pp_cost.time_s * (2 if train else 1) * v if p > 1 else 0.0
        if v > 1 and job.overlap_pp_comm:
            # Megatron-Core's overlapped interleaved schedule posts each chunk's send and
            # receive ahead and computes another chunk meanwhile: what a chunk's compute does
            # not cover stays exposed.
            chunk_s = compute_s / v
            pp_s = max(0.0, pp_s - compute_s) + max(0.0, pp_cost.time_s - chunk_s)
        mem, capacity = memories[s]
        stages.append(
            StageEstimate(
                s, tuple(lc.name for lc in members), compute_s, tp_s, ep_s, pp_s, mem, capacity
            )
        )

    per_mb = [st.microbatch_s for st in stages]
    slowest = max(range(p), key=lambda i: per_mb[i])
    crit = stages[slowest]
    pipeline_s = m * per_mb[slowest] + (p - 1) / v * (sum(per_mb) / p)
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    breakdown["compute"] = m * crit.compute_s
    breakdown["tp_comm"] = m * crit.tp_comm_s
    breakdown["ep_comm"] = m * crit.ep_comm_s
    breakdown["pp_comm"] = m * crit.pp_comm_s
    breakdown["bubble"] = pipeline_s - m * per_mb[slowest]

    if train:
        params_dev = max(
            sum(lc.params_per_device for lc in ms) / (job.dp if job.zero >= 1 else 1)
            for ms in stage_layers
        )
        dev = cluster.device_types[topo.devices[layout.first_device].type_name]
        step = precision_bytes(job.precision, dtype).step_traffic
        breakdown["optimizer"] = (
            params_dev
            * step
            / (dev.memory_bw_gbyte_s * 1e9 * calib.for_device(dev).memory_efficiency)
        )
        # Gradient reduction over the data-parallel replicas (all stages at once), once per
        # round of the sync mode, its payload compressed (dmsc.netmodel.sync).
        sync = job.sync
        codec = sync.compression
        vocab = vocab_matrix(layers)
        payloads = [stage_payload(ms, B, codec, vocab) for ms in stage_layers]
        per_round = 1 / sync.inner_steps
        dp_s = expert_s = 0.0
        grad_dense = max(dense for dense, _ in payloads)
        groups = [g for s in range(p) for g in layout.dp_groups(s)]
        if job.dp > 1:
            c = exchange(comm, groups, grad_dense, codec, job.allreduce)
            dp_s = c.time_s
            account("dp", c, per_round)
            if job.zero >= 3:  # weights gathered for every forward and backward
                ag = comm.collective("all_gather", groups, grad_dense)
                dp_s += ag.time_s * 2 * m
                account("dp", ag, 2 * m)
        grad_expert = max(expert for _, expert in payloads)
        if grad_expert and job.dp // job.ep > 1:
            egroups = [g for s in range(p) for g in layout.expert_dp_groups(s)]
            c = exchange(comm, egroups, grad_expert, codec, job.allreduce)
            dp_s, expert_s = dp_s + c.time_s, c.time_s
            account("dp", c, per_round)
        window = crit.compute_s * 2 / 3  # the backward of the last micro-batch
        if job.zero >= 3:
            window += m * crit.compute_s
        inner_step_s = sum(breakdown.values())  # an iteration without its data-parallel part
        breakdown["dp_comm"] = exposed_s(dp_s, sync, job.overlap_dp_comm, window, inner_step_s)
        if job.dp > 1 and sync.inner_steps == 1 and job.overlap_dp_comm and job.zero < 3:
            # every step's all-reduce in buckets behind the backward, one at a time, as the
            # runtime runs it (dmsc.netmodel.dp_buckets); the experts' after it
            args = (comm, groups, codec, job.allreduce, stage_layers, backwards, payloads, B)
            exposed = bucketed_exposed_s(*args, bucket_bytes=job.dp_bucket_bytes)
            breakdown["dp_comm"] = expert_s + exposed

    total = sum(breakdown.values())
    by_link: dict[int, dict[str, float]] = {}
    for mode in MODES:
        for lid, nbytes in traffic[mode].items():
            by_link.setdefault(lid, dict.fromkeys(MODES, 0.0))[mode] = nbytes
    tokens = job.global_batch * (
        model.seq if isinstance(model, TransformerSpec) else model.tokens_per_sample
    )
    return Estimate(
        iteration_time_s=total,
        breakdown_s=breakdown,
        flops_per_iteration=flops,
        model_flops_per_iteration=model_flops,
        devices=job.devices,
        peak_flops_per_device=peak,
        tokens_per_iteration=tokens,
        stages=tuple(stages),
        traffic_bytes=sent,
        traffic_by_link=by_link,
        params=sum(lc.params for lc in layers),
    )
