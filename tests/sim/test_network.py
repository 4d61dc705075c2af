"""The optical network built from a cluster, and its slot count overridden."""

from __future__ import annotations

from dmsc.sim import OpticalNetwork
from dmsc.spec import ClusterSpec


def test_slots_override_every_fiber(nsfnet: ClusterSpec) -> None:
    plain = OpticalNetwork.from_cluster(nsfnet, 2)
    assert plain.n_slots == 80 and plain.grid.owner.shape == (22, 80)
    narrow = OpticalNetwork.from_cluster(nsfnet, 2, slots=12)
    assert narrow.n_slots == 12 and narrow.grid.owner.shape == (22, 12)
    route = narrow.dc_routes(0, 1)[0]
    assert narrow.grid.setup(route.links, 12) is not None
    assert narrow.grid.setup(route.links, 1) is None  # the fibers of that route are full
