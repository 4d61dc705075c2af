"""Finding the spec file of a plan's cluster by its name: ``dmsc replan`` re-plans on it,
``dmsc up`` hands it to the control plane (elastic serving replicas, training at another dp)."""

from __future__ import annotations

from pathlib import Path

from dmsc.spec import SpecError


def _cluster_dirs() -> list[Path]:
    from dmsc.data.db import data_dir

    source = Path(__file__).resolve().parents[3] / "examples" / "clusters"
    return [Path.cwd() / "examples" / "clusters", source, data_dir()]


def find_cluster(name: str) -> Path | None:
    """The spec file of cluster ``name``: named after it, else one whose ``name`` it is."""
    from dmsc.spec import ClusterSpec, load_spec

    files = [
        f
        for d in dict.fromkeys(_cluster_dirs())
        if d.is_dir()
        for f in sorted(d.iterdir())
        if f.suffix in (".yaml", ".yml", ".json")
    ]
    for f in files:
        if f.stem == name:
            return f
    for f in files:
        try:
            if load_spec(ClusterSpec, f).name == name:
                return f
        except SpecError:  # another kind of file, or a broken one: not the cluster
            continue
    return None


def cluster_file(path: str | None, plan_cluster: str) -> str:
    """``--cluster PATH``, else the spec file of the plan's cluster found by :func:`find_cluster`
    (a SpecError naming ``--cluster`` when there is none)."""
    if path is None:
        found = find_cluster(plan_cluster)
        if found is None:
            where = ", ".join(str(d) for d in dict.fromkeys(_cluster_dirs()))
            raise SpecError(
                "command line",
                "--cluster",
                f"the run was planned on cluster {plan_cluster!r}, whose spec is in none of "
                f"{where}: give it with --cluster PATH",
            )
        path = str(found)
    return path
