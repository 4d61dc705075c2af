"""Generated topologies against their closed forms: the fat tree's counts (Al-Fares et al.,
SIGCOMM 2008), the bisection of tori and hypercubes, a balanced dragonfly's global links; the
inter-DC graphs' shapes; a generated graph read back as a topology."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest

from dmsc.sim import generators as gen
from dmsc.sim.topologies import parse_links, topology


@pytest.mark.parametrize("k", [2, 4, 6, 8])
def test_fat_tree_counts_and_full_bisection(k: int) -> None:
    f = gen.fabric_figures(gen.fat_tree(k, gbit_s=100.0))
    assert f["hosts"] == k**3 // 4
    assert f["switches"] == 5 * k * k // 4  # k^2 pod switches, (k/2)^2 core
    assert f["links"] == 3 * k**3 // 4  # host, edge-agg and agg-core links: k^3/4 each
    assert f["bisection_gbit_s_per_host"] == pytest.approx(100.0)  # full bisection
    assert f["diameter_hops"] == 6  # host, edge, aggregation, core and back down


@pytest.mark.parametrize("dims", [(4, 4), (4, 4, 4), (6, 4)])
def test_torus_bisection_is_twice_the_cut_face(dims: tuple[int, ...]) -> None:
    """Cutting a torus in half across its largest dimension cuts 2 links per ring of that
    dimension: 2 * prod(other dimensions) links, the least of any dimension."""
    f = gen.fabric_figures(gen.torus(dims, gbit_s=1.0))
    others = 1
    for d in sorted(dims)[:-1]:
        others *= d
    assert f["bisection_gbit_s"] == 2 * others
    assert f["diameter_hops"] == sum(d // 2 for d in dims) + 2


@pytest.mark.parametrize("d", [1, 3, 5])
def test_hypercube_bisection(d: int) -> None:
    f = gen.fabric_figures(gen.hypercube(d, gbit_s=1.0))
    assert (f["hosts"], f["bisection_gbit_s"], f["diameter_hops"]) == (2**d, 2 ** (d - 1), d + 2)


def test_a_balanced_dragonfly_links_every_pair_of_groups_once() -> None:
    a, p, h = 4, 2, 2
    g = gen.dragonfly(a, p, h)
    groups = a * h + 1
    routers = [v for v, r in g.nodes(data="role") if r == "switch"]
    assert len(routers) == a * groups
    global_links = [(u, v) for u, v in g.edges if u.split("r")[0] != v.split("r")[0]]
    pairs = {frozenset((u.split("r")[0], v.split("r")[0])) for u, v in global_links}
    assert len(global_links) == len(pairs) == groups * (groups - 1) // 2
    assert gen.fabric_figures(g)["diameter_hops"] == 5  # host, local, global, local, host


@pytest.mark.parametrize("kind", gen.INTER_DC)
def test_inter_dc_graphs(kind: str) -> None:
    n = 12
    g = gen.inter_dc(kind, n, seed=2)
    assert g.number_of_nodes() == n and nx.is_connected(g)
    assert all(km > 0 for _, _, km in g.edges(data="km"))
    degrees = sorted(d for _, d in g.degree)
    if kind == "full-mesh":
        assert g.number_of_edges() == n * (n - 1) // 2
    if kind == "star":
        assert degrees == [1] * (n - 1) + [n - 1]
    if kind == "ring":
        assert degrees == [2] * n
    assert nx.is_isomorphic(g, gen.inter_dc(kind, n, seed=2))  # seeded


def test_bad_generator_settings() -> None:
    for call in (
        lambda: gen.fat_tree(3),
        lambda: gen.torus((1, 4)),
        lambda: gen.dragonfly(2, 1, 1, groups=9),
        lambda: gen.inter_dc("ring", 2),
        lambda: gen.inter_dc("clustered", 5, clusters=2),
        lambda: gen.inter_dc("waxman", 5, alpha=0),
        lambda: gen.inter_dc("tree", 5),
    ):
        with pytest.raises(ValueError):
            call()


def test_a_links_file_and_its_errors(tmp_path: Path) -> None:
    f = tmp_path / "mine.csv"
    f.write_text("# made by hand\na,b,km\nx,y,100\ny,z,250.5\n")
    t = topology(str(f))
    assert (t.name, t.sites) == ("mine", ("x", "y", "z"))
    assert t.links == (("x", "y", 100.0), ("y", "z", 250.5))
    bad = [("x,y\n", "line 1"), ("x,x,5\n", "two different"), ("x,y,-1\n", "positive"),
           ("# nothing\n", "no links")]  # fmt: skip
    for text, needle in bad:
        with pytest.raises(ValueError, match=needle):
            parse_links(text, "f.csv")
    assert len(topology("nsfnet").links) == 22


@pytest.mark.parametrize(
    ("name", "nodes", "links"),
    [("nsfnet", 14, 22), ("cost239", 11, 26), ("usnet", 24, 43), ("jpn12", 12, 17),
     ("germany50", 50, 88)],
)  # fmt: skip
def test_the_named_topologies_have_their_published_sizes(name: str, nodes: int, links: int) -> None:
    t = topology(name)
    g = nx.Graph((a, b) for a, b, _ in t.links)
    assert (len(t.sites), len(t.links), g.number_of_edges()) == (nodes, links, links)
    assert nx.is_connected(g) and t.source
