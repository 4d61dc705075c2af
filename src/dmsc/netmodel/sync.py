"""What a data-parallel synchronisation mode and its compression cost: bytes and exposed time.

The choices, for :func:`dmsc.netmodel.iteration.estimate_iteration` and the simulator:

- **Bytes per element.** The cost model reduces gradients in the model's dtype (``B`` bytes: 2
  for bf16 weights, as Megatron-LM reduces bf16 gradients), and ``none`` keeps exactly that. The
  codecs' sizes are those of the runtime's (``dmsc.runtime.compute.compression``, whose baseline
  is fp32, 4 bytes): ``bf16`` 2, ``int8[:K]`` 1 + 4/K (an fp32 scale per block of K, 256 by
  default), each never more than ``B`` (so on bf16 gradients ``bf16`` changes nothing and
  ``int8`` halves them, less the scales); ``topk:F`` F x 8 (an int32 index and an fp32 value per
  kept element: more than ``B`` past F = B / 8, and then it costs more, as it would).
- **PowerSGD** (``powersgd:R``, Vogels et al. 2019) from the layer shapes: every weight matrix of
  ``k x n`` on a device (the linear GEMMs of its layers; the embedding table shaped as the
  output layer's, vocabulary x hidden) travels as R x (k + n) fp32 values, or as itself where
  that is not smaller; what is no matrix (norms, biases, a layer list without shapes) travels
  uncompressed at ``B``. A stage's expert gradients get the stage's ratio.
- **Collective.** ``none``, ``bf16``, ``int8`` and PowerSGD all-reduce their payload (int8
  re-quantised at each hop, PowerSGD's two factors counted as one buffer). ``topk`` cannot be
  summed on the way (the replicas keep different indices): an all-gather of every replica's
  payload, the same bytes as the all-reduce for two replicas, more beyond.
- **Rounds.** ``every-step`` exchanges every iteration; ``diloco:H``, ``fedavg:H`` and
  ``fedprox:H`` once per round of ``H`` iterations: the bytes per iteration are 1/H of a round's.
- **Overlap** (the job's ``overlap_dp_comm``): every-step hides its all-reduce under the last
  backward pass (in buckets, below) when the gradients travel as they are. Compressed (any
  codec), every step's exchange is exposed whole, as dmsc's runtime runs it: one call on the
  whole flattened gradient once the backward is done (``outer_sync``), as for a round; it was
  priced as hidden in buckets until 2026-12-03 (:func:`bucketed`). A round of local steps is
  exposed whole, ``t / H`` per iteration with overlap or without: dmsc's runtime runs a
  round's exchange (one all-reduce of the whole payload, ``DataParallel.mean``) when the
  round's last step is applied, after its backward and optimizer step, and the next round's
  steps start once it is done. Streaming
  DiLoCo (Douillard et al. 2025), which runs the exchange under the next inner steps and lets
  the outer update land late, would hide up to ``w + (H - 1) x step`` of it; it is not priced,
  because the runtime does not run it (it once was priced: a `diloco:4` task on the CPU demo
  was predicted 0.0 ms of exposed exchange a step and measured 12.0 ms). For ``H = 1`` the
  exposed time is every-step's.
- **Buckets**: with overlap, every-step's all-reduce runs in buckets behind the backward, one
  at a time, as the runtime runs it (:mod:`dmsc.netmodel.dp_buckets`): its exposed time is
  :func:`bucketed_exposed_s`, each bucket paying its own latency.
- **Through the leader** (``via: leader``: robust aggregators, central privacy and secure
  aggregation, which the runtime runs as a star,
  :func:`dmsc.runtime.compute.outer_sync.by_collective`): every replica sends its payload to
  the stage's first replica and gets the result back, all at once
  (:meth:`~dmsc.netmodel.comm.CommModel.star`): the leader's link carries ``n - 1`` payloads
  each way, at the data plane's figures, exposed whole (a replica sends once its backward is
  done). Top-k comes back as the leader's sparse sum, counted as ``n`` payloads; PowerSGD's two
  factor rounds as one payload, as for the collective.
- **The leader's own work** on what it gathers (its rule's passes over the updates: a mean, a
  median, Krum's distances) is priced beside the star (:mod:`dmsc.netmodel.leader_work`).
- **The codecs' passes** (int8's quantisation, bf16's casts, top-k's selection, PowerSGD's
  products) are priced beside the exchange, with the runtime's passes around it (the update
  flattened and assigned back; :mod:`dmsc.netmodel.codec_work`).
- **On the host**: the runtime runs the codecs and the leader's rules on host tensors (a
  gradient on a GPU is copied down and the answer back up), so on a device it computes on off
  the CPU (``cuda``) those passes go at the host's memory bandwidth, not the device's, and the
  two copies of the update are priced at the host link's rate (:func:`host_side`). The plain
  all-reduce (no codec, no leader) is priced as NCCL runs it on the devices, as the published
  systems this model is checked against run it; dmsc's runtime all-reduces over gloo on host
  copies (``dmsc.runtime.compute.dp_collective``), which this model does not price.
- **Central privacy**: the clip's passes at each replica and the leader's Gaussian draws
  (:func:`dmsc.netmodel.leader_work.privacy_work_s`), priced since 2026-12-03.
- **Secure aggregation** (``secure``): each replica's fixed-point encoding and its ``n - 1``
  pair masks (ChaCha20 keystreams at the host's measured rate), and the leader's unmasking in
  place of the mean (:func:`dmsc.netmodel.leader_work.secure_work_s`), priced since
  2026-12-04. Its int32 payload is as large as fp32's: the wire is the star's as it was.
- **Not modelled**: the outer
  optimizer's state (anchor weights and momentum, kept in host memory as OpenDiLoCo does), and
  convergence (local steps may need more iterations to the same loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmsc.netmodel.codec_work import around_bytes, codec_work_s, leader_bytes_per_element
from dmsc.netmodel.comm import CommCost, CommModel, Group
from dmsc.netmodel.constants import Calibration, DeviceCalibration
from dmsc.netmodel.dp_buckets import stage_exposed_s
from dmsc.netmodel.layers import LayerCost
from dmsc.netmodel.leader_work import leader_work_s, privacy_work_s, secure_work_s
from dmsc.spec.cluster import DeviceTypeSpec
from dmsc.spec.sync import Compression, SyncSpec

FP32 = 4.0  # bytes of an fp32 scale, index or PowerSGD factor element


def bytes_per_element(c: Compression, grad_bytes: float) -> float:
    """Bytes one gradient element costs on the wire under an element-wise codec (not PowerSGD,
    whose cost depends on shapes: :func:`stage_payload`)."""
    if c.kind == "bf16":
        return min(grad_bytes, 2.0)
    if c.kind == "int8":
        return min(grad_bytes, 1.0 + FP32 / c.block)
    if c.kind == "topk":
        return c.fraction * (FP32 + FP32)
    return grad_bytes


def vocab_matrix(layers: Sequence[LayerCost]) -> tuple[int, int] | None:
    """The shape (hidden, vocabulary per device) of the output layer's weight, which the
    embedding table shares; None for a model without one."""
    for lc in layers:
        if lc.kind == "head" and lc.gemms:
            return lc.gemms[0].k, lc.gemms[0].n
    return None


def _powersgd_bytes(
    members: Sequence[LayerCost], grad_bytes: float, rank: int, vocab: tuple[int, int] | None
) -> float:
    total = 0.0
    for lc in members:
        mats = [(g.k, g.n, g.batch) for g in lc.gemms if g.kind == "linear"]
        if lc.kind == "embedding" and vocab is not None:
            mats = [(vocab[0], vocab[1], 1)]
        elements = sum(k * n * b for k, n, b in mats)
        total += max(0.0, lc.params_per_device - elements) * grad_bytes
        total += sum(min(k * n * grad_bytes, rank * (k + n) * FP32) * b for k, n, b in mats)
    return total


def stage_payload(
    members: Sequence[LayerCost],
    grad_bytes: float,
    c: Compression,
    vocab: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """Bytes (dense, expert) one device of a stage puts into one data-parallel exchange."""
    dense = sum(lc.params_per_device - lc.expert_params_per_device for lc in members)
    expert = sum(lc.expert_params_per_device for lc in members)
    if c.kind == "none":  # the cost model's bytes as they were, operation for operation
        return dense * grad_bytes, expert * grad_bytes
    if c.kind != "powersgd":
        per = bytes_per_element(c, grad_bytes)
        return dense * per, expert * per
    full = (dense + expert) * grad_bytes
    if full <= 0:
        return 0.0, 0.0
    ratio = _powersgd_bytes(members, grad_bytes, c.rank, vocab) / full
    return dense * grad_bytes * ratio, expert * grad_bytes * ratio


def model_payload(
    stages: Sequence[Sequence[LayerCost]], grad_bytes: float, c: Compression, tp: int
) -> float:
    """Bytes of one replica's whole contribution to a round (every stage, every tensor-parallel
    rank): what crosses between two groups of replicas that each reduced theirs first."""
    vocab = vocab_matrix([lc for ms in stages for lc in ms])
    return tp * sum(sum(stage_payload(ms, grad_bytes, c, vocab)) for ms in stages)


def exchange(
    comm: CommModel,
    groups: Sequence[Group],
    payload: float,
    c: Compression,
    algorithm: str,
    via: str = "collective",
) -> CommCost:
    """One exchange of ``payload`` bytes per rank in every group at once (see the module
    docstring: an all-reduce, or an all-gather for top-k; through the leader, a star)."""
    if via == "leader":
        n = max((len(g) for g in groups), default=1)
        # top-k comes back as the leader's sparse aggregate: up to every replica's entries
        return comm.star(groups, payload, payload * n if c.kind == "topk" else payload)
    if c.kind == "topk":
        n = max((len(g) for g in groups), default=1)
        return comm.collective("all_gather", groups, payload * n)
    return comm.collective("all_reduce", groups, payload, algorithm)


def memory_bytes_s(device: DeviceTypeSpec, calib: Calibration) -> float:
    """The device's memory bandwidth as the cost model prices memory-bound work on it (the
    optimizer's step): its peak times the calibration's memory efficiency for it."""
    return device.memory_bw_gbyte_s * 1e9 * calib.for_device(device).memory_efficiency


@dataclass(frozen=True)
class HostSide:
    """Where an exchange's own work runs (:func:`work_s`): the memory bandwidth of its passes
    and, for a device the runtime computes on off the CPU, the rate of the copies between it
    and the host (one way); ``None`` where the device is the host's CPU (no copy)."""

    memory_bytes_s: float
    copy_bytes_s: float | None = None
    gaussian_s: float = DeviceCalibration.gaussian_s  # a Gaussian draw (central DP's noise)
    mask_s: float = DeviceCalibration.mask_s  # an element of a pair's secure-aggregation mask
    lowrank_s: float = DeviceCalibration.lowrank_s  # PowerSGD's products, an element at rank 4


