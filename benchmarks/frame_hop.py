"""A pipeline frame's way to a waiting stage: what one hop costs, hot and after an idle spell.

A stage that waits for its neighbour's activation or gradient sits idle (its threads asleep)
until the frame lands in its inbox. This measures that one-way hop three ways, in one run:

- ``grpc``: the runtime's own path in one process: the frame encoded
  (:func:`dmsc.runtime.transport.wire.encode`), sent as a ``Push`` on a pooled call thread
  (:meth:`~dmsc.runtime.transport.rpc.Client.raw_pooled`), decoded, checked for finite values
  and put into an :class:`~dmsc.runtime.compute.inbox.Inbox` by the server's handler, the
  waiting thread woken; split into its parts (to the call thread, gRPC to the handler, the
  handler's decode, check and put, the wake);
- ``tcp``: the same frame over a plain loopback TCP socket, handed to a sender thread and read
  by a receiver thread that wakes the waiting one (the same three thread hand-offs, no gRPC):
  what the machine's wake-ups cost alone;
- ``deployment``: a gpt-mini pp = 2 deployment (two micro-batches, 1F1B) as the benchmarks run
  it, its frames over gRPC ``Push`` (as until 2026-12-04) and over the TCP streams
  (:mod:`dmsc.runtime.compute.pipe_stream`, the default since): from the end of stage 0's
  first forward to the start of stage 1's (the activation's hop, stage 1 idle), and from the
  end of stage 1's last backward to the start of stage 0's (the gradient's, stage 0 idle), from
  the steps' spans on this machine's clock; beside them the cost model's price of one such
  frame on this machine as ``dmsc calibrate`` measures it.

Each size is timed back to back (``hot``) and after ``--idle`` ms of sleep before each frame,
as a stage waits through its neighbour's compute; beside each, the CPU a frame cost both ends
(one process holds both). Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dmsc.runtime.compute.frames import finite
from dmsc.runtime.compute.inbox import Inbox
from dmsc.runtime.transport.calls import PooledCall
from dmsc.runtime.transport.rpc import Client, bytes_handler, serve
from dmsc.runtime.transport.wire import Kind, decode, encode

SIZES = (16, 262_144, 1_048_576)  # bytes of payload; gpt-mini's micro-batch of 4: 262,144
ROUNDS = 60


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


class GrpcHop:
    """The runtime's path, its parts stamped: encode, call thread, gRPC, handler, wake."""

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.stamps: dict[str, float] = {}
        self.server, port = serve("dmsc.Hop", {"Push": bytes_handler(self._push)})
        self.client = Client(f"127.0.0.1:{port}", "dmsc.Hop")

    def _push(self, data: bytes) -> bytes:
        self.stamps["handler"] = time.perf_counter()
        f = decode(data)
        if not finite(f.tensor):
            raise ValueError("not finite")
        self.inbox.put(f.kind, f.step, f.microbatch, f.tensor, f.epoch)
        self.stamps["put"] = time.perf_counter()
        return b""

    def hop(self, step: int, x: torch.Tensor) -> dict[str, float]:
        t0 = time.perf_counter()
        frame = encode(Kind.ACTIVATION, step, 0, x, 0)

        def call() -> bytes:
            self.stamps["call"] = time.perf_counter()
            return self.client.raw("Push", frame)

        fut = PooledCall(call)
        self.inbox.get(Kind.ACTIVATION, step, 0, 10.0)
        t1 = time.perf_counter()
        fut.result()
        s = self.stamps
        return {
            "total": t1 - t0,
            "to_call_thread": s["call"] - t0,
            "grpc_to_handler": s["handler"] - s["call"],
            "decode_check_put": s["put"] - s["handler"],
            "wake": t1 - s["put"],
        }

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=0)


