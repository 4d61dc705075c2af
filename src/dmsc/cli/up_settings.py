"""``dmsc up``'s flags checked into the control plane's settings (errors name the flag)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dmsc.cli.preflight import check_plan_devices, check_plan_model
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.planner.plan import Plan
    from dmsc.runtime.transport.messages import ControlSettings

# ControlSettings fields and the flags that set them, for errors that name the flag.
_SETTING_FLAGS = {
    "gateway": "--gateway",
    "router": "--router",
    "failure_timeout_s": "--failure-timeout",
    "spares": "--spares",
    "device": "--device",
    "launcher": "--launcher",
    "ray_address": "--ray-address",
    "rate_limit": "--rate",
    "burst": "--burst",
    "max_body_bytes": "--max-body",
    "tenant_requests": "--tenant-requests",
    "keep_checkpoints": "--keep-checkpoints",
    "checkpoint_quota_bytes": "--checkpoint-quota",
    "queue": "--queue",
    "data_roots": "--data-root",
}


def control_settings(
    plan_path: str,
    home: Path,
    gateway: str | None,
    router: str,
    failure_timeout_s: float,
    spares: int,
    device: str = "plan",
    launcher: str = "local",
    ray_address: str | None = None,
    queue: str = "priority",
    data_roots: list[Path] | None = None,
    **limits: float,
) -> ControlSettings:
    """The flags of ``dmsc up`` checked (errors name the flag) into a ``ControlSettings``."""
    from pydantic import ValidationError

    from dmsc.data.db import control_file
    from dmsc.planner.plan import Plan
    from dmsc.runtime.business.router import POLICIES
    from dmsc.runtime.control.launch.ray_checks import address_problem
    from dmsc.runtime.transport import processes
    from dmsc.runtime.transport.messages import ControlSettings
    from dmsc.spec.errors import spec_error_from_validation

    if not Path(plan_path).is_file():
        raise SpecError(plan_path, "", "no such file")
    try:
        plan = Plan.model_validate_json(Path(plan_path).read_text())
    except ValidationError as exc:
        err = spec_error_from_validation(plan_path, exc)
        head, sep, rest = err.reason.partition(": ")
        if err.field and sep and head.isidentifier():  # a check's "field: reason" (job.ep)
            raise SpecError(plan_path, f"{err.field}.{head}", rest) from None
        raise SpecError(plan_path, "", f"not a dmsc plan ({str(exc).splitlines()[0]})") from None
    except ValueError as exc:
        raise SpecError(plan_path, "", f"not a dmsc plan ({str(exc).splitlines()[0]})") from None
    check_plan_model(plan_path, plan)
    if router not in POLICIES:
        raise SpecError(
            "command line", "--router", f"unknown policy (known: {', '.join(POLICIES)})"
        )
    if control_file().exists():
        pid = json.loads(control_file().read_text()).get("pid", 0)
        if isinstance(pid, int) and processes.alive(pid):
            raise SpecError("control plane", "", "already running (`dmsc down` first)")
        control_file().unlink()  # it died without cleaning up: a stale file
    if ray_address is not None and (why := address_problem(ray_address)):
        raise SpecError("command line", "--ray-address", why)
    if not failure_timeout_s > 0:
        raise SpecError("command line", "--failure-timeout", "must be positive")
    if not 0 <= spares <= 64:
        raise SpecError("command line", "--spares", "must be between 0 and 64")
    roots = [r.resolve() for r in data_roots] if data_roots else [Path.cwd().resolve()]
    for root in roots:
        if not root.is_dir():
            raise SpecError("command line", "--data-root", f"{root}: not a directory")
    if spares and plan.job.ep > 1:
        reason = f"the plan's ep is {plan.job.ep}: warm spares do not take over an expert share"
        raise SpecError("command line", "--spares", reason)
    if gateway:
        host, _, port = gateway.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SpecError("command line", "--gateway", "expected HOST:PORT")
    try:
        settings = ControlSettings(
            plan=str(Path(plan_path).resolve()),
            home=str(home),
            gateway=gateway or None,
            router=router,
            failure_timeout_s=failure_timeout_s,
            spares=spares,
            device=device,
            launcher=launcher,
            ray_address=ray_address,
            queue=queue,
            data_roots=[str(r) for r in roots],
            **limits,
        )
    except ValidationError as exc:
        err = spec_error_from_validation("command line", exc)
        flag = _SETTING_FLAGS.get(err.field.split(".")[0], err.field)
        raise SpecError("command line", flag, err.reason) from None
    check_plan_devices(plan_path, plan, settings.device)
    return settings


def check_plan_residency(plan_path: str, plan: Plan, cluster_path: str | None) -> None:
    """SpecError (exit 2) when the plan puts a stage where a residency rule of its cluster spec
    keeps the model out (a plan made before the rule), naming the rule; before anything starts."""
    if cluster_path is None:
        return
    from dmsc.cli.options import load_cluster
    from dmsc.runtime.control.training.residency import check_move

    try:
        check_move(load_cluster(cluster_path), plan, "the plan")
    except ValueError as exc:
        raise SpecError(plan_path, "stages", f"{exc} (plan again with dmsc plan)") from None


def check_cluster_cpus(cluster_path: str | None, launcher: str) -> None:
    """SpecError (exit 2) naming the node group whose ``cpus`` cannot be kept: cores this
    machine does not let the control plane run on, or a launcher that does not run the nodes
    on this machine (:mod:`dmsc.runtime.compute.cpuset`); before anything starts."""
    if cluster_path is None:
        return
    from dmsc.cli.options import load_cluster
    from dmsc.runtime.compute.cpuset import check_cores

    spec = load_cluster(cluster_path)
    wanted = {
        f"datacenters[{i}].nodes[{j}].cpus": g.cpus
        for i, dc in enumerate(spec.datacenters)
        for j, g in enumerate(dc.nodes)
        if g.cpus
    }
    if wanted and launcher != "local":
        field = next(iter(wanted))
        reason = f"pins a node to cores of this machine: the local launcher's (not {launcher}'s)"
        raise SpecError(cluster_path, field, reason)
    try:
        check_cores(wanted)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise SpecError(cluster_path, field, reason) from None
