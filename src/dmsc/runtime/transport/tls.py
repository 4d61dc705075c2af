"""Mutual TLS between the services: gRPC credentials from a :class:`~.authority.Leaf`, the
process's own identity, and the fence check on the caller's certificate.

A process that holds a leaf (:func:`install`) serves and calls over TLS only (:mod:`.rpc`): its
servers ask every caller for a certificate of the same authority (``require_client_auth``: a
caller with none, or with one of another authority, fails the handshake and sends nothing), and
its channels check the server's certificate against that authority, under the one name every
leaf carries (``grpc.ssl_target_name_override``; see :mod:`.authority`). A process with none
(a test that builds a worker by hand, ``dmsc calibrate``'s loopback probe) stays on plain gRPC.

Fencing: a worker's leaf names its SID and the epoch it was started in. A :class:`FenceFloors`
holds, per SID, the lowest epoch still served: each registry keeps its own (raised when a
replacement registers or an instance is fenced: :mod:`dmsc.runtime.business.registry`), and
checks it on its own service and the control service; a worker learns its registry's floors
with its registration and each heartbeat, into :data:`FENCES`, which its server checks. A call
made with the leaf of an epoch below its SID's floor is refused (PERMISSION_DENIED) before its
request is read, whatever it carries. In a worker the floors are as fresh as its last heartbeat
(a third of the failure timeout).

Renewal: a leaf lives :data:`~.authority.LEAF_LIFETIME` (``DMSC_TLS_LEAF_SECONDS`` sets it in
the control plane). The control plane replaces every leaf before it expires
(:mod:`dmsc.runtime.control.launch.renewal`); a process takes its new one with :func:`renew`.
Its servers follow it (:func:`following_credentials`: gRPC's certificate-configuration fetcher,
asked before each new connection is accepted; connections already open keep theirs) and its
channels are opened anew with it on their next call (:class:`~.rpc.Client`). A TLS handshake
checks a certificate once, when a connection opens: an open connection outlives the leaf it was
opened with, a new one needs a leaf still valid.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from dmsc.runtime.transport.authority import (
    LEAF_LIFETIME,
    SERVICE_NAME,
    Authority,
    Leaf,
    worker_name,
)

__all__ = [
    "FENCES",
    "FenceFloors",
    "Leaf",
    "channel_options",
    "current",
    "install",
    "peer_name",
    "renew",
]

LIFETIME_ENV = "DMSC_TLS_LEAF_SECONDS"  # a leaf's lifetime in the control plane (default: a week)
# The least a leaf handed over at a start lives (the control plane's, the commands', a starting
# worker's or a spare's taking a stage over): a start that loads a large checkpoint takes
# minutes, and the renewals begin once it is done. Each is replaced at the first renewal.
FIRST_LIFETIME = dt.timedelta(minutes=10)

_identity: Leaf | None = None
_issuer: Callable[[str, int], Leaf] | None = None
_authority: Authority | None = None
_lifetime: dt.timedelta = LEAF_LIFETIME


def install(leaf: Leaf | None, issuer: Callable[[str, int], Leaf] | None = None) -> None:
    """This process's identity from now on (None: plain gRPC again); ``issuer`` makes a
    worker's leaf (SID, epoch) in the process that starts workers (the control plane)."""
    global _identity, _issuer, _authority
    _identity, _issuer = leaf, issuer
    if issuer is None:
        _authority = None


def renew(leaf: Leaf, same_name: bool = False) -> None:
    """This process's identity replaced by ``leaf`` (a renewal, or a spare's new stage): its
    servers present it to the next connections, its clients open their channels with it.
    ``same_name``: only a leaf with the common name of the one held (a renewal)."""
    global _identity
    if _identity is None:
        raise ValueError("this process holds no certificate to renew")
    if leaf.ca != _identity.ca:
        raise ValueError("the new certificate is of another authority")
    if same_name and common_name(leaf) != common_name(_identity):
        raise ValueError(
            f"the new certificate names {common_name(leaf)}, this process {common_name(_identity)}"
        )
    _identity = leaf


def common_name(leaf: Leaf) -> str:
    """The common name of ``leaf``'s certificate (``SID@EPOCH``, ``control``, ``cli``)."""
    names = x509.load_pem_x509_certificate(leaf.cert).subject.get_attributes_for_oid(
        NameOID.COMMON_NAME
    )
    return str(names[0].value) if names else ""


def renew_wire(wire: dict[str, str] | None) -> None:
    """:func:`renew` with the leaf of a worker configuration (``WorkerConfig.tls``), if it has
    one and this process holds a certificate (a worker built without TLS stays without)."""
    if wire is not None and _identity is not None:
        renew(Leaf.from_wire(wire))


def current() -> Leaf | None:
    """This process's identity (None: no TLS)."""
    return _identity


def issuer() -> Callable[[str, int], Leaf] | None:
    """What issues workers' leaves here (None: workers start without one)."""
    return _issuer