class TcpHop:
    """The same frame over a loopback socket: a sender thread, a receiver thread, a wake."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.got = threading.Event()
        self.todo: list[bytes] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.sock = socket.create_connection(self.srv.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        conn, _ = self.srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            n, buf, done = int.from_bytes(head, "big"), bytearray(), 0
            buf = bytearray(n)
            view = memoryview(buf)
            while done < n:
                done += conn.recv_into(view[done:])
            decode(bytes(buf))
            self.got.set()

    def _write(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.todo)
                frame = self.todo.pop()
            self.sock.sendall(len(frame).to_bytes(8, "big") + frame)

    def hop(self, step: int, x: torch.Tensor) -> dict[str, float]:
        self.got.clear()
        t0 = time.perf_counter()
        frame = encode(Kind.ACTIVATION, step, 0, x, 0)
        with self.cv:
            self.todo.append(frame)
            self.cv.notify()
        self.got.wait(10.0)
        return {"total": time.perf_counter() - t0}

    def close(self) -> None:
        self.sock.close()
        self.srv.close()


def timed(hop: Callable[[int, torch.Tensor], dict[str, float]], idle_s: float) -> dict[str, Any]:
    """Each size's median parts (ms) over :data:`ROUNDS` frames, after a warm-up, and the
    CPU a frame cost this process, both ends (``cpu_ms``, the mean; asleep costs none)."""
    out: dict[str, Any] = {}
    step = 0
    for size in SIZES:
        x = torch.randn(max(1, size // 4))
        rows, cpu = [], 0.0
        for i in range(ROUNDS + 10):
            step += 1
            if idle_s:
                time.sleep(idle_s)
            c0 = time.process_time()
            r = hop(step, x)
            if i >= 10:
                rows.append(r)
                cpu += time.process_time() - c0
        out[str(size)] = {k: _median_ms([r[k] for r in rows]) for k in rows[0]}
        out[str(size)]["cpu_ms"] = cpu / ROUNDS * 1e3
    return out


def deployment_hops(steps: int, stream: bool) -> dict[str, Any]:
    """The activation's and the gradient's hop in a gpt-mini pp = 2 deployment (module
    docstring), its frames over the TCP streams (``stream``, the default) or gRPC, the median
    over the steps past the first four."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parallel_modes as pm

    spec = pm._spec()
    corpus = pm._corpus(spec)
    forward, backward, nbytes = [], [], 0
    with pm.Deployment(pm.StageLayout(spec, pm.TWO, pp_stream=stream)) as dep:
        for s in range(steps):
            out = dep.train_step(s, *corpus.batch(s, pm.BATCH), 2, "1f1b")
            if s < 4:
                continue
            spans = {
                k[0]: {(op, mb): (a, b) for op, mb, a, b in v[0]} for k, v in out["traces"].items()
            }
            s0, s1 = spans[0], spans[1]
            forward.append(s1[("F", 0)][0] - s0[("F", 0)][1])
            backward.append(s0[("B", 1)][0] - max(s1[("B", 1)][1], s0[("B", 0)][1]))
            nbytes = max(nbytes, *(v[1].get("1/0", 0) for v in out["traces"].values()))
    return {
        "steps": len(forward),
        "activation_hop_ms": _median_ms(forward),
        "gradient_hop_ms": _median_ms(backward),
        "frames_bytes_a_step": nbytes,
    }


def priced_hop_ms(payload: int) -> dict[str, float]:
    """The cost model's price of one pipeline frame of ``payload`` bytes between two devices
    of this machine as ``dmsc calibrate`` measures it (its loopback latency and rate)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import parallel_modes as pm

    from dmsc.netmodel import DEFAULT_CALIBRATION, CommModel
    from dmsc.netmodel.topology import Topology

    with tempfile.TemporaryDirectory() as home:
        cluster = pm.calibrated_spec(Path(home))
    comm = CommModel(Topology(cluster), DEFAULT_CALIBRATION)
    return {"priced_ms": comm.p2p([(0, 1)], float(payload)).time_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=20.0, help="ms of sleep before each frame")
    ap.add_argument("--steps", type=int, default=20, help="steps of the pp = 2 deployment")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    grpc_hop, tcp_hop = GrpcHop(), TcpHop()
    try:
        result: dict[str, Any] = {
            "command": "python benchmarks/frame_hop.py --json",
            "idle_ms": args.idle,
            "grpc": {"hot": timed(grpc_hop.hop, 0.0), "idle": timed(grpc_hop.hop, args.idle / 1e3)},
            "tcp": {"hot": timed(tcp_hop.hop, 0.0), "idle": timed(tcp_hop.hop, args.idle / 1e3)},
        }
    finally:
        grpc_hop.close()
        tcp_hop.close()
    result["deployment"] = {  # gRPC, then the streams a deployment uses by default
        "grpc": deployment_hops(args.steps, stream=False),
        "stream": deployment_hops(args.steps, stream=True),
    } | priced_hop_ms(262_144)
    result["load_average_1min"] = [load, os.getloadavg()[0]]
    if args.json:
        print(json.dumps(result))
        return
    print(f"one-way frame hop, ms (median of {ROUNDS}); idle: {args.idle:g} ms asleep before each")
    print(
        f"{'payload':>9s} {'gRPC hot':>9s} {'gRPC idle':>10s} {'TCP hot':>8s} {'TCP idle':>9s}"
        f" {'CPU gRPC':>9s} {'CPU TCP':>8s}"
    )
    for size in SIZES:
        g, t = result["grpc"], result["tcp"]
        print(
            f"{size:9d} {g['hot'][str(size)]['total']:9.3f} {g['idle'][str(size)]['total']:10.3f}"
            f" {t['hot'][str(size)]['total']:8.3f} {t['idle'][str(size)]['total']:9.3f}"
            f" {g['idle'][str(size)]['cpu_ms']:9.3f} {t['idle'][str(size)]['cpu_ms']:8.3f}"
        )
    parts = result["grpc"]["idle"][str(SIZES[1])]
    print(
        f"gRPC idle, {SIZES[1]} B: "
        + ", ".join(f"{k} {v:.3f}" for k, v in parts.items() if k != "total")
    )
    d = result["deployment"]
    for via in ("grpc", "stream"):
        print(
            f"pp = 2 deployment over {via}: activation hop {d[via]['activation_hop_ms']:.2f} ms, "
            f"gradient hop {d[via]['gradient_hop_ms']:.2f} ms"
        )
    print(f"the cost model prices one such frame at {d['priced_ms']:.2f} ms")


if __name__ == "__main__":
    main()
