"""``dmsc infer`` streamed (issue 12, item 3): the control plane's InferStream sends the text as
it is drawn, the same text Infer gives for the same seed, and a client that cancels stops the
generation at the next token, freeing the replica."""

from __future__ import annotations

import time
from pathlib import Path

from runtime_helpers import control_plane, local_plan, wait_for

from dmsc.runtime.transport.messages import CONTROL_SERVICE, InferRequest
from dmsc.runtime.transport.rpc import Client, serve


def test_infer_streams_its_text_and_a_cancel_stops_it(tmp_path: Path) -> None:
    with control_plane(local_plan(), tmp_path) as cp:
        server, port = serve(CONTROL_SERVICE, cp.methods())
        client = Client(f"127.0.0.1:{port}", CONTROL_SERVICE, timeout_s=60)
        try:
            req = InferRequest(prompt="def ", tokens=24, temperature=1.5, seed=3)
            *pieces, last = list(client.stream("InferStream", req))
            assert last["done"] and last["seed"] == 3 and last["replica"] == "replica-0"
            assert len(pieces) > 3  # piece by piece, as drawn
            text = "".join(p["text"] for p in pieces)
            assert client.send("Infer", req)["text"] == text  # the same seed, the same text
            assert client.send("Infer", req.model_copy(update={"seed": 4}))["text"] != text
            unseeded = client.send("Infer", InferRequest(prompt="def ", tokens=2))
            assert isinstance(unseeded["seed"], int)  # a fresh seed, said so it can be repeated

            call = client.stream("InferStream", InferRequest(prompt="def ", tokens=1000))
            next(call)
            call.cancel()
            stream_task = max(t.id for t in cp.db.tasks(cp.run.id))
            wait_for(lambda: cp.db.tasks(cp.run.id)[-1].state == "cancelled", 10, "task cancelled")
            assert cp.db.tasks(cp.run.id)[-1].id == stream_task
            t0 = time.monotonic()
            assert len(client.send("Infer", InferRequest(prompt="x", tokens=2))["text"]) >= 1
            assert time.monotonic() - t0 < 5  # the replica is free again
        finally:
            client.close()
            server.stop(grace=0)
