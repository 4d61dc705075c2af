"""A private Ray cluster on this machine: what ``dmsc up --launcher ray`` without
``--ray-address`` runs on (:func:`private_cluster`, sized by :func:`private_resources`).

The several-node clusters that tests and benchmarks start on 127.0.0.1, and the node faults made
on them, are :mod:`dmsc.testing.ray_local`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from dmsc.runtime.control.launch.ray_launcher import ray_module
from dmsc.runtime.transport import processes
from dmsc.runtime.transport.authority import Authority, Leaf, write_private_bytes

if TYPE_CHECKING:
    from dmsc.planner.plan import Plan

T = TypeVar("T")

# How long a node's processes may take to come up. Ray waits 30 s for its GCS server to publish
# its port, and as long for a node to register; on 2 cores that other work keeps busy (another
# test process training) a head took over 30 s to start (measured here with 6 busy processes:
# 23 s for a cluster that starts in 6 s on an idle machine).
START_WAIT_S = 120


GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"

# Ray gives a node a fixed 30 s to register with its GCS once its processes are up
# (ray/_private/node.py, not settable) and then raises a plain Exception with this text. On 2
# cores that two test processes keep busy, a head missed it once in CI; a node start (a private
# cluster's, a test's local cluster's) is tried again then, with the failed try's processes killed
# first.
STARTUP_TIMEOUT = "timed out during startup"
START_TRIES = 3


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


# Ray's TLS settings, read by its processes (the C++ GCS server, raylets, core workers: once, when
# Ray is first loaded in a process) and by its Python gRPC channels: names as Ray 2.60 reads them
# (ray/_common/tls_utils.py, ray/_private/grpc_utils.py, and the gcs_server and raylet binaries).
TLS_ENV = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
RAY_HOSTS = ("127.0.0.1", "localhost")  # what Ray's processes dial on a private cluster
RAY_LEAF_LIFETIME = dt.timedelta(days=365)  # read once per Ray process: no renewal while up


def tls_settings(folder: Path, leaf: Leaf) -> dict[str, str]:
    """Ray's TLS settings for a cluster whose every process presents ``leaf`` and trusts only
    its authority: the certificate, its key (mode 0600) and the authority's certificate written
    in ``folder`` (made, mode 0700), and the environment variables that name them."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    cert, key, ca = folder / "ray.pem", folder / "ray.key", folder / "ca.pem"
    cert.write_bytes(leaf.cert)
    write_private_bytes(key, leaf.key)
    ca.write_bytes(leaf.ca)
    return dict(zip(TLS_ENV, ("1", str(cert), str(key), str(ca)), strict=True))


def private_cluster(resources: dict[str, float], cpus: int, home: Path | None = None) -> Path:
    """Start (``ray.init``) a one-node Ray cluster for this process only, and return the folder
    it keeps its files in. It is what ``dmsc up --launcher ray`` without ``--ray-address`` runs
    on: the node offers ``resources`` and ``cpus`` CPUs, and

    - serves on 127.0.0.1 (``LOOPBACK_ENV``; Ray would otherwise advertise, and its workers
      serve on, the machine's address);
    - takes only clients holding its token (Ray's token authentication, ``RAY_AUTH_MODE=token``
      with a fresh ``RAY_AUTH_TOKEN`` for this cluster: another user's ``ray.init`` is refused,
      and no token file is written to ``~/.ray``);
    - keeps its sockets, logs and session files in a folder of its own under the system's
      temporary folder (mode 0700: Ray makes its own folders world-writable, ``/tmp/ray`` is
      0777), not in ``/tmp/ray``, and never becomes the cluster ``ray.init("auto")`` finds;
    - with ``home``, speaks TLS only (Ray's mutual TLS, :func:`tls_settings`) with a certificate
      from ``home``'s authority (:mod:`dmsc.runtime.transport.authority`) for 127.0.0.1: a client
      without one is refused before its token is read. Ray loads these settings once per
      process, so Ray must not have been imported here before (RuntimeError).

    The cluster stops, and its folder is removed, when this process exits."""
    import atexit
    import secrets
    import shutil
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="dmsc-ray-"))  # 0700, this user's only
    if home is not None:
        if "ray" in sys.modules:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError("Ray was loaded before its TLS settings were made")
        leaf = Authority.at(home / "tls").issue("ray", RAY_LEAF_LIFETIME, RAY_HOSTS)
        os.environ.update(tls_settings(root / "tls", leaf))
    from ray._private import ray_constants
    from ray._private.authentication import authentication_token_setup as auth

    ray = ray_module()
    os.environ[LOOPBACK_ENV] = "0"  # for the processes Ray starts, and below for this one
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    auth._enable_token_auth()  # RAY_AUTH_MODE=token, and Ray's settings in this process reread
    os.environ.setdefault(GCS_WAIT_ENV, str(START_WAIT_S))
    tried(
        lambda: ray.init(
            address="local",  # never one found by RAY_ADDRESS or "auto"
            num_cpus=cpus,
            resources=resources,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _node_ip_address="127.0.0.1",
            _temp_dir=str(root / "ray"),  # Ray makes this one 0777; root keeps others out
        )
    )

    def stop() -> None:  # before Ray's own exit handler: its processes first, then the folder
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    atexit.register(stop)
    return root


def private_resources(plan: Plan, spares: int) -> tuple[dict[str, float], int]:
    """What :func:`private_cluster` offers for ``plan`` with ``spares`` warm spares: twice the
    plan's workers (stage replicas and spares), as units of each of its datacenters and as CPUs
    (at least this machine's cores), so that replacements and spare refills find room. The
    workers share this machine's cores, as with the local launcher."""
    workers = sum(len(st.replicas) for st in plan.stages) + spares
    dcs = {rep.datacenter for st in plan.stages for rep in st.replicas}
    return {f"dc:{d}": 2.0 * workers for d in sorted(dcs)}, max(os.cpu_count() or 1, 2 * workers)


def tried(start: Callable[[], T]) -> T:
    """``start()`` (a node's start), tried up to START_TRIES times while Ray gives up on the
    node's registration (STARTUP_TIMEOUT). Before each new try the processes the failed one
    started are killed: the children this process gained meanwhile and everything below them,
    so no half-started node is left and no other node (nor another test process's cluster) is
    touched."""
    for left in range(START_TRIES - 1, -1, -1):
        before = set(processes.children(os.getpid()))
        try:
            return start()
        except Exception as e:
            if STARTUP_TIMEOUT not in str(e) or not left:
                raise
            new = [
                p
                for c in set(processes.children(os.getpid())) - before
                for p in processes.descendants(c)
            ]
            logging.getLogger(__name__).warning(
                "a Ray node did not register in time (%s); killing its %d processes and "
                "starting it again", e, len(new))  # fmt: skip
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    raise AssertionError("unreachable")
