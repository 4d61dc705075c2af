"""Ray's own security settings as dmsc builds and reads them (issue 33, point 3), as pure
functions: the TLS settings of the private cluster (files, modes, the names Ray 2.60 reads, a
certificate its processes accept for 127.0.0.1), what a joined cluster's settings leave open,
and ``--ray-address`` without ``auto``. A private cluster with them is started in
tests/integration/test_ray_private.py."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509

from dmsc.runtime.control.launch.ray_checks import address_problem, exposure
from dmsc.runtime.control.launch.ray_private import (
    RAY_HOSTS,
    RAY_LEAF_LIFETIME,
    TLS_ENV,
    tls_settings,
)
from dmsc.runtime.transport.authority import Authority


def _ray_reads() -> set[str]:
    """The TLS variables Ray 2.60's Python side reads (its binaries read the same names)."""
    import ray._common.tls_utils as tls_utils

    text = Path(tls_utils.__file__).read_text()
    return {name for name in TLS_ENV if f'"{name}"' in text}


def test_the_private_clusters_tls_settings(tmp_path: Path) -> None:
    ca = Authority.at(tmp_path / "home" / "tls")
    leaf = ca.issue("ray", RAY_LEAF_LIFETIME, RAY_HOSTS)
    env = tls_settings(tmp_path / "private" / "tls", leaf)
    assert tuple(env) == TLS_ENV and _ray_reads() == set(TLS_ENV)
    assert env["RAY_USE_TLS"] == "1"
    folder = tmp_path / "private" / "tls"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(env["RAY_TLS_SERVER_KEY"]).stat().st_mode) == 0o600
    assert Path(env["RAY_TLS_CA_CERT"]).read_bytes() == ca.pem  # only dmsc's authority trusted
    cert = x509.load_pem_x509_certificate(Path(env["RAY_TLS_SERVER_CERT"]).read_bytes())
    cert.verify_directly_issued_by(ca.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime >= RAY_LEAF_LIFETIME


def test_a_joined_cluster_without_ray_security_is_said_to_be_open() -> None:
    both = exposure({})
    assert len(both) == 2
    assert "RAY_AUTH_MODE" in both[0] and "run code" in both[0]
    assert "RAY_USE_TLS" in both[1] and "in clear" in both[1]
    assert exposure({"RAY_AUTH_MODE": "token", "RAY_USE_TLS": "1"}) == []
    (tls_off,) = exposure({"RAY_AUTH_MODE": "token"})
    assert "RAY_USE_TLS" in tls_off


@pytest.mark.parametrize("address", ["auto", "ray://head:10001", "head", ""])
def test_the_ray_address_is_a_heads_host_and_port(address: str) -> None:
    assert address_problem(address) is not None
    assert address_problem("10.0.0.5:6379") is None and address_problem("[::1]:6379") is None
