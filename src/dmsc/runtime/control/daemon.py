"""The control-plane process: ``python -m dmsc.runtime.control.daemon``, started by ``dmsc up``.

Settings come from the CLI once, as one :class:`~dmsc.runtime.transport.messages.ControlSettings`
JSON object on standard input (the CLI parsed and checked the command line; a second parser here
would drift from it). The daemon then deploys the plan (:class:`.plane.ControlPlane`), runs the
task queue and the watchdog in threads, the HTTP gateway when asked, serves ``dmsc.Control`` on
127.0.0.1, writes ``control.json`` (address, pid, run, metrics) under the data directory and
prints ``READY 127.0.0.1:PORT`` on standard output once it serves. Bad settings or a bad plan:
the reason on standard error, exit status 2, no READY line.

Its log goes to ``$DMSC_HOME/logs/control.log`` (JSON lines, rotated); the workers' logs beside
it (see :mod:`dmsc.runtime.transport.logs`). A clean stop (``Down``) ends the run; a crash leaves
it to be resumed by the next start with the same plan. A SQLite database file deleted or
replaced while it runs stops it (:mod:`.db_watch`): the reason in its log and on standard error,
the workers shut down, exit status 1.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dmsc.data.db import Database, StorageError, control_file, data_dir
from dmsc.data.storage import location
from dmsc.planner.plan import Plan
from dmsc.runtime.business.auth import PrincipalCache, revoke
from dmsc.runtime.compute import sealing
from dmsc.runtime.control.db_watch import watch_database
from dmsc.runtime.control.launch import forked
from dmsc.runtime.transport import logs, tls
from dmsc.runtime.transport.log_calls import LogsReply, LogsRequest
from dmsc.runtime.transport.messages import (
    CONTROL_SERVICE,
    AutoscaleSettings,
    ControlSettings,
    RevokeRequest,
    StatusRequest,
)
from dmsc.runtime.transport.observe import metrics_server
from dmsc.runtime.transport.replies import RevokeReply, StatusReply
from dmsc.runtime.transport.rpc import BadRequest, message_handler, parse, serve

if TYPE_CHECKING:
    from dmsc.runtime.control.launch.launchers import Launcher
    from dmsc.runtime.control.plane import ControlPlane
    from dmsc.runtime.control.serving.elastic import ServingPool

GATEWAY_CONNECTIONS = 1000  # uvicorn's limit_concurrency: connections and requests at once
HEADER_DEADLINE_S = 10.0  # for a request's line and headers to arrive


def _revoke(db: Database, principals: PrincipalCache, req: RevokeRequest) -> dict[str, Any]:
    """``dmsc token revoke`` while the gateway runs: refused from the next request on."""
    try:
        revoke(db, req.key_id, principals)
    except KeyError as exc:
        raise BadRequest(str(exc).strip("'")) from None
    return {"revoked": req.key_id}


def _logs(cp: ControlPlane, ray: bool, req: LogsRequest) -> LogsReply:
    """``dmsc logs --grep`` of a deployment on Ray: the lines its nodes hold elsewhere."""
    if not ray:
        return LogsReply(launcher="local")
    from dmsc.runtime.control.launch.ray_logs import gather

    dep = cp.deployment
    handles = [*dep.handles, *dep.tp.handles, *dep.spares.handles, *dep.abandoned]
    found, unreachable = gather(
        [h.process for h in handles],
        dep.home,
        req.pattern,
        req.since_s,
        req.services,
        everywhere=req.everywhere,
    )
    entries = [(e.service, e.ts, e.line) for e in found[-req.lines :]]
    return LogsReply(launcher="ray", entries=entries, unreachable=unreachable)


def read_settings(stream: TextIO) -> ControlSettings:
    """One settings object from ``stream``: lines are read until they parse as JSON (or the
    stream ends), so the CLI may keep the pipe open or close it."""
    text = ""
    while True:
        line = stream.readline()
        text += line
        if not line:
            break
        try:
            json.loads(text)
        except json.JSONDecodeError:
            continue
        break
    if not text.strip():
        raise BadRequest("bad ControlSettings: no settings on standard input")
    return parse(ControlSettings, text.encode())


def _hold_home(home: Path) -> TextIO | None:
    """Take the home's lock (held by the open file until this process exits, crash or not), or
    None when another control plane holds it: two control planes on one run would each declare
    the other's workers failed. ``dmsc up`` checks ``control.json`` first, but two started at
    once both pass that check; the lock is what decides."""
    lock = (home / "control.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _fail(reason: str) -> None:
    print(f"dmsc control plane: {reason}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(stdin: TextIO | None = None) -> None:
    try:
        settings = read_settings(stdin or sys.stdin)
    except BadRequest as exc:
        _fail(str(exc))
        return
    os.environ["DMSC_HOME"] = settings.home  # data_dir(), the database and checkpoints follow
    home = data_dir()
    held = _hold_home(home)
    if held is None:
        _fail(f"another control plane runs on {home} (`dmsc down` first)")
        return
    log = logs.file_logger("dmsc.control", logs.log_file(home, logs.CONTROL))
    try:
        plan = Plan.model_validate_json(Path(settings.plan).read_text())
    except (OSError, ValueError) as exc:
        log.error("cannot read the plan %s: %s", settings.plan, exc)
        _fail(f"cannot read the plan {settings.plan}: {str(exc).splitlines()[0]}")
        return
    # The gateway's port is taken before anything starts: a port in use fails the start at once
    # (it used to leave a control plane without its gateway), and the deployment's own servers,
    # on ports the system picks, cannot take it meanwhile.
    gateway_socket = None
    if settings.gateway:
        host, _, gport = settings.gateway.rpartition(":")
        try:
            gateway_socket = socket.create_server((host or "127.0.0.1", int(gport)))
        except OSError as exc:
            log.error("cannot serve the gateway on %s: %s", settings.gateway, exc)
            _fail(f"cannot serve the gateway on {settings.gateway}: {exc.strerror or exc}")
            return
    launcher = None
    if settings.launcher == "ray":
        try:
            from dmsc.runtime.control.launch.ray_launcher import RayLauncher

            if settings.ray_address is None:  # no cluster named: one of this run's own
                from dmsc.runtime.control.launch.ray_private import (
                    private_cluster,
                    private_resources,
                )

                ray_dir = private_cluster(*private_resources(plan, settings.spares), home=home)
                log.info("a private Ray cluster on 127.0.0.1, its files in %s", ray_dir)
            else:  # a cluster of the user's: dmsc cannot secure it, it says what is open
                from dmsc.runtime.control.launch.ray_checks import exposure

                for gap in exposure(os.environ):
                    log.warning("the Ray cluster at %s: %s", settings.ray_address, gap)
            launcher = RayLauncher(settings.ray_address, home=home)
        except Exception as exc:  # no cluster at that address, or Ray refused us
            where = settings.ray_address or "127.0.0.1 (private)"
            log.error("cannot join the Ray cluster at %s: %s", where, exc)
            _fail(f"cannot join the Ray cluster at {where}: {exc}")
            return
    try:  # no new, empty database beside a salvaged copy unless --new-database
        db = Database(new_beside_salvaged=settings.new_database)
    except StorageError as exc:
        log.error("%s", exc)
        _fail(str(exc))
        return
    if launcher is None and forked.wanted():
        # The server the local workers are forked from imports the worker (about 2 s of CPU)
        # while this process imports the control plane below (about 3 s): on two cores `dmsc
        # up` waits for the longer of the two, not for both.
        forked.warm()
    from dmsc.runtime.control.launch.renewal import start_renewal
    from dmsc.runtime.control.loop.views import start_control_loop, with_loop, with_loop_status
    from dmsc.runtime.control.plane import ControlPlane
    from dmsc.runtime.control.training.retention import Retention
    from dmsc.runtime.control.watchdog import watch_workers
    from dmsc.spec import ClusterSpec, load_spec
    from dmsc.spec.residency import record_residency

    cluster = load_spec(ClusterSpec, Path(settings.cluster)) if settings.cluster else None
    record_residency(home, cluster.residency if cluster is not None else None)  # dmsc export's
    cli_leaf = tls.install_authority(home)  # mutual TLS from here on; the CLI's leaf
    if settings.encrypt_checkpoints:  # sealed by every worker (and read here) with this key
        sealing.install(sealing.home_key(home))
    cp = ControlPlane(
        plan,
        db,
        registry_ttl_s=settings.failure_timeout_s,
        spares=settings.spares,
        device=settings.device,
        home=home,
        log=log,
        launcher=launcher,
        cluster=cluster,
        retention=Retention(settings.keep_checkpoints, settings.checkpoint_quota_bytes),
        queue=settings.queue,
        # dmsc up fills them in (--data-root, or where it was started: this process's directory)
        data_roots=[Path(r) for r in settings.data_roots] or [Path.cwd()],
    )

    def db_lost(message: str) -> None:
        log.error(message)
        print(f"dmsc control plane: {message}", file=sys.stderr, flush=True)

    watch = watch_database(db, cp.stopped, db_lost)
    try:
        cp.start()
    except Exception as exc:  # the reason, with a failed worker's last log lines, for dmsc up
        log.exception("the deployment failed to start")
        cp.deployment.shutdown()
        _fail(f"the deployment failed to start: {exc}")
        return
    if cp.deployment.layout.cpus:  # a spec's cpusets, or the workers packed onto shared cores
        cores = sorted(cp.deployment.layout.cpus.items())
        log.info("workers' cores: %s", ", ".join(f"stage {s}/{r} on {c}" for (s, r), c in cores))
    queue = cp.queue  # the queue both doors submit to (.tasks.door)
    threading.Thread(target=cp.work_queue, args=(queue,), daemon=True).start()
    threading.Thread(target=partial(watch_workers, cp), daemon=True).start()
    control_loop = start_control_loop(cp, settings, log)  # None: --control-interval 0
    if settings.autoscale is not None and settings.cluster is not None:
        cp.inference.pool = start_autoscaler(
            cp, settings.autoscale, settings.cluster, settings.failure_timeout_s
        )
    principals = PrincipalCache(db)  # the gateway's; a revocation here empties it at once
    gateway = None
    if gateway_socket is not None:
        import uvicorn

        from dmsc.runtime.business.gateway import create_app
        from dmsc.runtime.business.http_guard import header_deadline_protocol
        from dmsc.runtime.business.https import uvicorn_tls

        app = create_app(
            cp,
            db,
            queue,
            router=settings.router,
            principals=principals,
            rate=settings.rate_limit,
            burst=settings.burst,
            tenant_requests=settings.tenant_requests,
            max_body_bytes=settings.max_body_bytes,
            dashboard=with_loop(cp.dashboard, control_loop) if control_loop else cp.dashboard,
        )
        gateway = uvicorn.Server(
            uvicorn.Config(
                app,
                **uvicorn_tls(settings.tls_cert, settings.tls_key),  # with HSTS on every answer
                log_level="warning",
                # Open connections and requests at once: past it, 503 rather than exhaustion.
                limit_concurrency=GATEWAY_CONNECTIONS,
                # A request's headers have this long to arrive (a body: the Guard's deadline).
                http=header_deadline_protocol(HEADER_DEADLINE_S),
            )
        )
        threading.Thread(
            target=gateway.run, kwargs={"sockets": [gateway_socket]}, daemon=True
        ).start()
        deadline = time.monotonic() + 30
        while not gateway.started and time.monotonic() < deadline:
            time.sleep(0.02)
        if not gateway.started:
            log.error("the gateway did not start on %s", settings.gateway)
            cp.deployment.shutdown()
            _fail(f"the gateway did not start on {settings.gateway} (see the log)")
            return
    # The Control service takes only callers holding its credential, like the workers and the
    # registry: any local process could otherwise stop the deployment or bypass the gateway's
    # keys. The credential is in control.json, readable by its owner only.
    token = secrets.token_urlsafe(24)
    revoking = partial(_revoke, db, principals)
    revoke_method = message_handler(RevokeRequest, revoking, reply=RevokeReply)
    logs_method = message_handler(
        LogsRequest, partial(_logs, cp, settings.launcher == "ray"), reply=LogsReply
    )
    methods = {**cp.methods(), "Revoke": revoke_method, "Logs": logs_method}
    if control_loop is not None:  # dmsc status shows the loop too
        answer = with_loop_status(cp.status, control_loop)
        methods["Status"] = message_handler(StatusRequest, answer, reply=StatusReply)
    fences = cp.deployment.registry.fences  # a fenced epoch's certificate: refused here too
    server, port = serve(CONTROL_SERVICE, methods, token=token, fences=fences)
    info = {
        "address": f"127.0.0.1:{port}",
        "pid": os.getpid(),
        "run": cp.run.id,
        "metrics": metrics_server(cp.metrics),
        "token": token,
        "tls": cli_leaf.wire(),  # the CLI's leaf certificate and key: this file is 0600
        "database": location(db.url),  # CLI commands that open it check it is this one
        "queue": settings.queue,  # the task queue's policy (dmsc up --queue)
        "launcher": settings.launcher,  # dmsc logs asks the control plane for Ray nodes' logs
    }
    logs.write_private(control_file(), json.dumps(info))

    def cli_renewed(leaf: tls.Leaf) -> None:  # whole or not at all: a command may be reading it
        info["tls"] = leaf.wire()
        staged = control_file().with_suffix(".renewing")
        logs.write_private(staged, json.dumps(info))
        os.replace(staged, control_file())

    start_renewal(cp.deployment, cp.stopped, cli_renewed)  # every leaf, before it expires
    log.info("serving at 127.0.0.1:%d", port, extra={"run": cp.run.id})
    print(f"READY 127.0.0.1:{port}", flush=True)
    cp.stopped.wait()
    lost = watch.lost if watch is not None else None
    if lost is None:
        cp.end_run()  # a clean stop ends the run; a crash or a lost database leaves it resumable
    if gateway is not None:
        gateway.should_exit = True
    if control_loop is not None:
        control_loop.close()
    if cp.inference.pool is not None:
        cp.inference.pool.shutdown()
    cp.deployment.shutdown()
    server.stop(grace=1)
    control_file().unlink(missing_ok=True)
    if lost is not None:
        log.error("stopped: the database was lost", extra={"run": cp.run.id})
        sys.exit(1)
    log.info("stopped", extra={"run": cp.run.id})


def _pool_launcher(cp: ControlPlane) -> Callable[[], Launcher] | None:
    """Each serving replica's launcher: a Ray one of its own when the plan's workers run on
    Ray (the cluster this process joined), else the local one (None)."""
    from dmsc.runtime.control.launch.ray_launcher import RayLauncher  # imports no Ray itself

    if not isinstance(cp.deployment.launcher, RayLauncher):
        return None
    home = cp.home
    return lambda: RayLauncher(home=home)


def start_autoscaler(
    cp: ControlPlane, scale: AutoscaleSettings, cluster_path: str, ttl_s: float
) -> ServingPool:
    """Elastic serving replicas (:mod:`.serving.elastic`) and the thread that sizes them: the
    pool, for the caller to hand to ``cp.inference``."""
    from dmsc.runtime.control.serving.autoscale import ScalePolicy
    from dmsc.runtime.control.serving.elastic import ServingPool, autoscale_loop
    from dmsc.spec import ClusterSpec, load_spec

    pool = ServingPool(
        cp.plan,
        cp.model,
        load_spec(ClusterSpec, Path(cluster_path)),
        cp.db,
        cp.run.id,
        cp.home,
        cp.log,
        cp.inference.in_flight,
        registry_ttl_s=ttl_s,
        launcher=_pool_launcher(cp),
    )
    loop = partial(
        autoscale_loop,
        pool,
        ScalePolicy(scale),
        cp.inference.in_flight,
        cp.stopped,
        arrivals=lambda: cp.inference.arrivals,
    )
    threading.Thread(target=loop, name="autoscaler", daemon=True).start()
    return pool


if __name__ == "__main__":
    main()
