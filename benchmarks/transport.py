"""The data plane (gRPC frames, as stage workers exchange activations) against a raw loopback
TCP socket, side by side: throughput of activation-sized transfers and small-message round trip.

With ``--tls`` the same gRPC frames also go over mutual TLS (certificates of a throwaway
authority, as ``dmsc up`` gives every service), measured in the same loop: ``tls_mb_s`` and
``tls_ratio`` (TLS throughput over plain), and the small-message round trip over TLS.

Beside each size, the time to encode its frame (``encode_us``,
:func:`dmsc.runtime.transport.wire.encode`) against the frame built as it was until 2026-12-04
(``two_copies_us``: the payload's bytes, then the header and those bytes joined, two copies of
the payload).

Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import threading

import torch

from dmsc.runtime.compute.host_rates import median_seconds
from dmsc.runtime.transport import wire
from dmsc.runtime.transport.rpc import Client, bytes_handler, serve
from dmsc.runtime.transport.wire import Kind, decode, encode


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def tcp_server() -> tuple[socket.socket, int]:
    """Length-prefixed frames; replies with a 1-byte ack."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def run() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                n = int.from_bytes(_recv_exact(conn, 8), "big")
                _recv_exact(conn, n)
                conn.sendall(b"k")
        except ConnectionError:
            conn.close()

    threading.Thread(target=run, daemon=True).start()
    return srv, srv.getsockname()[1]


def two_copies(tensor: torch.Tensor) -> bytes:
    """A frame of ``tensor`` (float32) as it was built until 2026-12-04, the reference of
    ``encode_us``: the payload's bytes first, then the header and the bytes concatenated."""
    raw = tensor.numpy().tobytes()
    head = wire._HEAD.pack(wire.MAGIC, wire.VERSION, 1, 1, tensor.dim(), 0, 0, 0, len(raw))
    return head + struct.pack(f"!{tensor.dim()}I", *tensor.shape) + raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tls", action="store_true", help="Also gRPC over mutual TLS.")
    args = parser.parse_args()
    methods = {"Push": bytes_handler(lambda b: (decode(b), b"")[1])}
    server, port = serve("dmsc.Bench", methods)
    grpc_client = Client(f"127.0.0.1:{port}", "dmsc.Bench")
    tls_client = None
    if args.tls:
        from dmsc.runtime.transport.authority import Authority

        ca = Authority.new("bench CA")
        tls_server, tls_port = serve("dmsc.Bench", methods, leaf=ca.issue("control"))
        tls_client = Client(f"127.0.0.1:{tls_port}", "dmsc.Bench", leaf=ca.issue("w@0"))
    srv, tport = tcp_server()
    sock = socket.create_connection(("127.0.0.1", tport))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_send(data: bytes) -> None:
        sock.sendall(len(data).to_bytes(8, "big") + data)
        _recv_exact(sock, 1)

    rows = []
    for mb in (0.064, 1.0, 4.0, 16.0):
        tensor = torch.zeros(int(mb * 1e6 / 4), dtype=torch.float32)
        frame = encode(Kind.ACTIVATION, 0, 0, tensor)
        t_grpc = median_seconds(lambda f=frame: grpc_client.raw("Push", f), 20)
        t_tcp = median_seconds(lambda f=frame: tcp_send(f), 20)
        t_encode = median_seconds(lambda t=tensor: encode(Kind.ACTIVATION, 0, 0, t), 20)
        t_two = median_seconds(lambda t=tensor: two_copies(t), 20)
        row = {
            "mb": mb,
            "encode_us": t_encode * 1e6,
            "two_copies_us": t_two * 1e6,
            "dmsc_mb_s": len(frame) / t_grpc / 1e6,
            "tcp_mb_s": len(frame) / t_tcp / 1e6,
            "ratio": t_tcp / t_grpc,
        }
        if tls_client is not None:
            t_tls = median_seconds(lambda f=frame: tls_client.raw("Push", f), 20)  # type: ignore[misc]
            row |= {"tls_mb_s": len(frame) / t_tls / 1e6, "tls_ratio": t_grpc / t_tls}
        rows.append(row)
    small = encode(Kind.ACTIVATION, 0, 0, torch.zeros(1))
    rtt_grpc = median_seconds(lambda: grpc_client.raw("Push", small), 300)
    rtt_tcp = median_seconds(lambda: tcp_send(small), 300)
    out = {"throughput": rows, "small_rtt_us": {"dmsc": rtt_grpc * 1e6, "tcp": rtt_tcp * 1e6}}
    if tls_client is not None:
        rtt_tls = median_seconds(lambda: tls_client.raw("Push", small), 300)  # type: ignore[union-attr]
        out["small_rtt_us"]["dmsc_tls"] = rtt_tls * 1e6
        tls_client.close()
        tls_server.stop(grace=0)
    sock.close()
    srv.close()
    grpc_client.close()
    server.stop(grace=0)
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{'size':>8s} {'dmsc (gRPC) MB/s':>18s} {'raw TCP MB/s':>14s} {'dmsc/tcp':>9s} "
        f"{'encode us':>10s} {'2 copies us':>12s}"
    )
    for r in rows:
        print(
            f"{r['mb']:7.3f}M {r['dmsc_mb_s']:18.0f} {r['tcp_mb_s']:14.0f} {r['ratio']:9.2f} "
            f"{r['encode_us']:10.0f} {r['two_copies_us']:12.0f}"
        )
    print(f"small-message round trip: dmsc {rtt_grpc * 1e6:.0f} us, raw TCP {rtt_tcp * 1e6:.0f} us")
    for r in rows:
        if "tls_ratio" in r:
            print(
                f"{r['mb']:7.3f}M over mutual TLS: {r['tls_mb_s']:.0f} MB/s, x{r['tls_ratio']:.2f}"
            )


if __name__ == "__main__":
    main()
