"""Leaf certificates replaced before they expire (issue 33).

A leaf lives a week by default (``DMSC_TLS_LEAF_SECONDS`` in the control plane's environment sets
it: :func:`dmsc.runtime.transport.tls.leaf_lifetime`), and a TLS handshake refuses an expired
one: without renewal a deployment older than a leaf could open no new connection. Every third
of that lifetime :func:`renew_all` issues, from the deployment's authority:

- the control plane's own leaf (``control``): its servers (registry, control service, the
  gateway's calls) present the new one to each new connection, its channels reopen with it;
- each worker's and warm spare's, with the name it holds (``SID@EPOCH`` of the epoch it was
  started in or took its stage over at), sent in ``Renew`` over its stage service: the
  channel is authenticated by the leaf being replaced, and the worker takes a leaf of its own
  name only (a spare that took a stage over meanwhile refuses its old name's);
- the CLI's, through ``on_cli`` (the daemon rewrites ``control.json``, which every command
  reads when it starts).

A leaf is thus never older than a third of its lifetime plus one renewal's time. The leaves
handed over at a start (and with ``Assume``) live at least ten minutes
(:data:`~dmsc.runtime.transport.tls.FIRST_LIFETIME`), so that a slow start does not outlive its
own: the first renewal replaces them. A worker
that does not answer is logged and left to the failure detector; if it comes back after its
leaf expired, new connections to and from it fail the handshake, and it is replaced as any
worker that cannot be reached.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from dmsc.runtime.transport import tls
from dmsc.runtime.transport.authority import Leaf, worker_name
from dmsc.runtime.transport.messages import STAGE_SERVICE, Renew
from dmsc.runtime.transport.rpc import Client

if TYPE_CHECKING:
    from dmsc.runtime.control.launch.deployment import Deployment

_log = logging.getLogger("dmsc.renewal")


def renew_all(dep: Deployment, on_cli: Callable[[Leaf], None] | None = None) -> list[str]:
    """New leaves for this process, every worker and spare of ``dep`` and the CLI; returns the
    SIDs of the workers that could not be given theirs (nothing to do without an authority)."""
    renewal = tls.renewal()
    if renewal is None:
        return []
    named, _ = renewal
    tls.renew(named("control"))
    failed = []
    for h in [*dep.handles, *dep.tp.handles, *list(dep.spares.handles)]:
        leaf = named(worker_name(h.config.sid, h.config.epoch))
        client = Client(h.address, STAGE_SERVICE, token=dep.token)
        try:
            client.send("Renew", Renew(tls=leaf.wire()), timeout_s=10)
        except grpc.RpcError as exc:
            _log.warning("could not renew the certificate of %s: %s", h.config.sid, exc.details())
            failed.append(h.config.sid)
        finally:
            client.close()
    if on_cli is not None:
        on_cli(named("cli"))
    return failed


def start_renewal(
    dep: Deployment,
    stop: threading.Event,
    on_cli: Callable[[Leaf], None] | None = None,
    period_s: float | None = None,
) -> threading.Thread | None:
    """Renew every ``period_s`` (default: a third of a leaf's lifetime) until ``stop``; None
    where this process issues no leaves (no TLS)."""
    renewal = tls.renewal()
    if renewal is None:
        return None
    every = period_s if period_s is not None else renewal[1].total_seconds() / 3

    def loop() -> None:
        while not stop.wait(every):
            try:
                renew_all(dep, on_cli)
            except Exception:  # the next round tries again; the log says why
                _log.exception("certificate renewal failed")

    thread = threading.Thread(target=loop, name="tls-renewal", daemon=True)
    thread.start()
    return thread