class FenceFloors:
    """Per SID, the lowest epoch whose certificate is still honoured (thread-safe)."""

    def __init__(self) -> None:
        self._floors: dict[str, int] = {}
        self._lock = threading.Lock()

    def raise_floor(self, sid: str, epoch: int) -> None:
        with self._lock:
            self._floors[sid] = max(self._floors.get(sid, 0), epoch)

    def raise_floors(self, floors: dict[str, int]) -> None:
        for sid, epoch in floors.items():
            self.raise_floor(sid, epoch)

    def floors(self) -> dict[str, int]:
        with self._lock:
            return dict(self._floors)

    def fenced(self, sid: str, epoch: int) -> bool:
        with self._lock:
            return self._floors.get(sid, 0) > epoch


FENCES = FenceFloors()  # a worker process's: learnt from its registry


def server_credentials(leaf: Leaf) -> grpc.ServerCredentials:
    """A server that presents ``leaf`` and serves only callers with a leaf of its authority."""
    return grpc.ssl_server_credentials(
        [(leaf.key, leaf.cert)], root_certificates=leaf.ca, require_client_auth=True
    )


def _configuration(leaf: Leaf) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(leaf.key, leaf.cert)], leaf.ca)


def following_credentials() -> grpc.ServerCredentials:
    """A server that presents this process's leaf as it is when each connection opens (gRPC
    asks the fetcher before it accepts one; None keeps the configuration it has), and serves
    only callers with a leaf of its authority."""
    leaf = _identity
    if leaf is None:
        raise ValueError("this process holds no certificate")
    served = [leaf]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        now = _identity
        if now is None or now is served[0]:
            return None
        served[0] = now
        return _configuration(now)

    return grpc.dynamic_ssl_server_credentials(
        _configuration(leaf), fetch, require_client_authentication=True
    )


def channel_credentials(leaf: Leaf) -> grpc.ChannelCredentials:
    """A channel that presents ``leaf`` and trusts servers of its authority only."""
    return grpc.ssl_channel_credentials(
        root_certificates=leaf.ca, private_key=leaf.key, certificate_chain=leaf.cert
    )


def channel_options() -> list[tuple[str, str]]:
    """Every leaf names :data:`SERVICE_NAME`, not its host: the name a channel checks."""
    return [("grpc.ssl_target_name_override", SERVICE_NAME)]


def peer_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the caller's certificate (None: the call came without TLS)."""
    names = context.auth_context().get("x509_common_name")
    return names[0].decode() if names else None


def fence_reason(name: str | None, fences: FenceFloors) -> str | None:
    """Why a caller named ``name`` (a worker's ``SID@EPOCH``) is refused, or None."""
    if name is None or "@" not in name:
        return None
    sid, _, epoch = name.rpartition("@")
    if epoch.isdigit() and fences.fenced(sid, int(epoch)):
        return f"the certificate of {sid} at epoch {epoch} is fenced: a newer epoch holds {sid}"
    return None


def fence_checked(handler: grpc.RpcMethodHandler, fences: FenceFloors) -> grpc.RpcMethodHandler:
    """``handler`` (a client-streaming method, as :mod:`.rpc` makes them all) behind the fence
    check: a fenced certificate's call is refused before its request is read."""

    def check(context: grpc.ServicerContext) -> None:
        why = fence_reason(peer_name(context), fences)
        if why is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if handler.stream_stream is not None:
        inner_ss = handler.stream_stream

        def streamed(pieces: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            check(context)
            yield from inner_ss(pieces, context)

        return grpc.stream_stream_rpc_method_handler(
            streamed, handler.request_deserializer, handler.response_serializer
        )
    inner_su = handler.stream_unary

    def unary(pieces: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        check(context)
        return inner_su(pieces, context)

    return grpc.stream_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer
    )


def install_authority(home: Path) -> Leaf:
    """In the control plane: the authority of ``home`` (made the first time), this process's
    leaf (``control``) and the issuing of workers' leaves installed; returns a leaf for the
    commands that call the control plane (``cli``, kept in the owner-only ``control.json``)."""
    global _authority, _lifetime
    _lifetime = leaf_lifetime()
    ca = Authority.at(home / "tls")
    first = max(_lifetime, FIRST_LIFETIME)  # renewals (renewal()) are of _lifetime
    install(ca.issue("control", first), lambda sid, epoch: ca.issue(worker_name(sid, epoch), first))
    _authority = ca
    return ca.issue("cli", first)


def leaf_lifetime() -> dt.timedelta:
    """How long the leaves issued here live: ``DMSC_TLS_LEAF_SECONDS`` or a week."""
    text = os.environ.get(LIFETIME_ENV)
    if text is None:
        return LEAF_LIFETIME
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds >= 2:
        raise ValueError(f"{LIFETIME_ENV}={text!r}: a number of seconds, at least 2")
    return dt.timedelta(seconds=seconds)


def renewal() -> tuple[Callable[[str], Leaf], dt.timedelta] | None:
    """In the control plane: what issues a leaf by name (``control``, ``cli``) and the lifetime
    of the leaves it issues; None where this process is no authority."""
    ca, life = _authority, _lifetime
    if ca is None:
        return None
    return (lambda name: ca.issue(name, life)), life
