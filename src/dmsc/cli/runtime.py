"""The commands that manage a deployment on this machine: ``calibrate``, ``up``, ``status`` and
``down``, and the client of the running control plane that every runtime command talks to.

``dmsc up`` starts the control plane as a child process (``python -m
dmsc.runtime.control.daemon``): the settings are checked here and handed over as one
:class:`~dmsc.runtime.transport.messages.ControlSettings` JSON object on the child's standard
input; the child answers ``READY ADDRESS`` on its standard output. Its standard error goes to
``$DMSC_HOME/logs/control.stderr`` beside its log, so a failed start can say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from dmsc.cli.app import console
from dmsc.cli.control_flags import (
    DEFAULT_INTERVAL_S,
    IntervalOpt,
    ModeOpt,
    PolicyOpt,
    SloOpt,
    WebhookOpt,
    loop_line,
    loop_settings,
)
from dmsc.cli.options import JsonOpt
from dmsc.cli.up_settings import check_cluster_cpus, check_plan_residency, control_settings
from dmsc.runtime.transport.replies import StatusReply
from dmsc.spec import SpecError

if TYPE_CHECKING:
    from dmsc.runtime.control.client import ControlClient

ROOT = Path(__file__).resolve().parents[3]
LOCAL_CPU = ROOT / "examples" / "clusters" / "local-cpu.yaml"


def calibrated_path() -> Path:
    """Where ``dmsc calibrate`` writes the measured cluster spec by default."""
    from dmsc.data.db import data_dir

    return data_dir() / "local-cpu.calibrated.yaml"


def control_client() -> ControlClient:
    """The client of the running control plane (a SpecError when none runs)."""
    from dmsc.runtime.control.client import ControlClient

    return ControlClient.connect()


def calibrate(
    cluster: Annotated[
        str | None, typer.Option(help="Template cluster (default local-cpu).")
    ] = None,
    out: Annotated[str | None, typer.Option(help="Where to write the calibrated spec.")] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="Measure one device (cuda, cuda:N or cpu) into a one-device cluster spec with "
            "measured efficiency curves (matrix products, attention, memory)."
        ),
    ] = None,
    quick: Annotated[bool, typer.Option(help="With --device: fewer sizes, fewer repeats.")] = False,
    from_run: Annotated[
        int | None,
        typer.Option(
            help="Write the cluster spec refitted to run RUN's step traces instead of measuring "
            "(the control plane fits every training task when it ends)."
        ),
    ] = None,
) -> None:
    """Measure this machine (FLOP/s, memory, loopback) into a cluster spec."""
    from dmsc.cli.paths import check_output

    check_output(out, "--out")  # before measuring; a missing directory is never created
    if from_run is not None:
        from dmsc.cli.recalibrate import write_from_run

        write_from_run(from_run, out, console)
        return
    if device is None:
        do_calibrate(cluster, out, console)
        return
    calibrate_device(device, out, quick)


def calibrate_device(device: str, out: str | None, quick: bool) -> None:
    """``dmsc calibrate --device``: the device measured, written as a one-device cluster."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):  # before torch loads
        raise SpecError("command line", "--device", f"{device!r}: expected cpu, cuda or cuda:N")

    import yaml

    from dmsc.runtime.compute.device_calibration import (
        measure_device,
        one_device_cluster,
        report_lines,
    )
    from dmsc.spec import ClusterSpec

    try:
        got = measure_device(device, quick=quick)
    except RuntimeError as exc:
        raise SpecError("command line", "--device", str(exc)) from None
    name = device.replace(":", "")
    cluster = one_device_cluster(name, got["spec"])
    ClusterSpec.model_validate(cluster)
    dst = Path(out) if out else calibrated_path().with_name(f"one-{name}.calibrated.yaml")
    dst.write_text(
        f"# Written by `dmsc calibrate --device {device}`: {got['report']['device']} measured.\n"
        + yaml.safe_dump(cluster, sort_keys=False)
    )
    report = got["report"]
    for line in report_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"wrote {dst} ({report['device']})", highlight=False, soft_wrap=True)