def host_side(device: DeviceTypeSpec, calib: Calibration) -> HostSide:
    """The host side of ``device`` (module docstring): a CPU device's own memory; a GPU's host
    memory and host link, measured (the spec's ``host_memory_bw_gbyte_s`` and
    ``host_copy_gbyte_s``) or the generation's defaults."""
    dc = calib.for_device(device)
    if device.runtime_device == "cpu":
        return HostSide(memory_bytes_s(device, calib), None, dc.gaussian_s, dc.mask_s, dc.lowrank_s)
    return HostSide(
        dc.host_memory_bytes_s, dc.host_copy_bytes_s, dc.gaussian_s, dc.mask_s, dc.lowrank_s
    )


def work_s(
    sync: SyncSpec,
    n: int,
    elements: float,
    host: HostSide,
    tp: int = 1,
    leader: HostSide | None = None,
) -> float:
    """Compute on an exchange's path besides the wire, among ``n`` replicas of ``elements``
    fp32 elements an update, on ``host`` (:func:`host_side`): the codec's passes
    (:mod:`dmsc.netmodel.codec_work`) and, through the leader, its rule's and central
    privacy's (:mod:`dmsc.netmodel.leader_work`; ``tp`` ranks each draw the whole replica's
    noise), or secure aggregation's masking and unmasking in place of the leader's mean, at the
    host's memory bandwidth; off a CPU, the update copied to the host and the answer back.
    The leader's own decoding and encoding and its rule run while the followers wait for its
    answer: at ``leader``'s bandwidth where given (the host side of a device with a core to
    itself, where the devices are processes sharing a machine's cores:
    :mod:`dmsc.netmodel.core_share`)."""
    if n < 2:
        return 0.0
    alone = leader or host
    c = sync.compression
    work = codec_work_s(c, sync.via, n, elements, host.memory_bytes_s, host.lowrank_s)
    leader_bytes = elements * leader_bytes_per_element(c, sync.via, n)
    work += leader_bytes / alone.memory_bytes_s - leader_bytes / host.memory_bytes_s
    rounds = sync.inner_steps > 1  # the runtime's passes around the exchange (codec_work)
    work += elements * around_bytes(c, sync.via, n, rounds) / host.memory_bytes_s
    if sync.secure:  # the leader sums the masked ring payloads: its own passes, not the mean's
        work += secure_work_s(n, elements, host.memory_bytes_s, host.mask_s)
    # PowerSGD's leader averages the low-rank factors only, a few hundredths of the update
    elif sync.via == "leader" and c.kind != "powersgd":
        work += leader_work_s(sync.aggregator, n, elements, alone.memory_bytes_s)
    work += privacy_work_s(sync.privacy, elements, host.memory_bytes_s, host.gaussian_s, tp)
    if work > 0 and host.copy_bytes_s is not None:
        work += 2 * FP32 * elements / host.copy_bytes_s
    return work


