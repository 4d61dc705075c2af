"""The cost model: pure functions from specs to predicted time, memory and traffic."""

from dmsc.netmodel.collectives import (
    COLLECTIVES,
    all_reduce_lower_bound,
    p2p_time,
    ring_time,
    tree_all_reduce_time,
)
from dmsc.netmodel.comm import CommCost, CommModel
from dmsc.netmodel.constants import DEFAULT_CALIBRATION, DTYPE_BYTES, Calibration
from dmsc.netmodel.iteration import (
    BREAKDOWN_KEYS,
    MODES,
    DoesNotFit,
    Estimate,
    StageEstimate,
    check_fit,
    estimate_iteration,
)
from dmsc.netmodel.layers import Gemm, LayerCost, build_layer_costs, count_params
from dmsc.netmodel.memory import MemoryBreakdown
from dmsc.netmodel.optical import MODULATIONS, choose_modulation, link_capacity_gbit_s
from dmsc.netmodel.topology import Device, Link, Topology

__all__ = [
    "BREAKDOWN_KEYS",
    "COLLECTIVES",
    "DEFAULT_CALIBRATION",
    "DTYPE_BYTES",
    "MODES",
    "MODULATIONS",
    "Calibration",
    "CommCost",
    "CommModel",
    "Device",
    "DoesNotFit",
    "Estimate",
    "Gemm",
    "LayerCost",
    "Link",
    "MemoryBreakdown",
    "StageEstimate",
    "Topology",
    "all_reduce_lower_bound",
    "build_layer_costs",
    "check_fit",
    "choose_modulation",
    "count_params",
    "estimate_iteration",
    "link_capacity_gbit_s",
    "p2p_time",
    "ring_time",
    "tree_all_reduce_time",
]
