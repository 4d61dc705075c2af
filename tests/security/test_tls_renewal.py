"""Leaf certificates renewed in a running process (issue 33): a server on the process's leaf
presents the renewed one to the next connection and a client reopens its channel with it, so
that a leaf past its end (refused by every TLS handshake) is replaced without a restart; a
worker takes a renewal of its own name only. Real gRPC over 127.0.0.1, in this process."""

from __future__ import annotations

import datetime as dt
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tls_helpers import served_name

from dmsc.runtime.compute.worker import renewed
from dmsc.runtime.transport import tls
from dmsc.runtime.transport.authority import Authority, Leaf, worker_name
from dmsc.runtime.transport.messages import Renew
from dmsc.runtime.transport.rpc import BadRequest, Client, json_handler, serve

CA = Authority.new("test CA")
EXPIRED = dt.timedelta(minutes=-1)  # its end a minute ago (its start is set 5 minutes back)


@pytest.fixture(autouse=True)
def _plain_again() -> Iterator[None]:
    yield
    tls.install(None)


def _echo() -> dict[str, grpc.RpcMethodHandler]:
    return {"Echo": json_handler(lambda d: d)}


def test_a_server_presents_the_renewed_leaf_to_new_connections(tmp_path: Path) -> None:
    tls.install(CA.issue("control", EXPIRED))  # a leaf past its end: no client takes it
    server, port = serve("dmsc.Echo", _echo())
    try:
        client = Client(f"127.0.0.1:{port}", "dmsc.Echo", timeout_s=3, leaf=CA.issue("cli"))
        with pytest.raises(grpc.RpcError) as err:
            client.call("Echo", {"a": 1})
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()
        with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
            served_name(f"127.0.0.1:{port}", CA, tmp_path)
        tls.renew(CA.issue("control"))  # the same server, no restart
        assert served_name(f"127.0.0.1:{port}", CA, tmp_path) == "control"
        client = Client(f"127.0.0.1:{port}", "dmsc.Echo", timeout_s=5, leaf=CA.issue("cli"))
        assert client.call("Echo", {"a": 1}) == {"a": 1}
        client.close()
    finally:
        server.stop(0)


def test_a_client_reopens_its_channel_with_the_renewed_leaf() -> None:
    server, port = serve("dmsc.Echo", _echo(), leaf=CA.issue("control"))
    tls.install(CA.issue("cli", EXPIRED))
    client = Client(f"127.0.0.1:{port}", "dmsc.Echo", timeout_s=3)  # on the process's leaf
    try:
        with pytest.raises(grpc.RpcError) as err:  # the server refuses the expired leaf
            client.call("Echo", {"a": 1})
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tls.renew(CA.issue("cli"))
        assert client.call("Echo", {"a": 2}) == {"a": 2}  # the same client object
    finally:
        client.close()
        server.stop(0)


def test_a_renewal_must_keep_the_name_and_the_authority() -> None:
    tls.install(CA.issue(worker_name("stage0-r0", 2)))
    with pytest.raises(BadRequest, match="names stage1-r0@2, this process stage0-r0@2"):
        renewed(Renew(tls=CA.issue(worker_name("stage1-r0", 2)).wire()))
    with pytest.raises(BadRequest, match="another authority"):
        renewed(Renew(tls=Authority.new("stranger").issue(worker_name("stage0-r0", 2)).wire()))
    fresh = CA.issue(worker_name("stage0-r0", 2))
    assert renewed(Renew(tls=fresh.wire())) == {"ok": True}
    assert tls.current() is not None and tls.current().cert == fresh.cert  # type: ignore[union-attr]
    assert tls.common_name(fresh) == "stage0-r0@2"


def test_the_lifetime_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tls.LIFETIME_ENV, raising=False)
    assert tls.leaf_lifetime() == dt.timedelta(days=7)
    monkeypatch.setenv(tls.LIFETIME_ENV, "90")
    assert tls.leaf_lifetime() == dt.timedelta(seconds=90)
    for bad in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(tls.LIFETIME_ENV, bad)
        with pytest.raises(ValueError, match="DMSC_TLS_LEAF_SECONDS"):
            tls.leaf_lifetime()


def test_leaf_wire_round_trip() -> None:
    leaf = CA.issue("x")
    assert Leaf.from_wire(leaf.wire()) == leaf
