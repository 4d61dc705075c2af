"""Devices that are processes on one machine's cores: a job's share of them.

A calibrated CPU cluster (``dmsc calibrate``) describes this machine's cores as devices: each a
worker process, all on the same cores. Its device types carry one process's rate on a core of
its own, and the cluster its ``shared_cores``. A job on ``k`` of the devices runs ``k``
processes at once (a pipeline's steady state, a data-parallel step), so each gets
``min(1, shared_cores / k)`` of a core: :func:`on_cores` is the cluster as the cost model sees
it for that job, each device type's peak FLOP/s and memory bandwidth times that share (and its
times to draw a Gaussian, to expand a secure-aggregation mask, PowerSGD's products and a
mixture's routing over it).

A node's measured collective (``collective``, a gloo all-reduce of two processes with a core
each) runs at the same share: its bandwidth times it, its latency over it (:func:`on_cores`).
Call by call on this machine, with four workers on two cores, moe-mini's tensor-parallel
all-reduces took 1.44 ms at the median against 0.5-0.7 ms with a core each, and its expert
all-to-alls 0.84 against 0.32 (2026-12-05): the whole spread moved, not a few calls. Priced
without the share, the collectives of the runs with four workers measured 1.8-2.6 times their
prediction (``parallel_modes_cpu.json``, ``reruns_2026_12_05_in_step_3``). The point-to-point
sends (the pipeline's, the star's) keep the link's figures: the star at dp = 4, four workers,
measured 0.79-0.98 of its price without the share.

Through the leader (a star), the followers wait while the stages' leaders decode their updates,
apply their rule and encode the answer: those passes run at the share of the busy leaders (one
a stage and tensor-parallel rank), a whole core each on this machine for one stage, where the
rest of the exchange runs at the job's (:func:`dmsc.netmodel.sync.work_s`). At the job's share,
gpt-mini's dp = 4 star (four workers on two cores) measured 0.76-1.03 of its prediction in 24
stored rounds priced again at the job's share, 16 within 15%, and 0.89-1.21 at the leader's, 21
within (``benchmarks/repredict_modes.py --every-mode``, on its stand-in link: those rounds kept
none).

The share was fixed when the spec was written (the cores over all the cluster's devices) until
2026-12-03: a pp = 2 plan on a calibrated node of 4 devices over 2 cores was predicted at half
a core per stage, and ran on a core each (its pipeline's waits predicted 57 ms, measured 38).
"""

from __future__ import annotations

from dmsc.netmodel.constants import DEFAULT_CALIBRATION
from dmsc.spec.cluster import ClusterSpec, CollectiveSpec

_MEMO: dict[tuple[int, int], tuple[ClusterSpec, ClusterSpec]] = {}
_MEMO_MAX = 256


def core_share(cluster: ClusterSpec, devices: int) -> float:
    """The share of a core each of ``devices`` busy devices of ``cluster`` gets (1 where the
    devices are not processes sharing cores)."""
    if cluster.shared_cores is None:
        return 1.0
    return min(1.0, cluster.shared_cores / max(1, devices))


def shared_collective(c: CollectiveSpec, share: float) -> CollectiveSpec:
    """The measured collective ``c`` of processes that each get ``share`` of a core: its
    bandwidths times the share, its latencies over it (module docstring)."""
    return c.model_copy(
        update={
            "bandwidth_gbit_s": c.bandwidth_gbit_s * share,
            "latency_us": c.latency_us / share,
            "bandwidth_awake_gbit_s": None
            if c.bandwidth_awake_gbit_s is None
            else c.bandwidth_awake_gbit_s * share,
            "latency_awake_us": None if c.latency_awake_us is None else c.latency_awake_us / share,
        }
    )


def on_cores(cluster: ClusterSpec, devices: int) -> ClusterSpec:
    """``cluster`` as a job on ``devices`` of its devices runs on it: ``cluster`` itself where
    they do not share cores or each gets a whole one, else a copy whose device types' rates and
    nodes' measured collectives (:func:`shared_collective`) are scaled by :func:`core_share`
    and which has no ``shared_cores`` (its rates are the job's
    already). The copy is kept for the next call with the same cluster object and count: a
    strategy search asks many times."""
    share = core_share(cluster, devices)
    if share >= 1.0:
        return cluster
    key = (id(cluster), devices)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is cluster:
        return hit[1]
    types = {
        name: dev.model_copy(
            update={
                "peak_tflops": {k: v * share for k, v in dev.peak_tflops.items()},
                "memory_bw_gbyte_s": dev.memory_bw_gbyte_s * share,
                # a draw is compute: it shares the core too (the default where none measured)
                "gaussian_ns": (
                    dev.gaussian_ns or DEFAULT_CALIBRATION.for_device(dev).gaussian_s * 1e9
                )
                / share,
                "mask_ns": (dev.mask_ns or DEFAULT_CALIBRATION.for_device(dev).mask_s * 1e9)
                / share,
                "lowrank_ns": (
                    dev.lowrank_ns or DEFAULT_CALIBRATION.for_device(dev).lowrank_s * 1e9
                )
                / share,
                # a mixture's routing is compute too (unmeasured: memory passes, scaled above)
                "dispatch_ns": None if dev.dispatch_ns is None else dev.dispatch_ns / share,
            }
        )
        for name, dev in cluster.device_types.items()
    }
    nodes = {
        name: node.model_copy(update={"collective": shared_collective(node.collective, share)})
        if node.collective is not None
        else node
        for name, node in cluster.node_types.items()
    }
    # the rates now the share's: a copy that shares no further (on_cores of it is itself)
    shared = cluster.model_copy(
        update={"device_types": types, "node_types": nodes, "shared_cores": None}
    )
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    _MEMO[key] = (cluster, shared)
    return shared