def exposed_s(round_s: float, sync: SyncSpec, overlap: bool, window_s: float) -> float:
    """Data-parallel seconds an iteration waits for: every step's exchange of ``round_s`` less
    what the last backward (``window_s``) hides when ``overlap``; a round of local steps' whole,
    spread over its ``inner_steps`` iterations (module docstring: the runtime runs it after the
    round's last step, under nothing). The leader's star and a codec's exchange hide under
    nothing either (:func:`bucketed`)."""
    h = sync.inner_steps
    if h > 1:
        return round_s / h
    return max(0.0, round_s - window_s) if bucketed(sync, overlap) else round_s


def bucketed(sync: SyncSpec, overlap: bool) -> bool:
    """Whether every step's exchange runs in buckets behind the backward (the runtime's
    ``DistributedDataParallel``-style hooks): gradients sent as they are, by collective, with
    ``overlap``. A codec's or the leader's exchange is one call on the whole flattened gradient
    once the backward is done (:mod:`dmsc.runtime.compute.outer_sync`), exposed whole."""
    return (
        overlap
        and sync.inner_steps == 1
        and sync.via == "collective"
        and sync.compression.kind == "none"
    )


# A bucket's all-reduce seconds by (communication model, groups, bytes, codec, algorithm): the
# stages of a strategy, and the strategies of a search that differ only in their micro-batches,
# schedule or recomputation, cut the same buckets. Each entry keeps its model, so that no id is
# reused while the entry lives (as compute.py's layer times).
_BUCKET_S: dict[tuple[object, ...], tuple[CommModel, float]] = {}


