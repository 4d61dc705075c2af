"""The cluster spec: device types, node types, datacenters and the links between them.

Units are in the field names: ``*_gbit_s`` is Gbit/s (links), ``*_gbyte_s`` GB/s (memory),
``*_us`` microseconds, ``km`` kilometres, ``*_ghz`` GHz of optical spectrum.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dmsc.spec.devices import DEVICE_PRESETS, Generation, generation_from_name
from dmsc.spec.residency import ResidencySpec

Dtype = Literal["fp32", "tf32", "fp16", "bf16", "fp8", "int8"]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Name = Annotated[str, Field(min_length=1, max_length=128)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Fraction = Annotated[float, Field(gt=0, le=1)]
CurvePoint = tuple[PositiveFloat, Fraction]


class MeasuredEfficiency(_Spec):
    """Efficiencies measured on one device type; the cost model uses them in place of its
    generation's calibration (``dmsc calibrate`` writes them).

    A curve is a list of ``[gflop, fraction]`` points, ``gflop`` the forward FLOPs of one call in
    GFLOP (increasing), ``fraction`` the share of the data type's peak it reached; between points
    the fraction is interpolated in log(gflop), outside them it is the nearest point's.
    """

    source: str = Field(min_length=1, description="Where, when and how it was measured.")
    gemm: dict[Dtype, list[CurvePoint]] = Field(
        default_factory=dict, description="Matrix products (tensor cores) by data type."
    )
    attention: dict[Dtype, list[CurvePoint]] = Field(
        default_factory=dict,
        description="The fused (flash) attention kernel, forward, by data type.",
    )
    memory: Fraction | None = Field(
        default=None, description="Share of memory_bw_gbyte_s a streaming kernel reached."
    )
    framework_gib: NonNegativeFloat | None = Field(
        default=None,
        description="Device memory in use outside tensors (CUDA context, library workspaces).",
    )

    @model_validator(mode="after")
    def _increasing(self) -> Self:
        for kind in ("gemm", "attention"):
            for dtype, points in getattr(self, kind).items():
                if not points:
                    raise ValueError(f"{kind}.{dtype}: a curve needs at least one point")
                xs = [x for x, _ in points]
                if any(b <= a for a, b in pairwise(xs)):
                    raise ValueError(f"{kind}.{dtype}: gflop must increase from point to point")
        return self


class DeviceTypeSpec(_Spec):
    """One kind of accelerator (or CPU): its peak compute, memory and memory bandwidth."""

    preset: str | None = Field(
        default=None,
        description=(
            "A device the project knows (" + ", ".join(DEVICE_PRESETS) + "): its figures and "
            "generation, under what this spec gives."
        ),
    )
    generation: Generation | None = Field(
        default=None,
        description=(
            "Which calibration of the cost model applies (default: the preset's, else the one "
            "the device type's name contains, else generic)."
        ),
    )
    peak_tflops: dict[Dtype, PositiveFloat] = Field(
        description="Peak dense TFLOP/s by data type (tensor cores where the device has them)."
    )
    memory_gib: PositiveFloat = Field(description="Device memory in GiB.")
    memory_bw_gbyte_s: PositiveFloat = Field(description="Peak memory bandwidth in GB/s.")
    sm_count: int | None = Field(
        default=None,
        gt=0,
        description="Streaming multiprocessors (GPUs): used for the wave quantization of GEMMs.",
    )
    op_overhead_us: float | None = Field(
        default=None,
        gt=0,
        description="Fixed cost of one kernel (launch, framework dispatch); measured by calibrate.",
    )
    host_op_us: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Host (CPU) time to issue one kernel from eager PyTorch, as the cost model counts "
            "kernels (an accelerator's steps cannot run faster than their kernels are issued); "
            "measured by calibrate --device cuda."
        ),
    )
    host_memory_bw_gbyte_s: PositiveFloat | None = Field(
        default=None,
        description=(
            "For a device the runtime computes on off the CPU (cuda): the memory bandwidth one "
            "worker thread reaches on its host, GB/s of a tensor copy (read + write), at which "
            "the data-parallel codecs' and the leader's passes run (on the host); measured by "
            "calibrate --device cuda. Unset: the cost model's default (20 GB/s)."
        ),
    )
    host_copy_gbyte_s: PositiveFloat | None = Field(
        default=None,
        description=(
            "For a device the runtime computes on off the CPU (cuda): GB/s of a copy between it "
            "and its host's pageable memory, one way (the mean of the two), as the runtime "
            "copies a gradient down for the codecs or the leader and the answer back; measured "
            "by calibrate --device cuda. Unset: the generation's PCIe default."
        ),
    )
    gaussian_ns: PositiveFloat | None = Field(
        default=None,
        description=(
            "Nanoseconds one thread of the host takes to draw one fp32 Gaussian (torch.randn), "
            "at which the stage leader draws central differential privacy's noise; measured by "
            "calibrate. Unset: the cost model's default (6 ns)."
        ),
    )
    mask_ns: PositiveFloat | None = Field(
        default=None,
        description=(
            "Nanoseconds one thread of the host takes to expand one element of a pair's "
            "secure-aggregation mask (a ChaCha20 keystream, widened to int64), at which each "
            "replica masks its update; measured by calibrate. Unset: the cost model's default "
            "(1.4 ns)."
        ),
    )
    lowrank_ns: PositiveFloat | None = Field(
        default=None,
        description=(
            "Nanoseconds one thread of the host takes, per element of a gradient matrix, for "
            "PowerSGD's four rank-4 products with it (P = M Q, Q = M^T P, the answer P Q^T and "
            "the error M - P Q^T) as the runtime's codec runs them; measured by calibrate. "
            "Unset: the cost model's default."
        ),
    )
    dispatch_ns: PositiveFloat | None = Field(
        default=None,
        description=(
            "Nanoseconds the device takes per routed element (a token's hidden vector sent to "
            "one of its chosen experts) for the runtime's mixture-of-experts routing, dispatch "
            "and combine, forward or backward (the experts' and the router's products apart); "
            "measured by calibrate. Unset: priced as passes over memory."
        ),
    )
    measured: MeasuredEfficiency | None = Field(
        default=None, description="Efficiencies measured on this device (dmsc calibrate)."
    )
    accelerator: Literal["cuda", "cpu"] | None = Field(
        default=None,
        description=(
            "What the runtime runs a micro-model on: cuda (a GPU, cuda:N on its node) or cpu. "
            "Default: cuda for a GPU generation (a100, h100, h200, b200), cpu otherwise."
        ),
    )

    @property
    def runtime_device(self) -> Literal["cuda", "cpu"]:
        """Where the runtime computes on a device of this type."""
        if self.accelerator is not None:
            return self.accelerator
        return "cuda" if self.generation not in (None, "generic") else "cpu"

    @model_validator(mode="before")
    @classmethod
    def _from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if name not in DEVICE_PRESETS:
            raise ValueError(
                f"preset: unknown device {name!r} (known: {', '.join(DEVICE_PRESETS)})"
            )
        base = dict(DEVICE_PRESETS[name])
        base.update({k: v for k, v in data.items() if v is not None})
        return base

    @model_validator(mode="after")
    def _has_peak(self) -> Self:
        if not self.peak_tflops:
            raise ValueError("peak_tflops needs at least one data type")
        return self


class LinkSpec(_Spec):
    """A point-to-point link: bandwidth per direction and one-way latency."""

    bandwidth_gbit_s: PositiveFloat
    latency_us: NonNegativeFloat = 1.0


class CollectiveSpec(_Spec):
    """The collectives between a node's devices as measured (``dmsc calibrate``): a ring
    all-reduce's bandwidth (the bytes one member sends per second) and one call's latency."""

    backend: Literal["gloo", "nccl"]
    bandwidth_gbit_s: PositiveFloat
    latency_us: NonNegativeFloat
    bandwidth_awake_gbit_s: PositiveFloat | None = Field(
        default=None,
        description="The bandwidth when the rank waits for the call awake, as dmsc's tensor- "
        "and expert-parallel collectives do (dmsc.runtime.compute.waiting); bandwidth_gbit_s "
        "where not measured.",
    )
    latency_awake_us: NonNegativeFloat | None = Field(
        default=None, description="One such call's latency; latency_us where not measured."
    )
    quorum_us: NonNegativeFloat | None = Field(
        default=None,
        description="The replicas' quorum before an exchange dmsc's runtime runs whole (a "
        "codec's, the leader's, a round's): its store round trips, measured; not priced where "
        "absent.",
    )
    source: str = Field(min_length=1, description="Where, when and how it was measured.")


class NodeTypeSpec(_Spec):
    """A server: ``devices`` accelerators of one type joined by an intra-node fabric."""

    device: Name = Field(description="A key of device_types.")
    devices: int = Field(gt=0, le=1024)
    link: LinkSpec = Field(
        description="Each device's link into the node fabric (NVLink/NVSwitch, PCIe, memory bus)."
    )
    collective: CollectiveSpec | None = Field(
        default=None,
        description="Measured collectives inside the node; the cost model prices collectives "
        "with them in place of the link's figures (point-to-point sends keep the link's).",
    )


class NodeGroupSpec(_Spec):
    """``count`` identical nodes of one node type."""

    type: Name = Field(description="A key of node_types.")
    count: int = Field(gt=0, le=1_000_000)
    cpus: list[Annotated[int, Field(ge=0, le=4095)]] | None = Field(
        default=None,
        min_length=1,
        description="Local launcher only: the cores of this machine each node of the group "
        "runs its workers on (a cpuset), so that nodes sharing one machine stay apart and a "
        "node's CPU % is that of its own cores.",
    )

    @field_validator("cpus")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("a core is named twice")
        return v


class FabricSpec(_Spec):
    """A datacenter's switch fabric by its shape (see :mod:`dmsc.netmodel.fabrics`): a k-ary
    ``fat-tree``, a ``dragonfly`` of ``groups`` groups of ``a`` routers with ``p`` hosts and
    ``h`` global links each, a ``torus`` of ``dims``, or a ``d``-dimensional ``hypercube``; each
    host a node."""

    kind: Literal["fat-tree", "dragonfly", "torus", "hypercube"]
    k: int = Field(default=4, ge=2, le=128, description="fat-tree: ports per switch (even)")
    a: int = Field(default=4, ge=1, le=256, description="dragonfly: routers per group")
    p: int = Field(default=2, ge=1, le=256, description="dragonfly: hosts per router")
    h: int = Field(default=2, ge=1, le=256, description="dragonfly: global links per router")
    groups: int | None = Field(default=None, ge=2, description="dragonfly (default a*h+1)")
    dims: list[Annotated[int, Field(ge=2, le=1024)]] = Field(default=[4, 4], min_length=1)
    d: int = Field(default=4, ge=1, le=20, description="hypercube: dimensions")
    gbit_s: PositiveFloat = Field(default=400.0, description="Each fabric link's Gbit/s.")
    hop_latency_us: NonNegativeFloat = Field(default=0.5, description="Per switch hop.")

    @model_validator(mode="after")
    def _shape(self) -> Self:
        if self.kind == "fat-tree" and self.k % 2:
            raise ValueError("k: a fat tree needs an even k")
        most = self.a * self.h + 1
        if self.kind == "dragonfly" and self.groups is not None and self.groups > most:
            raise ValueError(f"groups: at most a*h+1 = {most}")
        return self

    @property
    def hosts(self) -> int:
        if self.kind == "fat-tree":
            return int(self.k**3 // 4)
        if self.kind == "dragonfly":
            return (self.groups or self.a * self.h + 1) * self.a * self.p
        if self.kind == "torus":
            return math.prod(self.dims)
        return int(2**self.d)


class DCNetworkSpec(_Spec):
    """The datacenter fabric as seen by one node: its total uplink and the one-way latency; with
    a ``fabric``, the cost model takes the fabric's bisection per node where it is lower, and
    adds its diameter in switch hops to the latency."""

    gbit_s_per_node: PositiveFloat
    latency_us: NonNegativeFloat = 2.0
    fabric: FabricSpec | None = None


class DatacenterSpec(_Spec):
    """A datacenter: groups of nodes on one fabric, attached to a site of the inter-DC network."""

    name: Name
    site: Name | None = Field(
        default=None, description="Node of the inter-DC network it attaches to (default: name)."
    )
    nodes: list[NodeGroupSpec] = Field(min_length=1)
    network: DCNetworkSpec

    @property
    def site_name(self) -> str:
        return self.site if self.site is not None else self.name


class InterDCLinkSpec(_Spec):
    """A fiber (pair) between two sites: capacity in Gbit/s or as a grid of frequency slots."""

    a: Name
    b: Name
    km: PositiveFloat
    bandwidth_gbit_s: PositiveFloat | None = None
    slots: int | None = Field(default=None, gt=0, le=10_000)
    slot_ghz: PositiveFloat = 12.5
    gbit_s_per_slot: PositiveFloat | None = Field(
        default=None,
        description="Line rate one slot carries; default from the modulation reach table by km.",
    )

    @model_validator(mode="after")
    def _one_capacity(self) -> Self:
        if (self.bandwidth_gbit_s is None) == (self.slots is None):
            raise ValueError("give exactly one of bandwidth_gbit_s or slots")
        if self.a == self.b:
            raise ValueError(f"link joins site {self.a!r} to itself")
        return self


class FiberTopologySpec(_Spec):
    """The inter-DC fibers of a named optical topology (:mod:`dmsc.spec.topologies`), each with
    the same capacity: ``slots`` of ``slot_ghz`` or ``bandwidth_gbit_s``."""

    name: Name
    bandwidth_gbit_s: PositiveFloat | None = None
    slots: int | None = Field(default=None, gt=0, le=10_000)
    slot_ghz: PositiveFloat = 12.5


class ClusterSpec(_Spec):
    """Devices in nodes in datacenters, and the links between datacenters (given one by one in
    ``links``, or as a named ``topology``, or both)."""

    name: Name = "cluster"
    propagation_us_per_km: PositiveFloat = Field(
        default=5.0, description="Fiber propagation delay (light in glass, about 5 us/km)."
    )
    device_types: dict[Name, DeviceTypeSpec] = Field(min_length=1)
    node_types: dict[Name, NodeTypeSpec] = Field(min_length=1)
    datacenters: list[DatacenterSpec] = Field(min_length=1)
    links: list[InterDCLinkSpec] = Field(default_factory=list)
    topology: FiberTopologySpec | None = Field(
        default=None, description="A named optical topology whose fibers join the links."
    )
    residency: ResidencySpec | None = Field(
        default=None,
        description="Which datacenters datasets may be read in and model weights stored in.",
    )
    shared_cores: int | None = Field(
        default=None,
        gt=0,
        description=(
            "The devices are worker processes sharing one machine of this many cores (a "
            "calibrated CPU cluster; dmsc calibrate writes it): a job on k of them gives each "
            "min(1, shared_cores / k) of its device type's peak_tflops and memory_bw_gbyte_s, "
            "and of its node's measured collective (bandwidth times the share, latency over "
            "it), as the processes that run share the cores. The local launcher packs a "
            "deployment's workers onto the machine's cores when they outnumber them, busiest "
            "stage first. "
            "Unset: each device is its own."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _topology_links(cls, data: Any) -> Any:
        """``topology: {name, slots | bandwidth_gbit_s}`` adds that topology's fibers to
        ``links`` (datacenters then attach at its sites)."""
        if not isinstance(data, dict) or not isinstance(data.get("topology"), dict):
            return data
        from dmsc.spec.topologies import named_links

        topo = FiberTopologySpec.model_validate(data["topology"])
        capacity = topo.model_dump(exclude={"name"}, exclude_none=True)
        try:
            fibers = named_links(topo.name)
        except ValueError as exc:
            raise ValueError(f"topology.name: {exc}") from None
        given = list(data.get("links") or [])
        return {**data, "links": given + [{"a": a, "b": b, "km": km, **capacity}
                                          for a, b, km in fibers]}  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _generations(cls, data: Any) -> Any:
        """A device type that names no generation (nor preset) takes the one of its name."""
        if not isinstance(data, dict) or not isinstance(data.get("device_types"), dict):
            return data
        types: dict[Any, Any] = {}
        for key, dev in data["device_types"].items():
            if isinstance(dev, dict) and dev.get("generation") is None and not dev.get("preset"):
                dev = {**dev, "generation": generation_from_name(str(key))}
            elif isinstance(dev, DeviceTypeSpec) and dev.generation is None:
                dev = dev.model_copy(update={"generation": generation_from_name(str(key))})
            types[key] = dev
        return {**data, "device_types": types}

    @model_validator(mode="after")
    def _references(self) -> Self:
        for key, node in self.node_types.items():
            if node.device not in self.device_types:
                raise ValueError(
                    f"node_types.{key}.device: unknown device type {node.device!r} "
                    f"(known: {', '.join(sorted(self.device_types))})"
                )
        names: set[str] = set()
        for i, dc in enumerate(self.datacenters):
            if dc.name in names:
                raise ValueError(f"datacenters[{i}].name: duplicate datacenter {dc.name!r}")
            names.add(dc.name)
            for j, group in enumerate(dc.nodes):
                if group.type not in self.node_types:
                    raise ValueError(
                        f"datacenters[{i}].nodes[{j}].type: unknown node type {group.type!r} "
                        f"(known: {', '.join(sorted(self.node_types))})"
                    )
            fabric = dc.network.fabric
            nodes = sum(g.count for g in dc.nodes)
            if fabric is not None and fabric.hosts < nodes:
                raise ValueError(
                    f"datacenters[{i}].network.fabric: a {fabric.kind} of {fabric.hosts} hosts "
                    f"for {nodes} nodes"
                )
        sites = {dc.site_name for dc in self.datacenters}
        if len(sites) < len(self.datacenters):
            raise ValueError("datacenters: two datacenters attach to the same site")
        if len(self.datacenters) > 1 and not self.links:
            raise ValueError("links: several datacenters but no link between them")
        self._residency_names(names)
        return self

    def node_cpus(self) -> list[list[int] | None]:
        """Each node's cores on this machine (its group's ``cpus``; None: not pinned), in the
        order :class:`dmsc.netmodel.topology.Topology` numbers the nodes."""
        return [g.cpus for dc in self.datacenters for g in dc.nodes for _ in range(g.count)]

    def _residency_names(self, names: set[str]) -> None:
        """Every datacenter a residency rule names is one of the cluster's."""
        res, known = self.residency, ", ".join(dc.name for dc in self.datacenters)
        if res is None:
            return
        if res.home is not None and res.home not in names:
            raise ValueError(f"residency.home: unknown datacenter {res.home!r} (known: {known})")
        seen: set[str] = set()
        for i, rule in enumerate(res.rules):
            if rule.name in seen:
                raise ValueError(f"residency.rules[{i}].name: duplicate rule {rule.name!r}")
            seen.add(rule.name)
            for j, dc in enumerate(rule.datacenters):
                if dc not in names:
                    raise ValueError(
                        f"residency.rules[{i}].datacenters[{j}]: unknown datacenter {dc!r} "
                        f"(known: {known})"
                    )

    @property
    def device_count(self) -> int:
        return sum(
            g.count * self.node_types[g.type].devices for dc in self.datacenters for g in dc.nodes
        )
