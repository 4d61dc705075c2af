"""What the TLS tests share: the certificate a server presents, read with Python's own TLS."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

from dmsc.runtime.transport.authority import Authority


def served_name(address: str, ca: Authority, tmp: Path) -> str:
    """The common name of the certificate the server at ``address`` presents to a new
    connection, read with Python's own TLS (``ssl``), checked against the authority ``ca``."""
    caller = ca.issue("cli")
    (tmp / "c.pem").write_bytes(caller.cert)
    (tmp / "c.key").write_bytes(caller.key)
    ctx = ssl.create_default_context(cadata=ca.pem.decode())
    ctx.load_cert_chain(tmp / "c.pem", tmp / "c.key")
    ctx.set_alpn_protocols(["h2"])
    host, _, port = address.rpartition(":")
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="dmsc.internal") as conn,
    ):
        cert: Any = conn.getpeercert()
    subject = dict(x[0] for x in cert["subject"])
    return str(subject["commonName"])
