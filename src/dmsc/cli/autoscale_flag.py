"""``dmsc up --autoscale infer:min=1,max=4[,target=2,cooldown=10,window=5,lookahead=0]
[--cluster PATH]``: the flag checked against the plan before anything starts (errors name the
flag, exit 2)."""

from __future__ import annotations

from pathlib import Path

from dmsc.cli.clusters import cluster_file, find_cluster
from dmsc.planner.elastic import devices_in_use, place_replica
from dmsc.planner.plan import Plan
from dmsc.runtime.transport.messages import AutoscaleSettings
from dmsc.spec import SpecError


def autoscale_settings(
    text: str | None, cluster: str | None, plan: Plan
) -> tuple[AutoscaleSettings | None, str | None]:
    """(settings, the cluster spec's path) of the flags. Without ``--autoscale`` the settings
    are None and the path is ``--cluster``'s, else the plan's cluster found by name, else None
    (a training task's ``--dp`` then says it needs it)."""
    from dmsc.cli.options import load_cluster
    from dmsc.runtime.control.serving.autoscale import parse_autoscale

    if cluster is not None:
        if not Path(cluster).is_file():
            raise SpecError("command line", "--cluster", f"{cluster}: no such file")
        load_cluster(cluster)  # a wrong spec is named, field and reason, before anything starts
    if text is None:  # the cluster, when it is known, lets training tasks change dp
        if cluster is not None:
            return None, cluster
        found = find_cluster(plan.cluster)
        return None, None if found is None else str(found)
    try:
        settings = parse_autoscale(text)
    except ValueError as exc:
        raise SpecError("command line", "--autoscale", str(exc)) from None
    dp = plan.job.dp
    if settings.max < dp:
        raise SpecError(
            "command line",
            "--autoscale",
            f"max={settings.max} is below the plan's {dp} replicas, which always serve",
        )
    path = cluster_file(cluster, plan.cluster)
    spec = load_cluster(path)
    if settings.max > dp and place_replica(plan, spec, devices_in_use(plan), dp) is None:
        raise SpecError(
            "command line",
            "--autoscale",
            f"the plan fills cluster {spec.name!r}: no free devices for a serving replica "
            "(plan on a larger cluster, or with fewer devices)",
        )
    return settings, path
