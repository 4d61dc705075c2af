"""How an estimate reads: a rich table for people, a JSON object for programs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dmsc.cli.tables import FoldTable
from dmsc.spec import ClusterSpec, JobSpec, LayerListSpec, TransformerSpec

if TYPE_CHECKING:  # the cost model (networkx: 0.2 s) loads only for the commands that use it
    from dmsc.netmodel import Estimate, Topology

GIB = 1024**3


def nan_to_null(obj: Any) -> Any:
    """``obj`` with every NaN float (of dicts and lists, at any depth) as None: JSON has no NaN."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nan_to_null(v) for v in obj]
    return obj


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def human_flops(flop_s: float) -> str:
    """FLOP/s with a unit that keeps three digits: a CPU's 0.02 TFLOP/s is 20.0 GFLOP/s."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if abs(flop_s) >= scale:
            return f"{flop_s / scale:.1f} {unit}"
    return f"{flop_s / 1e6:.1f} MFLOP/s"


def human_gib(gib: float) -> str:
    """Memory given in GiB, in GiB or (below one) MiB: 0.01 GiB is 10.2 MiB, not 0.0 GiB."""
    if abs(gib) >= 1:
        return f"{gib:.1f} GiB"
    return f"{gib * 1024:.1f} MiB"


def measured_vs_predicted(measured: float, predicted: float) -> str:
    """Which way a measurement missed its prediction, in words: "measured 12.0% slower than
    predicted" when it took longer (times: larger is slower)."""
    if predicted <= 0 or measured <= 0:
        return "no prediction to compare with"
    diff = (measured / predicted - 1) * 100
    if abs(diff) < 0.05:
        return "measured as predicted"
    return f"measured {abs(diff):.1f}% {'slower' if diff > 0 else 'faster'} than predicted"


def prediction_words(measured: float, predicted: float | None, basis: str) -> str:
    """The prediction of the job that ran beside its measurement ("predicted 200.0 ms: measured
    12.0% slower than predicted", what the prediction is when not the plan's), or why there is
    none to compare with (``basis``:
    :class:`dmsc.runtime.control.advisors.prediction.Prediction`'s)."""
    if predicted is None:
        return basis
    what = "" if basis == "the plan's" else f", {basis}"
    return f"predicted {predicted * 1e3:.1f} ms{what}: {measured_vs_predicted(measured, predicted)}"


def fit_table(*headers: str, keep: tuple[int, ...] = (), **kwargs: Any) -> FoldTable:
    """A table that never cuts what it shows (:class:`FoldTable`): on a narrow terminal its
    cells wrap at their spaces, its borders go, or its rows become records, before a word is
    split. The columns in ``keep`` (SIDs, addresses: what gets copied) stay on one line."""
    t = FoldTable(**kwargs)
    for i, header in enumerate(headers):
        if i in keep:
            t.add_column(header, no_wrap=True, overflow="fold", min_width=len(header))
        else:
            t.add_column(header, overflow="fold")
    return t


def traffic_by_link_kind(est: Estimate, topo: Topology) -> dict[str, float]:
    """Bytes carried by the links of each kind (device, node uplink, inter-DC), all modes."""
    out = {"device": 0.0, "node": 0.0, "interdc": 0.0}
    for lid, modes in est.traffic_by_link.items():
        out[topo.links[lid].kind] += sum(modes.values())
    return out


