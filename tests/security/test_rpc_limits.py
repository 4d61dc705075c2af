"""Hostile gRPC messages (issue 29, item 13): a call without the credential is refused before its
body is received, and each method takes messages only up to its own limit (a small control call
like ``Status`` cannot make the server hold 200 MB). The server runs in its own process, whose
peak resident memory (``VmHWM``) is read before and after."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dmsc.runtime.transport.rpc import Client

SERVER = textwrap.dedent(
    """
    import sys
    from dmsc.runtime.transport.messages import StatusRequest
    from dmsc.runtime.transport.rpc import bytes_handler, message_handler, serve
    methods = {
        "Status": message_handler(StatusRequest, lambda req: {"ok": True}),
        "Push": bytes_handler(lambda b: str(len(b)).encode()),
    }
    server, port = serve("dmsc.Probe", methods, token="sesame")
    print(port, flush=True)
    sys.stdin.read()
    """
)
BIG = 120 * 1024 * 1024  # each probe's message (the attacker's was 200 MB)


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def probe() -> Iterator[tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_call_without_the_credential_is_refused_before_its_body_is_read(probe) -> None:  # type: ignore[no-untyped-def]
    address, pid = probe
    intruder = Client(address, "dmsc.Probe", timeout_s=60)
    before = _peak_mb(pid)
    big = b"x" * BIG
    for method in ("Push", "Status", "Push"):
        with pytest.raises(grpc.RpcError) as err:
            intruder.raw(method, big)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    grown = _peak_mb(pid) - before
    print(f"server peak RSS grew {grown:.0f} MB after 3 unauthenticated {BIG >> 20} MB messages")
    assert grown < 40, f"the server held {grown:.0f} MB of messages it should have refused"
    # the credential holder is still served
    owner = Client(address, "dmsc.Probe", timeout_s=60, token="sesame")
    assert owner.call("Status") == {"ok": True}
    assert owner.raw("Push", b"abc") == b"3"
    intruder.close()
    owner.close()


def test_each_method_takes_messages_up_to_its_own_limit(probe) -> None:  # type: ignore[no-untyped-def]
    address, pid = probe
    owner = Client(address, "dmsc.Probe", timeout_s=60, token="sesame")
    before = _peak_mb(pid)
    with pytest.raises(grpc.RpcError) as err:
        owner.raw("Status", b" " * BIG)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{1 << 20:,} bytes at most" in (err.value.details() or "")
    grown = _peak_mb(pid) - before
    print(f"server peak RSS grew {grown:.0f} MB after an authenticated {BIG >> 20} MB Status")
    assert grown < 40, f"a Status call made the server hold {grown:.0f} MB"
    # a data-plane method takes a large frame, sent in pieces and received whole
    assert owner.raw("Push", b"y" * (40 << 20)) == str(40 << 20).encode()
    assert owner.call("Status") == {"ok": True}
    owner.close()