def do_calibrate(template: str | None, out: str | None, console: Console) -> dict[str, float]:
    """Measure this machine into a copy of ``template``; prints and returns the measurements."""
    import yaml

    from dmsc.cli.calibration_report import calibration_report
    from dmsc.runtime.compute.calibrate import calibrate
    from dmsc.runtime.compute.host_memory import keep_freed_memory

    keep_freed_memory()  # measured with the allocator a worker computes with
    src = Path(template) if template else LOCAL_CPU
    dst = Path(out) if out else calibrated_path()
    measured = calibrate(src, dst)
    written = yaml.safe_load(dst.read_text())
    for line in calibration_report(measured, written, dst):
        console.print(line, highlight=False, soft_wrap=True)
    return measured


def up(
    plan_file: Annotated[str, typer.Option("--plan", help="Plan file (dmsc plan --out).")],
    gateway: Annotated[
        str | None, typer.Option(help="Serve the HTTP gateway on HOST:PORT.")
    ] = None,
    router: Annotated[
        str, typer.Option(help="round_robin, least_outstanding, latency, p2c or sticky.")
    ] = "least_outstanding",
    failure_timeout: Annotated[
        float,
        typer.Option(help="Seconds without a heartbeat before a worker is declared failed."),
    ] = 10.0,
    spares: Annotated[
        int, typer.Option(help="Warm spare workers that take a failed worker's stage over.")
    ] = 0,
    rate: Annotated[
        float,
        typer.Option(help="Gateway: requests per second per tenant (a key may set its own)."),
    ] = 20.0,
    burst: Annotated[
        float, typer.Option(help="Gateway: requests a tenant may save up and send at once.")
    ] = 40.0,
    max_body: Annotated[int, typer.Option(help="Gateway: largest request body, in bytes.")] = 64
    * 1024,
    tenant_requests: Annotated[
        int, typer.Option(help="Gateway: inference requests in flight per tenant.")
    ] = 4,
    device: Annotated[
        str,
        typer.Option(
            help="Where the workers run: plan (each replica's GPU in the plan, or the CPU), "
            "cpu, or cuda / cuda:N (every stage on one GPU)."
        ),
    ] = "plan",
    launcher: Annotated[
        str,
        typer.Option(
            help="Who starts the workers: local (this machine) or ray (a Ray cluster, each "
            "datacenter NAME being the nodes with the resource dc:NAME)."
        ),
    ] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="The Ray head to join, HOST:PORT (none: a private one).")
    ] = None,
    autoscale: Annotated[
        str | None,
        typer.Option(
            help="Elastic serving replicas: infer:min=1,max=4[,target=2,cooldown=10,window=5,"
            "lookahead=0] (in flight per replica; seconds; lookahead: forecast the rate ahead)."
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(
            help="The plan's cluster spec, for --autoscale and training tasks' --dp "
            "(default: found by the plan's cluster name)."
        ),
    ] = None,
    keep_checkpoints: Annotated[
        int, typer.Option(help="A training task's newest checkpoints kept on disk (0: all).")
    ] = 3,
    checkpoint_quota: Annotated[
        str | None, typer.Option(help="Checkpoint bytes per tenant (500MB, 2GB; default: none).")
    ] = None,
    new_database: Annotated[
        bool, typer.Option(help="Make a new database even beside a salvaged copy of a lost one.")
    ] = False,
    queue: Annotated[
        str, typer.Option(help="Task queue order: fcfs, priority, or fair (tenants' weights).")
    ] = "priority",
    data_root: Annotated[
        list[Path] | None,
        typer.Option(
            help="A directory training tasks' --data may lie in (repeatable; default: this "
            "directory). Data elsewhere, symlinks followed, is refused from either door."
        ),
    ] = None,
    tls: Annotated[
        bool, typer.Option("--tls", help="Gateway over HTTPS, a self-signed certificate.")
    ] = False,
    tls_cert: Annotated[
        Path | None, typer.Option(help="Gateway over HTTPS: its certificate (PEM).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="The certificate's key (PEM).")] = None,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="Plain HTTP on an address other than loopback.")
    ] = False,
    encrypt_checkpoints: Annotated[
        bool,
        typer.Option(
            "--encrypt-checkpoints",
            help="Seal checkpoints (AES-GCM; the key in $DMSC_HOME/keys, outside them).",
        ),
    ] = False,
    control_interval: IntervalOpt = DEFAULT_INTERVAL_S,
    control: ModeOpt = "act",
    policy: PolicyOpt = None,
    slo: SloOpt = None,
    alert_webhook: WebhookOpt = None,
) -> None:
    """Start the control plane and one worker process per stage replica."""
    from dmsc.data.db import data_dir
    from dmsc.runtime.transport import logs

    home = data_dir().resolve()
    limits = {
        "rate_limit": rate,
        "burst": burst,
        "tenant_requests": tenant_requests,
        "max_body_bytes": max_body,
        "keep_checkpoints": keep_checkpoints,
    }
    settings = control_settings(
        plan_file, home, gateway, router, failure_timeout, spares, device,
        launcher=launcher, ray_address=ray_address, queue=queue, data_roots=data_root,
        **limits,
    )  # fmt: skip
    # the plan's cluster spec: for --autoscale, and for training tasks that change dp
    from dmsc.cli.autoscale_flag import autoscale_settings
    from dmsc.cli.sizes import size_flag
    from dmsc.planner.plan import Plan

    plan = Plan.model_validate_json(Path(plan_file).read_text())
    scale, path = autoscale_settings(autoscale, cluster, plan)
    check_plan_residency(plan_file, plan, path)  # a rule of the cluster the plan breaks: exit 2
    check_cluster_cpus(path, settings.launcher)  # a node's cores this machine lacks: exit 2
    cluster_path = str(Path(path).resolve()) if path is not None else None
    quota = size_flag("--checkpoint-quota", checkpoint_quota)
    more: dict[str, Any] = {"checkpoint_quota_bytes": quota, "new_database": new_database}
    from dmsc.cli.gateway_tls import gateway_tls

    https = gateway_tls(gateway, home, tls_cert, tls_key, tls, insecure)
    if https is not None:
        more |= {"tls_cert": str(https.cert), "tls_key": str(https.key)}
    more["encrypt_checkpoints"] = encrypt_checkpoints
    more |= loop_settings(control_interval, control, policy, slo, alert_webhook)  # control loop
    settings = settings.model_copy(update={"autoscale": scale, "cluster": cluster_path, **more})
    stderr_path = logs.stderr_file(home, logs.CONTROL)
    seen = stderr_path.stat().st_size if stderr_path.exists() else 0  # earlier starts' lines
    stderr = logs.open_stderr(home, logs.CONTROL)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dmsc.runtime.control.daemon"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    finally:
        os.close(stderr)
    assert proc.stdin is not None and proc.stdout is not None
    # A child that died before reading its settings breaks the pipe; its stderr says why.
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(settings.model_dump_json() + "\n")
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)  # let it finish writing its last words
        with stderr_path.open(errors="replace") as f:  # what this start wrote, the reason last
            f.seek(seen)
            said = f.read().strip().splitlines()[-40:]
        words = f"--- {stderr_path}\n" + "\n".join(said) if said else ""
        words = words or logs.last_words(home, logs.CONTROL)
        raise SpecError(
            plan_file,
            "",
            "the control plane failed to start"
            + (f":\n{words}" if words else f" (exit code {proc.poll()})")
            + f"\n(logs in {logs.log_dir(home)}: `dmsc logs`)",
        )
    console.print(
        f"control plane up at {line.split()[1]} (pid {proc.pid})"
        + (f", gateway {'https' if https else 'http'}://{gateway}" if gateway else ""),
        highlight=False,
    )
    if https is not None:
        kind = "self-signed certificate" if https.self_signed else "certificate"
        console.print(
            f"gateway {kind} {https.cert}, SHA-256 {https.fingerprint}",
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        f"logs in {logs.log_dir(home)}: `dmsc logs` (control plane), "
        "`dmsc logs --service SID` (a worker), `--follow` to keep reading",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def status(as_json: JsonOpt = False) -> None:
    """Services (SID, stage, address, health) and tasks of the running deployment."""
    out = control_client().status()
    if as_json:
        print(json.dumps(out.wire()))
        return
    print_status(console, out)


def print_status(console: Console, out: StatusReply) -> None:
    """The Status answer as tables; SIDs and addresses whole on any terminal width."""
    from dmsc.cli.mode_table import print_modes
    from dmsc.cli.render import fit_table, human_bytes

    def size(n: float | None) -> str:
        return "-" if n is None else human_bytes(n)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    ray = any(s.node != "local" for s in out.services)  # Ray: show nodes
    gpu = any(s.gpu_memory_bytes is not None for s in out.services)
    t = fit_table(
        "SID",
        "stage",
        "replica",
        "address",
        "health",
        "last heartbeat",
        "pid",
        "CPU %",
        "memory",
        *(["GPU memory"] if gpu else []),
        *(["node"] if ray else []),
        keep=(0, 3),
        title=f"run {out.run}: {out.model}, {out.steps} steps trained"
        + (f", queue {out.queue}" if out.queue else ""),
    )
    for s in out.services:
        age = s.heartbeat_age_s
        beat = f"{age:.1f} s ago" if s.registered and age is not None else "not registered"
        t.add_row(
            s.sid,
            str(s.stage),
            str(s.replica),
            s.address,
            s.health,
            beat,
            str(s.pid),
            pct(s.cpu_percent),
            size(s.rss_bytes),
            *([size(s.gpu_memory_bytes)] if gpu else []),
            *([s.node] if ray else []),
        )
    console.print(t)
    if out.nodes:
        nt = fit_table(
            "node",
            "cores",
            "busy %",
            "memory used",
            "workers",
            "their CPU %",
            "their memory",
            *(["their GPU memory"] if gpu else []),
            title="nodes",
            caption="a worker's CPU %: of one core (above 100 with several busy); "
            "a node's busy %: of all its cores; both over the last second",
        )
        for n in out.nodes:
            nt.add_row(
                n.node if n.host is None or n.node == n.host else f"{n.node} ({n.host})",
                pct(n.cpus),
                pct(n.cpu_percent),
                f"{size(n.memory_used_bytes)} of {size(n.memory_total_bytes)}",
                str(n.workers),
                pct(n.workers_cpu_percent),
                size(n.workers_rss_bytes),
                *([size(n.workers_gpu_memory_bytes)] if gpu else []),
            )
        console.print(nt)
    print_modes(console, out)  # each mode's communication, predicted against measured
    if out.control is not None:
        console.print(loop_line(out.control), highlight=False, markup=False)
    if out.weights_lost:
        console.print(f"[bold red]weights not restored:[/] {out.weights_lost}", highlight=False)
    if out.undeployed:
        console.print(f"[bold red]no deployment:[/] {out.undeployed}", highlight=False)
    if out.tasks:
        tt = fit_table("task", "kind", "state")
        for task in out.tasks:
            tt.add_row(str(task.id), task.kind, task.state)
        console.print(tt)
    if out.faults:
        ft = fit_table(
            "fault",
            "task",
            "replaced",
            "reason",
            "recovered after",
            "back to step",
            title="faults",
        )
        for f in out.faults:
            took = f"{f.recovered_at - f.detected_at:.1f} s" if f.recovered_at else "not yet"
            ft.add_row(
                f"{f.id} {f.kind}",
                str(f.task or ""),
                f.services,
                f.reason,
                took,
                str(f.checkpoint_step),
            )
        console.print(ft)


def down() -> None:
    """Stop the services and the control plane. Returns once its process has exited: it
    removes its control file before it is done (stopping its workers, closing its database),
    and "down" said earlier was not yet true (a test found the process still running)."""
    from dmsc.data.db import control_file
    from dmsc.runtime.transport.processes import alive

    info = json.loads(control_file().read_text()) if control_file().exists() else None
    pid = int(info["pid"]) if info else 0
    control_client().down()
    deadline = time.time() + 30
    while (control_file().exists() or alive(pid)) and time.time() < deadline:
        time.sleep(0.05)
    if alive(pid):
        print(f"dmsc down: the control plane (pid {pid}) still runs after 30 s", file=sys.stderr)
        raise typer.Exit(1)
    console.print(f"control plane down (pid {pid or '?'})", highlight=False)