def busiest_links(est: Estimate, topo: Topology, top: int = 10) -> list[dict[str, Any]]:
    rows = sorted(est.traffic_by_link.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    out = []
    for lid, modes in rows:
        link = topo.links[lid]
        out.append(
            {
                "link": f"{link.u}--{link.v}",
                "kind": link.kind,
                "bytes": sum(modes.values()),
                "by_mode": modes,
            }
        )
    return out


def calibration_json(cluster: ClusterSpec) -> dict[str, Any]:
    """The calibration an estimate used, device type by device type: its generation's constants
    (or the curves measured on it), and where that generation was validated against published
    measurements (a device no validation covers is said so)."""
    from dataclasses import asdict

    from dmsc.netmodel import DEFAULT_CALIBRATION

    calib = DEFAULT_CALIBRATION
    devices = []
    for name in sorted(cluster.device_types):
        dc = calib.for_device(cluster.device_types[name])
        devices.append(
            {
                "device_type": name,
                "generation": dc.generation,
                "gemm_efficiency": dc.gemm_efficiency,
                "fp8_gemm_efficiency": dc.fp8_gemm_efficiency,
                "attention_efficiency": dc.attention_efficiency,
                "memory_efficiency": dc.memory_efficiency,
                "framework_gib": dc.framework_bytes / 2**30,
                "measured": dc.measured_source,
                "sources": dc.sources,
                "validated": [asdict(v) for v in dc.validated],
            }
        )
    return {
        "name": calib.name,
        "devices": devices,
        # device types that neither a published set nor a measurement of their own covers
        "unvalidated_devices": [
            d["device_type"] for d in devices if not d["validated"] and not d["measured"]
        ],
    }


def calibration_line(cluster: ClusterSpec) -> str:
    parts = []
    for d in calibration_json(cluster)["devices"]:
        head = f"{d['device_type']}: {d['generation']} constants"
        if d["measured"]:
            head = f"{d['device_type']}: measured ({d['measured']})"
        sets = ", ".join(
            f"{v['set_name']} {v['mean_abs_error_pct']:.1f}% mean / "
            f"{v['max_abs_error_pct']:.1f}% max over {v['rows']} rows"
            for v in d["validated"]
        )
        parts.append(
            f"{head}, validated on {sets}" if sets else f"{head}, not validated on published data"
        )
    return "calibration " + "; ".join(parts) + " (error of the predicted throughput)"


def estimate_json(
    est: Estimate,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    topo: Topology,
) -> dict[str, Any]:
    fullest = max(est.stages, key=lambda s: s.memory.total)
    return {
        "cluster": cluster.name,
        "calibration": calibration_json(cluster),
        "model": {"name": model.name, "params": est.params},
        "job": job.model_dump(),
        "iteration_time_s": est.iteration_time_s,
        "tflops_per_gpu": est.tflops_per_gpu,
        "mfu": est.mfu,
        "tokens_per_s": est.tokens_per_s,
        "memory_gib_per_device": est.memory_per_device / GIB,
        "memory_breakdown_gib": {
            "weights": fullest.memory.weights / GIB,
            "gradients": fullest.memory.gradients / GIB,
            "optimizer": fullest.memory.optimizer / GIB,
            "activations": fullest.memory.activations / GIB,
            "working": fullest.memory.working / GIB,
            "framework": fullest.memory.framework / GIB,
            "fragmentation": fullest.memory.fragmentation / GIB,
        },
        # what must fit in the device: all but the allocator's fragmentation
        "required_memory_gib_per_device": max(s.memory.required for s in est.stages) / GIB,
        # what torch.cuda.max_memory_allocated would report (tensors only)
        "tensor_memory_gib_per_device": fullest.memory.tensors / GIB,
        "breakdown_s": dict(est.breakdown_s),
        "traffic_bytes": dict(est.traffic_bytes),
        "traffic_by_link_kind_bytes": traffic_by_link_kind(est, topo),
        "busiest_links": busiest_links(est, topo),
        "stages": [
            {
                "index": s.index,
                "layers": len(s.layers),
                "first_layer": s.layers[0] if s.layers else None,
                "last_layer": s.layers[-1] if s.layers else None,
                "microbatch_s": s.microbatch_s,
                "memory_gib": s.memory.total / GIB,
            }
            for s in est.stages
        ],
    }


def print_estimate(
    console: Console,
    est: Estimate,
    cluster: ClusterSpec,
    model: TransformerSpec | LayerListSpec,
    job: JobSpec,
    topo: Topology,
) -> None:
    title = (
        f"{model.name} ({est.params / 1e9:.2f} B params) on {cluster.name}: "
        f"{job.mode}, tp={job.tp} pp={job.pp} dp={job.dp} ep={job.ep}, "
        f"{job.schedule}{f' v={job.interleave}' if job.chunks > 1 else ''}, "
        f"batch {job.global_batch}/{job.micro_batch}, recompute {job.recompute}, "
        f"{job.attention} attention, {job.precision} precision"
        + (f", sync {job.sync.label}" if job.sync != type(job.sync)() else "")
    )
    console.print(title, style="bold", highlight=False)
    console.print(calibration_line(cluster), style="dim", highlight=False)
    t = FoldTable(show_header=True)
    t.add_column("iteration", style="bold")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    from dmsc.netmodel import BREAKDOWN_KEYS

    for key in BREAKDOWN_KEYS:
        value = est.breakdown_s[key]
        t.add_row(key, human_seconds(value), f"{value / est.iteration_time_s * 100:.1f}%")
    t.add_row("total", human_seconds(est.iteration_time_s), "100%", style="bold")
    console.print(t)

    perf = FoldTable(show_header=False, box=None)
    perf.add_row("TFLOP/s per device", f"{est.tflops_per_gpu:.1f}")
    perf.add_row("model FLOPs utilisation", f"{est.mfu * 100:.1f}%")
    perf.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    fullest = max(est.stages, key=lambda s: s.memory.total)
    mem = fullest.memory
    perf.add_row(
        "memory per device",
        f"{mem.total / GIB:.1f} GiB of {fullest.memory_capacity / GIB:.0f} "
        f"(weights {mem.weights / GIB:.1f}, grads {mem.gradients / GIB:.1f}, "
        f"optimizer {mem.optimizer / GIB:.1f}, activations {mem.activations / GIB:.1f}, "
        f"backward working {mem.working / GIB:.1f}, framework {mem.framework / GIB:.1f}, "
        f"fragmentation {mem.fragmentation / GIB:.1f}; {mem.required / GIB:.1f} GiB must fit)",
    )
    traffic = ", ".join(f"{k.upper()} {human_bytes(v)}" for k, v in est.traffic_bytes.items())
    perf.add_row("traffic per iteration", traffic)
    kinds = traffic_by_link_kind(est, topo)
    perf.add_row(
        "carried by links",
        f"device {human_bytes(kinds['device'])}, node uplinks {human_bytes(kinds['node'])}, "
        f"inter-DC {human_bytes(kinds['interdc'])}",
    )
    console.print(perf)
