"""Plain TCP connections between the deployment's processes, beside gRPC: what every such
connection does first (mutual TLS where the process holds a leaf, then a hello with the
deployment's token), and reading a known number of bytes. Used by a stage's pipeline streams
(:mod:`dmsc.runtime.compute.pipe_stream`) and by the calls made on them (:mod:`.stream_calls`).
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dmsc.runtime.transport import tls
from dmsc.runtime.transport.authority import SERVICE_NAME

_CONTEXTS: dict[bytes, tuple[ssl.SSLContext, ssl.SSLContext]] = {}  # by leaf certificate


def hello(token: str | None, magic: bytes) -> bytes:
    """What a connection says first: its kind's magic and a digest of the deployment's token."""
    digest = hashlib.sha256(token.encode()).digest() if token else bytes(32)
    return magic + digest


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """Server and client contexts of this process's leaf as it is now (None: no TLS): each
    presents the leaf and requires a peer's of the same authority. Made again after a renewal
    (a connection's handshake takes the leaf of its time)."""
    leaf = tls.current()
    if leaf is None:
        return None
    made = _CONTEXTS.get(leaf.cert)
    if made is None:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the name every leaf carries
        with tempfile.TemporaryDirectory() as home:  # ssl loads a chain from files only
            cert, key = Path(home, "cert.pem"), Path(home, "key.pem")
            cert.write_bytes(leaf.cert)
            key.touch(0o600)
            key.write_bytes(leaf.key)
            for ctx in (server, client):
                ctx.load_cert_chain(cert, key)
                ctx.load_verify_locations(cadata=leaf.ca.decode())
                ctx.verify_mode = ssl.CERT_REQUIRED
        made = _CONTEXTS[leaf.cert] = (server, client)
    return made


def peer_name(conn: socket.socket) -> str | None:
    """The common name of the certificate the other end of ``conn`` presented (None: no TLS)."""
    if not isinstance(conn, ssl.SSLSocket):
        return None
    subject: Any = (conn.getpeercert() or {}).get("subject", ())
    names = [pair[1] for rdn in subject for pair in rdn if pair[0] == "commonName"]
    return str(names[0]) if names else None


def read_exact(conn: socket.socket, buf: memoryview) -> bool:
    """Fill ``buf`` from ``conn``; False at the end of the stream before it was full."""
    done = 0
    while done < len(buf):
        n = conn.recv_into(buf[done:])
        if n == 0:
            return False
        done += n
    return True


def store_client(address: str, timeout_s: float) -> Any:
    """A client of the deployment's TCPStore at ``address`` (``host:port``), its waits bounded
    by ``timeout_s`` (torch's stubs do not export the class's name)."""
    host, _, port = address.rpartition(":")
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)
    )


def dial(address: str, said: bytes, timeout_s: float) -> socket.socket:
    """A connection to the listener at ``address`` (``host:port``; TLS where this process holds
    a leaf) that said ``said`` (a :func:`hello`), connected within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    contexts = tls_contexts()
    if contexts is not None:
        sock = contexts[1].wrap_socket(sock, server_hostname=SERVICE_NAME)
    sock.settimeout(None)
    sock.sendall(said)
    return sock
