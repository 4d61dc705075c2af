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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from dmsc.netmodel.comm import ZERO_COST, CommCost, CommModel
from dmsc.netmodel.compute import DtypeUnsupported, LayerTime, layer_time, peak_flops
from dmsc.netmodel.constants import DEFAULT_CALIBRATION, DTYPE_BYTES, Calibration
from dmsc.netmodel.core_share import core_share, on_cores
from dmsc.netmodel.fit import DoesNotFit, check_fit, check_memory, stage_types
from dmsc.netmodel.layers import LayerCost, build_layer_costs
from dmsc.netmodel.memory import MemoryBreakdown, precision_bytes
from dmsc.netmodel.parallel import Layout
from dmsc.netmodel.stage_sums import RECOMPUTED, assign_stage_layers, columns, stage_cut
from dmsc.netmodel.sync import (
    bucketed,
    bucketed_exposed_s,
    exchange,
    exposed_s,
    host_side,
    stage_payload,
    vocab_matrix,
    work_s,
)
from dmsc.netmodel.sync import memory_bytes_s as device_memory_bytes_s
from dmsc.netmodel.topology import Topology
from dmsc.netmodel.tp_calls import sequence_edges, tp_allreduce_calls
from dmsc.spec.cluster import ClusterSpec
from dmsc.spec.job import JobSpec
from dmsc.spec.model import LayerListSpec, TransformerSpec

MODES = ("dp", "pp", "tp", "ep")
BREAKDOWN_KEYS = ("compute", "tp_comm", "pp_comm", "dp_comm", "ep_comm", "bubble", "optimizer")
__all__ = ["DoesNotFit", "assign_stage_layers", "check_fit"]  # where callers have them from


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


