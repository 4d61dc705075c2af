"""Certificates made with ``cryptography``: the deployment's certificate authority and the
gateway's self-signed certificate.

- :class:`Authority`: one per data directory (``$DMSC_HOME/tls/ca.pem``, its key ``ca.key`` mode
  0600), made at the first ``dmsc up`` and kept. It issues the leaf certificates the services
  present to each other (:mod:`.tls`): one per SID and epoch for a worker (common name
  ``SID@EPOCH``), ``control`` for the control plane, ``cli`` for the commands that call it. A
  leaf lives :data:`LEAF_LIFETIME` (short: a leaked one is worth little for long; the control
  plane renews each before its end, :mod:`dmsc.runtime.control.launch.renewal`) and carries the
  one DNS name :data:`SERVICE_NAME`, the name every client checks (a worker's address on a Ray
  node is an IP known only once it runs; the CA, not the host name, is what is trusted).
- :func:`self_signed`: ``dmsc up --tls`` without a certificate of the operator's own, for the
  gateway's host; :func:`fingerprint` is its SHA-256, printed so a client can pin it.

Keys are P-256 (ECDSA): a key is made in about a millisecond, so a leaf per worker start costs
nothing a start would notice.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICE_NAME = "dmsc.internal"  # the DNS name in every leaf; clients check it (tls.py)
LEAF_LIFETIME = dt.timedelta(days=7)
CA_LIFETIME = dt.timedelta(days=3650)
GATEWAY_LIFETIME = dt.timedelta(days=365)
_SKEW = dt.timedelta(minutes=5)  # not-before set back: clocks of two nodes differ a little


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class Leaf:
    """A certificate and its key (PEM), with the CA certificate that vouches for it."""

    ca: bytes
    cert: bytes
    key: bytes

    def wire(self) -> dict[str, str]:
        """As JSON-able text (a worker's start configuration, ``control.json``)."""
        return {"ca": self.ca.decode(), "cert": self.cert.decode(), "key": self.key.decode()}

    @classmethod
    def from_wire(cls, d: dict[str, str]) -> Leaf:
        return cls(d["ca"].encode(), d["cert"].encode(), d["key"].encode())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_private_bytes(path: Path, data: bytes) -> None:
    """``data`` to ``path``, mode 0600 (also when the file existed with a wider one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class Authority:
    """The certificate authority of one data directory."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key
        self.pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def at(cls, folder: Path) -> Authority:
        """The authority kept in ``folder`` (``ca.pem``, ``ca.key``), made there the first
        time; the folder is the owner's only (0700)."""
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        cert_path, key_path = folder / "ca.pem", folder / "ca.key"
        if cert_path.exists() and key_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{key_path}: not an EC private key")
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            if cert.not_valid_after_utc > _now() + LEAF_LIFETIME:
                return cls(cert, key)
        made = cls.new("dmsc deployment CA")
        write_private_bytes(key_path, _key_pem(made.key))
        cert_path.write_bytes(made.pem)
        return made

    @classmethod
    def new(cls, name: str) -> Authority:
        """A new authority (in memory)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, subject, key, CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    def issue(
        self, name: str, lifetime: dt.timedelta = LEAF_LIFETIME, hosts: tuple[str, ...] = ()
    ) -> Leaf:
        """A leaf for ``name`` (its common name), good as server and as client; ``hosts`` (IP
        addresses or names) are added to :data:`SERVICE_NAME` for clients that check the
        address they dial (Ray's processes dial IP addresses)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, self.cert.subject, key, lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_names((SERVICE_NAME, *hosts))), False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return Leaf(self.pem, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    lifetime: dt.timedelta,
) -> x509.CertificateBuilder:
    """A certificate for ``key``'s public half, good from a little before now for ``lifetime``."""
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + lifetime)
    )


def worker_name(sid: str, epoch: int) -> str:
    """A worker leaf's common name: its SID and the epoch it was started in."""
    return f"{sid}@{epoch}"


def self_signed(hosts: list[str], lifetime: dt.timedelta = GATEWAY_LIFETIME) -> tuple[bytes, bytes]:
    """A self-signed server certificate for ``hosts`` (names or IP addresses) and its key, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = _names(hosts)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        _builder(subject, subject, key, lifetime)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names: an IP address as one, anything else as a DNS name."""
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def fingerprint(cert_pem: bytes) -> str:
    """The certificate's SHA-256 fingerprint, as ``AB:CD:...`` (what browsers and
    ``openssl x509 -fingerprint -sha256`` show)."""
    digest = x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256())
    return ":".join(f"{b:02X}" for b in digest)
