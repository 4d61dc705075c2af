"""``dmsc up``'s gateway flags for HTTPS: ``--tls-cert FILE --tls-key FILE`` (the operator's
certificate), ``--tls`` (a self-signed one made here, kept under ``$DMSC_HOME/tls``) and
``--insecure`` (plain HTTP on an address other than loopback). Errors name the flag or the file.

Plain HTTP is served on loopback only unless ``--insecure`` says otherwise: keys, prompts and
the dashboard's session cookie would cross the network in clear.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from dmsc.spec import SpecError

SELF_SIGNED_MIN_LEFT = dt.timedelta(days=30)  # a kept self-signed certificate closer: a new one


@dataclass(frozen=True)
class GatewayTLS:
    """The certificate and key files the gateway serves HTTPS with, and what to print."""

    cert: Path
    key: Path
    fingerprint: str
    self_signed: bool


def loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_pair(cert: Path, key: Path) -> None:
    """The files exist and the key is the certificate's (what uvicorn will load)."""
    for path, flag in ((cert, "--tls-cert"), (key, "--tls-key")):
        if not path.is_file():
            raise SpecError("command line", flag, f"{path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        why = f"{cert} with {key}: not a PEM certificate and its private key ({exc.reason})"
        raise SpecError("command line", "--tls-cert", why) from None


def _self_signed(home: Path, host: str) -> tuple[Path, Path]:
    """The kept self-signed certificate for ``host`` (made when missing, for another host, or
    near its end)."""
    from cryptography import x509

    from dmsc.runtime.transport.authority import self_signed, write_private_bytes

    folder = home / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    cert, key = folder / "gateway.pem", folder / "gateway.key"
    hosts = [host.strip("[]"), "localhost", "127.0.0.1"]  # an IPv6 address without brackets
    if host in ("0.0.0.0", "::", ""):  # every address: name this machine
        hosts = [socket.gethostname(), "localhost", "127.0.0.1"]
    if cert.exists() and key.exists():
        got = x509.load_pem_x509_certificate(cert.read_bytes())
        names = got.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        covered = {str(n.value) for n in names}
        left = got.not_valid_after_utc - dt.datetime.now(dt.UTC)
        if set(hosts) <= covered and left > SELF_SIGNED_MIN_LEFT:
            return cert, key
    cert_pem, key_pem = self_signed(hosts)
    write_private_bytes(key, key_pem)
    cert.write_bytes(cert_pem)
    return cert, key


def gateway_tls(
    gateway: str | None,
    home: Path,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls: bool,
    insecure: bool,
) -> GatewayTLS | None:
    """The flags checked; the certificate to serve with (None: plain HTTP)."""
    from dmsc.runtime.transport.authority import fingerprint

    wants_tls = tls or tls_cert is not None or tls_key is not None
    if gateway is None:
        for on, flag in ((tls, "--tls"), (tls_cert, "--tls-cert"), (tls_key, "--tls-key"),
                         (insecure, "--insecure")):  # fmt: skip
            if on:
                raise SpecError("command line", flag, "only with --gateway HOST:PORT")
        return None
    if wants_tls and insecure:
        raise SpecError("command line", "--insecure", "plain HTTP or TLS: not both")
    if tls and (tls_cert or tls_key):
        why = "--tls makes a self-signed certificate; with your own, give --tls-cert and --tls-key"
        raise SpecError("command line", "--tls", why)
    if (tls_cert is None) != (tls_key is None):
        missing = "--tls-key" if tls_key is None else "--tls-cert"
        raise SpecError("command line", missing, "--tls-cert and --tls-key go together")
    host = gateway.rpartition(":")[0]
    if not wants_tls:
        if not loopback(host) and not insecure:
            why = (
                f"plain HTTP on {host} would carry keys, prompts and session cookies in clear: "
                "give --tls (a self-signed certificate) or --tls-cert/--tls-key, or --insecure"
            )
            raise SpecError("command line", "--gateway", why)
        return None
    if tls_cert is not None and tls_key is not None:
        cert, key = tls_cert.resolve(), tls_key.resolve()
        _check_pair(cert, key)
        return GatewayTLS(cert, key, fingerprint(cert.read_bytes()), self_signed=False)
    cert, key = _self_signed(home, host)
    return GatewayTLS(cert, key, fingerprint(cert.read_bytes()), self_signed=True)
