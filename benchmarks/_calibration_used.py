"""Which calibration a benchmark's predictions stand on (benchmarks/parallel_modes.py).

``dmsc calibrate`` writes a node's ``collective`` only when its 2-process gloo all-reduce could be
measured; under load that measurement can fail (a warning in the log, nothing in the spec), and
the cost model then prices every collective with the node's link: the data plane's loopback
socket as ``dmsc calibrate`` measured it, not gloo. A prediction made that way is of another
kind, so the benchmark says which it used beside every prediction it prints.
"""

from __future__ import annotations

from typing import Any

from dmsc.spec import ClusterSpec


def calibration_used(cluster: ClusterSpec) -> dict[str, Any]:
    """What the predictions on ``cluster`` price collectives with: ``collective_measured``
    (every node type carries a measured collective), ``priced_from`` (the words for it) and
    ``label`` (a short tag for a table)."""
    measured = [n.collective for n in cluster.node_types.values()]
    if measured and all(c is not None for c in measured):
        first = measured[0]
        assert first is not None
        return {
            "collective_measured": True,
            "priced_from": f"measured {first.backend} all-reduce ({first.source})",
            "label": f"measured {first.backend}",
        }
    return {
        "collective_measured": False,
        "priced_from": "the node link's figures (the data plane's loopback socket): the gloo "
        "all-reduce was not measured by dmsc calibrate (see its warning in the log), so "
        "predicted collectives are not gloo's",
        "label": "UNCALIBRATED: link figures, no measured all-reduce",
    }
