"""The cost model: pure functions from specs to predicted time, memory and traffic.

The names below load on first use (PEP 562): a stage worker imports only the schedule it runs,
not the topology model and networkx (0.5 s of every worker's start)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dmsc._lazy import lazy_getattr

if TYPE_CHECKING:
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

_WHERE = {
    "BREAKDOWN_KEYS": "dmsc.netmodel.iteration",
    "COLLECTIVES": "dmsc.netmodel.collectives",
    "Calibration": "dmsc.netmodel.constants",
    "CommCost": "dmsc.netmodel.comm",
    "CommModel": "dmsc.netmodel.comm",
    "DEFAULT_CALIBRATION": "dmsc.netmodel.constants",
    "DTYPE_BYTES": "dmsc.netmodel.constants",
    "Device": "dmsc.netmodel.topology",
    "DoesNotFit": "dmsc.netmodel.iteration",
    "Estimate": "dmsc.netmodel.iteration",
    "Gemm": "dmsc.netmodel.layers",
    "LayerCost": "dmsc.netmodel.layers",
    "Link": "dmsc.netmodel.topology",
    "MODES": "dmsc.netmodel.iteration",
    "MODULATIONS": "dmsc.netmodel.optical",
    "MemoryBreakdown": "dmsc.netmodel.memory",
    "StageEstimate": "dmsc.netmodel.iteration",
    "Topology": "dmsc.netmodel.topology",
    "all_reduce_lower_bound": "dmsc.netmodel.collectives",
    "build_layer_costs": "dmsc.netmodel.layers",
    "check_fit": "dmsc.netmodel.iteration",
    "choose_modulation": "dmsc.netmodel.optical",
    "count_params": "dmsc.netmodel.layers",
    "estimate_iteration": "dmsc.netmodel.iteration",
    "link_capacity_gbit_s": "dmsc.netmodel.optical",
    "p2p_time": "dmsc.netmodel.collectives",
    "ring_time": "dmsc.netmodel.collectives",
    "tree_all_reduce_time": "dmsc.netmodel.collectives",
}


__getattr__ = lazy_getattr(_WHERE, globals())


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