class LinkTraffic(Mapping[int, dict[str, float]]):
    """Bytes on each link by mode (link id -> mode -> bytes), added up from an iteration's calls
    when first read: a strategy search costs dozens of strategies and reads the links of one."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, CommCost, float]] = []
        self._links: dict[int, dict[str, float]] | None = None

    def add(self, mode: str, cost: CommCost, times: float) -> None:
        self._calls.append((mode, cost, times))
        self._links = None

    def _table(self) -> dict[int, dict[str, float]]:
        if self._links is None:
            by_mode: dict[str, dict[int, float]] = {mode: {} for mode in MODES}
            for mode, cost, times in self._calls:
                into = by_mode[mode]
                for lid, nbytes in cost.link_bytes.items():
                    into[lid] = into.get(lid, 0.0) + nbytes * times
            links: dict[int, dict[str, float]] = {}
            for mode in MODES:
                for lid, nbytes in by_mode[mode].items():
                    row = links.get(lid)
                    if row is None:
                        row = links[lid] = dict.fromkeys(MODES, 0.0)
                    row[mode] = nbytes
            self._links = links
        return self._links

    def __getitem__(self, lid: int) -> dict[str, float]:
        return self._table()[lid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


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
    traffic_by_link: Mapping[int, dict[str, float]] = field(repr=False)
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
    types: set[str],
    calib: Calibration,
) -> _StageCompute:
    train = job.mode == "train"
    compute_s = flops = model_flops = peak = 0.0
    windows: dict[str, float] = {}
    backward = [0.0] * len(members)
    for tname in types:
        dtype_spec = cluster.device_types[tname]
        t_total = 0.0
        for i, lc in enumerate(members):
            policy = job.recompute if lc.kind in RECOMPUTED else "none"
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
    costs a strategy in full only when this bound can still beat what it has.

    Its stages' sums come from the layers' columns (:mod:`.stage_sums`): the same numbers as
    :func:`_stage_compute`'s and :func:`estimate_iteration`'s, without a loop over the layers."""
    reasons = check_fit(cluster, model, job)
    if reasons:
        raise DoesNotFit(reasons)
    cluster = on_cores(cluster, job.devices)
    topo = topology if topology is not None else Topology(cluster)
    layout = Layout.of(job)
    layers = build_layer_costs(model, job)
    cols, cut = columns(layers), stage_cut(layers, job)
    check_memory(cluster, topo, model, job, cols, cut, calib)
    train = job.mode == "train"
    per_mb: list[float] = []
    for s, take in enumerate(cut.getters):
        compute_s = 0.0
        for tname in stage_types(cluster, topo, layout, s):
            times, unsupported = cols.seconds(
                cluster.device_types[tname], model.dtype, job.recompute, calib, train
            )
            for i in cut.indices[s] if unsupported else ():
                if i in unsupported:
                    raise DoesNotFit([f"device type {tname!r}: {unsupported[i]}"])
            compute_s = max(compute_s, sum(take(times)))
        per_mb.append(compute_s)
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
    own_cores = core_share(cluster, job.devices) >= 1.0  # each device a core of its own
    # while the followers wait for their answer, the stages' leaders work alone
    leaders = on_cores(cluster, job.pp * job.tp)
    cluster = on_cores(cluster, job.devices)  # devices that share a machine's cores
    topo = topology if topology is not None else Topology(cluster)
    comm = comm_model if comm_model is not None else CommModel(topo, calib)
    awake = comm.awake_view()  # the tp and ep collectives, waited for awake (.comm)
    layout = Layout.of(job)
    dtype = model.dtype
    B = DTYPE_BYTES[dtype]
    train = job.mode == "train"
    m, p, v = job.microbatches, job.pp, job.chunks
    layers = build_layer_costs(model, job)
    cut = stage_cut(layers, job)
    stage_layers = assign_stage_layers(layers, job)
    memories = check_memory(cluster, topo, model, job, columns(layers), cut, calib)
    by_link = LinkTraffic()
    sent: dict[str, float] = dict.fromkeys(MODES, 0.0)

    def account(mode: str, cost: CommCost, times: float) -> None:
        sent[mode] += cost.bytes_sent * times
        by_link.add(mode, cost, times)

    # Pipeline boundaries: every activation that leaves a stage (all chunk boundaries at once).
    boundary_bytes = max((lc.output_bytes for lc in layers if lc.kind != "head"), default=0.0)
    pp_cost = ZERO_COST
    if p > 1:
        flows = [f for s in range(p - 1) for f in layout.pp_flows(s)]
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
    ends = sequence_edges(layers, job.sequence_parallel and train, job.sequence_parallel_edges)
    for s, members in enumerate(stage_layers):
        devices = layout.stage_devices(s)
        types = stage_types(cluster, topo, layout, s)
        sc = _stage_compute(cluster, topo, job, model.dtype, members, types, calib)
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
            sp = job.sequence_parallel
            for call in tp_allreduce_calls(members, train, job.recompute, sp, ends):
                key = (call.kind, call.nbytes)  # few distinct ones
                c, n = costs.get(key) or (
                    awake.collective(call.kind, layout.tp_groups(s), call.nbytes, job.allreduce),
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
            counts = max((lc.ep_counts_bytes for lc in moe), default=0.0), 1
            for (nbytes, calls), even in ((a2a, job.expert_imbalance), (counts, 1.0)):
                c = awake.collective("all_to_all", layout.ep_groups(s), nbytes)
                ep_s += c.time_s * calls * len(moe)
                # the tokens' bytes through the busiest rank set the time; every token crosses
                # once all the same (JobSpec.expert_imbalance)
                account("ep", c, calls * len(moe) * m / even)
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
        dev_name = topo.devices[layout.first_device].type_name
        dev = cluster.device_types[dev_name]
        step = precision_bytes(job.precision, dtype).step_traffic
        memory_bytes_s = device_memory_bytes_s(dev, calib)
        breakdown["optimizer"] = params_dev * step / memory_bytes_s
        host = host_side(dev, calib)  # where the exchange's codec and leader work runs
        alone = host_side(leaders.device_types[dev_name], calib)  # the leader's own passes
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
        whole = not bucketed(sync, job.overlap_dp_comm)  # one call on the whole update
        window = crit.compute_s * 2 / 3  # the backward of the last micro-batch
        if job.dp > 1:
            c = exchange(comm, groups, grad_dense, codec, job.allreduce, sync.via)
            dense = max(
                sum(lc.params_per_device - lc.expert_params_per_device for lc in ms)
                for ms in stage_layers
            )
            # and the compute on its path: the codec's passes, the leader's rule (sync.work_s)
            dp_s = c.time_s + work_s(sync, job.dp, dense, host, job.tp, alone)
            if whole:  # the replicas agree on a quorum first (CommModel.quorum_s) ...
                quorum = comm.quorum_s(groups)
                if sync.via == "collective" and sync.inner_steps == 1:
                    # ... every step's by collective in the backward, as the buckets' is
                    # (dmsc.runtime.compute.dp_collective.DataParallel.agreed): exposed only
                    # where the last backward is shorter
                    quorum = max(0.0, quorum - window)
                dp_s += quorum
            account("dp", c, per_round)
            if job.zero >= 3:  # weights gathered for every forward and backward
                ag = comm.collective("all_gather", groups, grad_dense)
                dp_s += ag.time_s * 2 * m
                account("dp", ag, 2 * m)
        grad_expert = max(expert for _, expert in payloads)
        if grad_expert and job.dp // job.ep > 1:
            egroups = [g for s in range(p) for g in layout.expert_dp_groups(s)]
            c = exchange(comm, egroups, grad_expert, codec, job.allreduce, sync.via)
            experts = max(sum(lc.expert_params_per_device for lc in ms) for ms in stage_layers)
            expert_s = c.time_s + work_s(sync, job.dp // job.ep, experts, host, job.tp, alone)
            if whole:
                expert_s += comm.quorum_s(egroups)
            dp_s += expert_s
            account("dp", c, per_round)
        if job.zero >= 3:
            window += m * crit.compute_s
        breakdown["dp_comm"] = exposed_s(dp_s, sync, job.overlap_dp_comm, window)
        if job.dp > 1 and bucketed(sync, job.overlap_dp_comm) and job.zero < 3:
            # every step's all-reduce in buckets behind the backward, one at a time, as the
            # runtime runs it (dmsc.netmodel.dp_buckets); the experts' after it. The step
            # spins for gloo's own ring: on cores of their own, priced so (topology.SPUN_CALL)
            spun = comm.spun_view() if own_cores else comm
            if spun is not comm and comm.all_reduce_choice(groups, grad_dense, job.allreduce) != (
                "ring"
            ):
                spun = comm
            args = (spun, groups, codec, job.allreduce, stage_layers, backwards, payloads, B)
            exposed = bucketed_exposed_s(*args, bucket_bytes=job.dp_bucket_bytes)
            breakdown["dp_comm"] = expert_s + exposed

    total = sum(breakdown.values())
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
