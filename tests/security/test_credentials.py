"""The control service and the deployment's secrets (issue 11, item 2): no call without the
credential, credentials in owner-only files that do not outlive their use."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import grpc
import pytest
from runtime_helpers import dmsc, make_plan

from dmsc.runtime.transport.authority import Authority, Leaf
from dmsc.runtime.transport.messages import CONTROL_SERVICE, STAGE_SERVICE
from dmsc.runtime.transport.rpc import Client

pytestmark = pytest.mark.integration


def test_control_calls_need_the_credential_and_secrets_stay_private(tmp_path: Path) -> None:
    """Every service is mutual TLS under the home's authority (its key 0600): a caller without a
    certificate, or with another authority's, is refused by the control plane and the workers;
    one with the CLI's certificate still needs the credential."""
    plan = make_plan(tmp_path)
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        control = tmp_path / "control.json"
        assert stat.S_IMODE(control.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "tls" / "ca.key").stat().st_mode) == 0o600
        info = json.loads(control.read_text())
        cli = Leaf.from_wire(info["tls"])
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        workers = [s["address"] for s in status["services"]]
        stranger = Authority.new("another CA").issue("cli")
        for address, service, method in [
            (info["address"], CONTROL_SERVICE, "Status"),
            *((w, STAGE_SERVICE, "Health") for w in workers),
        ]:
            for leaf in (None, stranger):  # no certificate, another authority's: no handshake
                intruder = Client(address, service, timeout_s=10, token=info["token"], leaf=leaf)
                with pytest.raises(grpc.RpcError) as err:
                    intruder.call(method)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                intruder.close()
        for token in (None, "guessed"):  # a certificate of the home's authority, no credential
            intruder = Client(info["address"], CONTROL_SERVICE, timeout_s=10, token=token, leaf=cli)
            for method in ("Status", "Down", "Infer", "Train", "Inject"):
                with pytest.raises(grpc.RpcError) as err:
                    intruder.call(method, {"prompt": "x"} if method == "Infer" else {})
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            intruder.close()
        # Still up, and the worker configs (they carry the service credential) are gone.
        status = json.loads(dmsc(tmp_path, "status", "--json").stdout)
        assert all(s["health"] == "ok" for s in status["services"])
        assert not list((tmp_path / "workers").glob("*.json"))
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
    assert not (tmp_path / "control.json").exists()


def test_a_key_revoked_with_dmsc_token_revoke_is_refused_at_once(tmp_path: Path) -> None:
    """The gateway caches principals; a revocation through the running control plane empties
    the cache entry, so the next request is refused (not a second later). The gateway is served
    over HTTPS (``--tls``): the certificate it serves is the one ``dmsc up`` printed."""
    import hashlib
    import re
    import socket
    import ssl

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = str(make_plan(tmp_path))
    up = dmsc(tmp_path, "up", "--plan", plan, "--gateway", f"127.0.0.1:{port}", "--tls")
    assert up.returncode == 0, up.stderr
    base = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(tmp_path / "tls" / "gateway.pem"))
    try:
        assert f"gateway {base}" in up.stdout
        printed = re.search(r"SHA-256 ([0-9A-F:]{95})", up.stdout).group(1)  # type: ignore[union-attr]

        def served() -> str:
            der = ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", port)))
            return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())

        assert served() == printed  # the gateway serves before dmsc up returns
        made = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "read")
        key_id = re.search(r"key (\d+)", made.stderr).group(1)  # type: ignore[union-attr]
        h = {"Authorization": f"Bearer {made.stdout.strip()}"}
        with httpx.Client(timeout=10, verify=trust) as c:
            assert c.get(f"{base}/v1/models", headers=h).status_code == 200  # now cached
            assert dmsc(tmp_path, "token", "revoke", key_id).returncode == 0
            assert c.get(f"{base}/v1/models", headers=h).status_code == 401
        bad = dmsc(tmp_path, "token", "revoke", "999")
        assert bad.returncode == 2 and "no key 999" in bad.stderr
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
