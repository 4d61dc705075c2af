"""Mutual TLS between the services (issue 33, item 2), in this process over 127.0.0.1: the
registry's and a stage worker's real method tables refuse a caller without a certificate, with
one of another authority, or with a fenced epoch's; a capture of the bytes between two services
shows none of the credential, the prompt or the tensor."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from runtime_helpers import first_stage

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.worker import STAGE_SERVICE, StageWorker
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.authority import Authority, Leaf, worker_name
from dmsc.runtime.transport.messages import Heartbeat
from dmsc.runtime.transport.replies import HeartbeatReply
from dmsc.runtime.transport.rpc import Client, bytes_handler, serve
from dmsc.runtime.transport.wire import Kind, encode

TOKEN = "service-credential-0123456789"
CA = Authority.new("test CA")
STRANGER = Authority.new("another CA")


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[dict[str, str], tls.FenceFloors]]:
    """The registry and a stage worker, both over mutual TLS with fence floors of their own."""
    fences = tls.FenceFloors()
    reg = Registry(ttl_s=60, fences=fences)
    # the registry's methods check its own floors; the worker's server is given them
    reg_leaf = CA.issue("control")
    methods = registry_methods(reg)
    reg_server, reg_port = serve(REGISTRY_SERVICE, methods, token=TOKEN, leaf=reg_leaf)
    worker = StageWorker(first_stage(f"127.0.0.1:{reg_port}", epoch=0, token=TOKEN))
    leaf = CA.issue(worker_name("s0", 0))
    server, port = serve(STAGE_SERVICE, worker.methods(), token=TOKEN, leaf=leaf, fences=fences)
    # s1 was replaced: its epoch-3 instance registered, so the epoch-2 one is fenced
    fences.raise_floor("s1", 3)
    try:
        where = {REGISTRY_SERVICE: f"127.0.0.1:{reg_port}", STAGE_SERVICE: f"127.0.0.1:{port}"}
        yield where, fences
    finally:
        server.stop(0)
        reg_server.stop(0)


METHOD = {REGISTRY_SERVICE: ("Lookup", {}), STAGE_SERVICE: ("Health", {})}


def _call(address: str, service: str, leaf: Leaf | None, token: str | None = TOKEN) -> None:
    method, body = METHOD[service]
    client = Client(address, service, timeout_s=5, token=token, leaf=leaf)
    try:
        client.call(method, body)
    finally:
        client.close()


@pytest.mark.parametrize("service", [REGISTRY_SERVICE, STAGE_SERVICE])
def test_every_service_refuses_strangers_and_fenced_epochs(services, service: str) -> None:  # type: ignore[no-untyped-def]
    addresses, _ = services
    address = addresses[service]
    _call(address, service, CA.issue(worker_name("s1", 3)))  # the current instance: served
    _call(address, service, CA.issue("control"))
    refusals = {
        "no certificate": (None, grpc.StatusCode.UNAVAILABLE),
        "another authority": (STRANGER.issue("control"), grpc.StatusCode.UNAVAILABLE),
        "a fenced epoch": (CA.issue(worker_name("s1", 2)), grpc.StatusCode.PERMISSION_DENIED),
    }
    for what, (leaf, code) in refusals.items():
        with pytest.raises(grpc.RpcError) as err:
            _call(address, service, leaf)
        assert err.value.code() == code, what
        if code == grpc.StatusCode.PERMISSION_DENIED:
            assert "s1 at epoch 2 is fenced" in (err.value.details() or "")
    # the credential is still asked for: a leaf alone does not do (a second factor, per run)
    with pytest.raises(grpc.RpcError) as err:
        _call(address, service, CA.issue("control"), token=None)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_registry_fences_certificates_of_a_replaced_instance() -> None:
    fences = tls.FenceFloors()
    reg = Registry(ttl_s=60, fences=fences)
    from dmsc.runtime.business.registry import ServiceInfo

    assert reg.register(ServiceInfo("s0", "stage", 0, "a:1", epoch=0))
    assert not fences.fenced("s0", 0)
    reg.fence("s0", 2)  # declared failed: its replacement comes at epoch 2
    assert fences.fenced("s0", 0) and fences.fenced("s0", 1) and not fences.fenced("s0", 2)
    assert reg.register(ServiceInfo("s1", "stage", 1, "a:2", epoch=4))
    assert fences.floors() == {"s0": 2, "s1": 4}
    # a worker learns the floors with each heartbeat (and its registration), for its server
    server, port = serve(REGISTRY_SERVICE, registry_methods(reg))
    client = Client(f"127.0.0.1:{port}", REGISTRY_SERVICE, timeout_s=5)
    try:
        beat = client.ask("Heartbeat", Heartbeat(sid="s1", epoch=4), HeartbeatReply)
        assert beat.known and beat.fences == {"s0": 2, "s1": 4}
    finally:
        client.close()
        server.stop(0)


class Tap:
    """A TCP proxy on 127.0.0.1 that keeps a copy of every byte it forwards."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def _captured(secure: bool) -> tuple[bytes, list[bytes]]:
    """The bytes between a client and an echo server carrying a prompt and a tensor frame, and
    the markers to look for."""
    prompt = "the secret prompt: what is the launch code?"
    tensor = torch.full((64,), 1234.5678, dtype=torch.float32)
    frame = encode(Kind.ACTIVATION, 1, 0, tensor, 0)
    server_leaf = CA.issue("control") if secure else None
    client_leaf = CA.issue(worker_name("s0", 0)) if secure else None

    def echo(b: bytes) -> bytes:
        return b

    server, port = serve("dmsc.Echo", {"Echo": bytes_handler(echo)}, token=TOKEN, leaf=server_leaf,
                         fences=tls.FenceFloors())  # fmt: skip
    tap = Tap(f"127.0.0.1:{port}")
    client = Client(tap.address, "dmsc.Echo", timeout_s=10, token=TOKEN, leaf=client_leaf)
    try:
        assert client.raw("Echo", prompt.encode()) == prompt.encode()
        assert client.raw("Echo", json.dumps({"prompt": prompt}).encode())
        assert client.raw("Echo", frame) == frame
    finally:
        client.close()
        tap.close()
        server.stop(0)
    markers = [TOKEN.encode(), prompt.encode(), tensor.numpy().tobytes()[:16]]
    return bytes(tap.seen), markers


def test_no_plaintext_crosses_the_wire_between_two_services() -> None:
    plain, markers = _captured(secure=False)
    assert all(m in plain for m in markers)  # the tap sees everything when there is no TLS
    sealed, markers = _captured(secure=True)
    assert len(sealed) > 2 * len(markers[2])
    assert not any(m in sealed for m in markers)


def test_a_workers_leaf_names_its_sid_and_epoch_and_lives_a_week() -> None:
    """What the docs say of a worker's certificate, read back from the certificate itself."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    leaf = CA.issue(worker_name("stage1-r0", 3))
    cert = x509.load_pem_x509_certificate(leaf.cert)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "stage1-r0@3"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["dmsc.internal"]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert abs(lifetime.total_seconds() - (7 * 86400 + 300)) < 5  # 7 days, 5 min of skew
    assert cert.issuer == CA.cert.subject
