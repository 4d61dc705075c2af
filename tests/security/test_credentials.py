"""The control service and the deployment's secrets (issue 11, item 2): no call without the
credential, credentials in owner-only files that do not outlive their use."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import grpc
import pytest
from runtime_helpers import dmsc, make_plan

from dmsc.runtime.transport.messages import CONTROL_SERVICE
from dmsc.runtime.transport.rpc import Client

pytestmark = pytest.mark.integration


def test_control_calls_need_the_credential_and_secrets_stay_private(tmp_path: Path) -> None:
    plan = make_plan(tmp_path)
    res = dmsc(tmp_path, "up", "--plan", str(plan))
    assert res.returncode == 0, res.stderr
    try:
        control = tmp_path / "control.json"
        assert stat.S_IMODE(control.stat().st_mode) == 0o600
        info = json.loads(control.read_text())
        for token in (None, "guessed"):
            intruder = Client(info["address"], CONTROL_SERVICE, timeout_s=10, token=token)
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
    the cache entry, so the next request is refused (not a second later)."""
    import re

    import httpx
    from runtime_helpers import up_with_gateway

    base = up_with_gateway(tmp_path, make_plan(tmp_path))
    try:
        made = dmsc(tmp_path, "token", "create", "--tenant", "t", "--scopes", "read")
        key_id = re.search(r"key (\d+)", made.stderr).group(1)  # type: ignore[union-attr]
        h = {"Authorization": f"Bearer {made.stdout.strip()}"}
        with httpx.Client(timeout=10) as c:
            assert c.get(f"{base}/v1/models", headers=h).status_code == 200  # now cached
            assert dmsc(tmp_path, "token", "revoke", key_id).returncode == 0
            assert c.get(f"{base}/v1/models", headers=h).status_code == 401
        bad = dmsc(tmp_path, "token", "revoke", "999")
        assert bad.returncode == 2 and "no key 999" in bad.stderr
    finally:
        assert dmsc(tmp_path, "down").returncode == 0