def bucketed_exposed_s(
    comm: CommModel,
    groups: Sequence[Group],
    codec: Compression,
    algorithm: str,
    stages: Sequence[Sequence[LayerCost]],
    backwards: Sequence[Sequence[float]],
    payloads: Sequence[tuple[float, float]],
    grad_bytes: float,
    bucket_bytes: float | None = None,
) -> float:
    """The exposed seconds of the dense gradients' all-reduce: the slowest stage's, each from
    the end of its own backward (:func:`dmsc.netmodel.dp_buckets.stage_exposed_s`, buckets of
    ``bucket_bytes`` raw gradient bytes, None the runtime's), every stage's ``groups`` reducing
    at once, a bucket's bytes compressed as the stage's payload (``payloads``, dense and expert
    bytes per device, :func:`stage_payload`) is to its raw gradients (``grad_bytes`` an
    element)."""
    worst = 0.0
    shape = tuple(tuple(g) for g in groups)
    for members, backward, (dense, _) in zip(stages, backwards, payloads, strict=True):
        raw = sum(lc.params_per_device - lc.expert_params_per_device for lc in members)
        ratio = dense / (raw * grad_bytes) if raw > 0 else 1.0

        def allreduce_s(nbytes: float, ratio: float = ratio) -> float:
            key = (id(comm), shape, nbytes * ratio, codec, algorithm)
            hit = _BUCKET_S.get(key)
            if hit is None or hit[0] is not comm:
                if len(_BUCKET_S) >= 4096:
                    _BUCKET_S.clear()
                t = exchange(comm, groups, nbytes * ratio, codec, algorithm).time_s
                hit = _BUCKET_S[key] = (comm, t)
            return hit[1]

        exposed = stage_exposed_s(members, backward, grad_bytes, allreduce_s, bucket_bytes)
        worst = max(worst, exposed)
    return worst
