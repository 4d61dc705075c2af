"""A deployment whose leaf certificates live 2 seconds (issue 33), with real worker processes:
renewed every half second, it still opens new connections long after every first leaf ended (and
with the renewal stopped, a worker's served leaf expires: the short lifetime is real); a warm
spare that takes a stage over serves with the stage's ``SID@EPOCH`` leaf, and a leaf in the
spare's own name is refused by the registry and by the worker."""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path

import grpc
import pytest
from tls_helpers import served_name

from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.launch.failures import WorkerFailure
from dmsc.runtime.control.launch.recovery import recover
from dmsc.runtime.control.launch.renewal import renew_all, start_renewal
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.authority import Authority, Leaf
from dmsc.runtime.transport.messages import REGISTRY_SERVICE, STAGE_SERVICE
from dmsc.runtime.transport.rpc import Client
from dmsc.spec import TransformerSpec, resolve_model

pytestmark = pytest.mark.integration

LIFETIME_S = 2.0


def _health(address: str, token: str, leaf: Leaf, service: str = STAGE_SERVICE) -> None:
    client = Client(address, service, timeout_s=5, token=token, leaf=leaf)
    try:
        client.call("Health" if service == STAGE_SERVICE else "Lookup", {})
    finally:
        client.close()


def test_leaves_of_seconds_are_renewed_and_a_spare_takes_its_stages_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls.install_authority(tmp_path)  # a week's leaves while the processes start
    ca = Authority.at(tmp_path / "tls")
    spec = resolve_model("gpt-mini")
    assert isinstance(spec, TransformerSpec)
    layout = StageLayout(spec, [("embedding", "block_1"), ("block_2", "head")])
    stop = threading.Event()
    try:
        with Deployment(layout, home=tmp_path, spares=1, registry_ttl_s=3) as dep:
            monkeypatch.setenv(tls.LIFETIME_ENV, str(LIFETIME_S))
            tls.install_authority(tmp_path)  # same authority, leaves of 2 s from now on
            cli: list[Leaf] = []
            assert renew_all(dep, cli.append) == []  # every leaf replaced by one of 2 s
            start_renewal(dep, stop, cli.append, period_s=0.5)
            time.sleep(LIFETIME_S + 0.5)  # every leaf of the first round has ended
            stage1 = dep.handle((1, 0))
            for h in [*dep.handles, *dep.spares.handles]:
                _health(h.address, dep.token, cli[-1])  # new connections, both ends renewed
            assert served_name(stage1.address, ca, tmp_path) == "stage1-r0@0"

            spare = dep.spares.handles[0]
            spares_leaf = ca.issue(f"{spare.config.sid}@{spare.config.epoch}")
            stage1.process.kill()
            stage1.process.wait(10)
            recover(dep, WorkerFailure({(1, 0): "killed"}, {(1, 0): "stage1-r0"}), None)
            taken = dep.handle((1, 0))
            assert taken.address == spare.address  # the spare, not a new process
            assert served_name(taken.address, ca, tmp_path) == f"stage1-r0@{dep.epoch}"
            assert len(dep.generate([1, 2, 3], 2)) == 2  # stage 0 reaches it: a new connection
            with pytest.raises(grpc.RpcError) as err:  # the spare's own name: retired
                _health(dep.registry_address, dep.token, spares_leaf, REGISTRY_SERVICE)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"{spare.config.sid} at epoch {spare.config.epoch} is fenced" in str(
                err.value.details()
            )
            deadline = time.monotonic() + 5  # the worker learns the floor with a heartbeat
            while True:
                try:
                    _health(taken.address, dep.token, spares_leaf)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
                    break
                assert time.monotonic() < deadline, "the spare's leaf is still served"
                time.sleep(0.2)
            _health(taken.address, dep.token, ca.issue(f"stage1-r0@{dep.epoch}"))

            stop.set()  # a last renewal (a leaf of 2 s), then none: the worker's leaf ends
            assert renew_all(dep) == []
            time.sleep(LIFETIME_S + 0.5)
            with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
                served_name(taken.address, ca, tmp_path)
    finally:
        stop.set()
        tls.install(None)
