"""Whether a job can run before it is costed: its shapes (:func:`check_fit`) and the memory of
each stage's devices (:func:`check_memory`); :class:`DoesNotFit` names the reason."""

from __future__ import annotations

from dmsc.netmodel.constants import DTYPE_BYTES, Calibration
from dmsc.netmodel.memory import MemoryBreakdown, stage_memory
from dmsc.netmodel.parallel import Layout
from dmsc.netmodel.stage_sums import Columns, StageCut
from dmsc.netmodel.topology import Topology
from dmsc.spec.cluster import ClusterSpec
from dmsc.spec.job import JobSpec
from dmsc.spec.model import LayerListSpec, TransformerSpec

GIB = 1024**3


class DoesNotFit(ValueError):
    """The job cannot run on the cluster as configured; ``reasons`` says why."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("; ".join(reasons))


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


def stage_types(cluster: ClusterSpec, topo: Topology, layout: Layout, stage: int) -> set[str]:
    """The device types among a stage's devices (a cluster of one type needs no look)."""
    if len(cluster.device_types) == 1:
        return set(cluster.device_types)
    return {topo.devices[d].type_name for d in layout.stage_devices(stage)}


def check_memory(
    cluster: ClusterSpec,
    topo: Topology,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    cols: Columns,
    cut: StageCut,
    calib: Calibration,
) -> list[tuple[MemoryBreakdown, float]]:
    """Memory and capacity per device of every stage; :class:`DoesNotFit` if one overflows."""
    layout = Layout.of(job)
    B = DTYPE_BYTES[model.dtype]
    train = job.mode == "train"
    out: list[tuple[MemoryBreakdown, float]] = []
    for s, take in enumerate(cut.getters):
        types = stage_types(cluster, topo, layout, s)
        dense = sum(take(cols.dense))
        expert = sum(take(cols.expert))
        # Weight matrices of the blocks, of which autocast and fp8 keep cast copies.
        matrices = sum(take(cols.matrices))
        # forward only: one layer's working set at a time
        acts = sum(take(cols.activations)) if train else max(take(cols.activations), default=0.0)
        if not train and isinstance(model, TransformerSpec):  # KV cache of the prompt
            n_blocks = sum(take(cols.blocks))
            kv = 2 * n_blocks * job.micro_batch * model.seq * model.kv_heads_count
            acts += kv * model.head_dim * B / job.tp
        working = max(take(cols.working), default=0.0) if train else 0.0
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
