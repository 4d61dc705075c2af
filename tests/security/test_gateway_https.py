"""HTTPS at the gateway (issue 33, item 1): ``dmsc up``'s TLS flags checked before anything
starts, the self-signed certificate and the fingerprint printed for it, and a TLS port that
answers no plain-HTTP request."""

from __future__ import annotations

import hashlib
import socket
import ssl
import stat
from pathlib import Path

import httpx
import pytest
from https_helpers import https_client, https_server

from dmsc.cli.gateway_tls import gateway_tls, loopback
from dmsc.runtime.transport.authority import self_signed
from dmsc.spec import SpecError


def _sha256(pem: bytes) -> str:
    """The fingerprint as an independent reference computes it: SHA-256 of the DER bytes."""
    der = ssl.PEM_cert_to_DER_cert(pem.decode())
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def test_a_plain_http_request_to_the_tls_port_gets_no_http_answer(tmp_path: Path) -> None:
    async def hello(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})

    with https_server(tmp_path) as holder:
        client = https_client(holder, hello)
        r = client.get("/")
        assert r.text == "hello" and r.headers["strict-transport-security"].startswith("max-age")
        client.close()
        port = int(holder[1].rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n")
            said = b""
            try:
                while chunk := s.recv(4096):
                    said += chunk
            except ConnectionResetError:
                pass
        assert b"HTTP/1." not in said and b"hello" not in said  # closed, no answer
        with pytest.raises(httpx.HTTPError):
            httpx.get(holder[1].replace("https", "http") + "/", timeout=10)


def test_tls_self_signed_is_made_once_private_and_its_fingerprint_is_the_certificates(
    tmp_path: Path,
) -> None:
    made = gateway_tls("127.0.0.1:8443", tmp_path, None, None, tls=True, insecure=False)
    assert made is not None and made.self_signed
    assert stat.S_IMODE(made.key.stat().st_mode) == 0o600
    assert made.fingerprint == _sha256(made.cert.read_bytes())
    again = gateway_tls("127.0.0.1:9443", tmp_path, None, None, tls=True, insecure=False)
    assert again is not None and again.fingerprint == made.fingerprint  # kept, not remade
    other = gateway_tls("10.1.2.3:8443", tmp_path, None, None, tls=True, insecure=False)
    assert other is not None and other.fingerprint != made.fingerprint  # another host


def test_tls_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    cert_pem, key_pem = self_signed(["127.0.0.1"])
    _, other_key = self_signed(["127.0.0.1"])
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "k.pem").write_bytes(key_pem)
    (tmp_path / "other.pem").write_bytes(other_key)
    own = gateway_tls("0.0.0.0:443", tmp_path, tmp_path / "c.pem", tmp_path / "k.pem", False, False)
    assert own is not None and not own.self_signed and own.fingerprint == _sha256(cert_pem)
    with pytest.raises(SpecError) as err:
        gateway_tls(
            "0.0.0.0:443", tmp_path, tmp_path / "c.pem", tmp_path / "other.pem", False, False
        )
    assert err.value.field == "--tls-cert" and "its private key" in err.value.reason
    # plain HTTP: on loopback, or elsewhere with --insecure only
    assert gateway_tls("127.0.0.1:80", tmp_path, None, None, False, False) is None
    assert gateway_tls("0.0.0.0:80", tmp_path, None, None, False, insecure=True) is None
    with pytest.raises(SpecError) as err:
        gateway_tls("0.0.0.0:80", tmp_path, None, None, False, False)
    assert err.value.field == "--gateway" and "--insecure" in err.value.reason
    assert loopback("localhost") and loopback("127.0.0.2") and loopback("[::1]")
    assert not loopback("0.0.0.0") and not loopback("example.com")
