"""Load on the gateway: authenticated inference through gateway, router and a 2-stage gpt-mini
pipeline on this machine, beside a trivial authenticated endpoint (the gateway's own overhead),
and the rate limiter under an offered load above its rate.

Closed-loop clients (threads with httpx) for a fixed time. Prints a table, or with --json one
object: per endpoint requests_per_s, p50_ms, p99_ms; rate_limit: configured rate, offered and
admitted rates, and the relative error of the admitted rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(app) -> tuple[uvicorn.Server, str]:  # type: ignore[no-untyped-def]
    port = _port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    from dmsc.runtime.business.gateway import wait_ready

    wait_ready(base)
    return server, base


def _load(
    url: str,
    method: str,
    body: dict | None,
    headers: dict,
    clients: int,  # type: ignore[type-arg]
    seconds: float,
) -> tuple[list[float], list[int]]:
    lat: list[float] = []
    codes: list[int] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = c.request(method, url, json=body, headers=headers)
                with lock:
                    lat.append(time.perf_counter() - t0)
                    codes.append(r.status_code)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    os.environ["DMSC_HOME"] = tempfile.mkdtemp(prefix="dmsc-bench-")
    from dmsc.data.db import Database
    from dmsc.planner.solve import plan_job
    from dmsc.runtime.business.auth import create_key
    from dmsc.runtime.business.gateway import create_app
    from dmsc.runtime.control.plane import ControlPlane
    from dmsc.runtime.control.tasks.task_queue import TaskQueue
    from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

    cluster = load_spec(ClusterSpec, ROOT / "examples" / "clusters" / "local-cpu.yaml")
    plan = plan_job(
        cluster, resolve_model("gpt-mini"), JobSpec(global_batch=8, micro_batch=2, pp=2), fixed=True
    ).plan
    db = Database()
    cp = ControlPlane(plan, db)
    cp.start()
    queue = TaskQueue(db, cp.run.id)
    _, key = create_key(db, "bench", ["infer", "submit", "read"])
    auth = {"Authorization": f"Bearer {key}"}
    results = {}
    try:
        server, base = _serve(create_app(cp, db, queue, rate=1e6, burst=1e6))
        task = queue.submit("train", {"steps": 1}, tenant="bench")
        db.set_task_state(task.id, "cancelled")  # something to read back
        for name, method, path, body in (
            ("infer (1 token, 2 stages)", "POST", "/v1/infer", {"prompt": "def ", "tokens": 1}),
            ("trivial authenticated GET", "GET", f"/v1/tasks/{task.id}", None),
        ):
            lat, codes = _load(base + path, method, body, auth, args.clients, args.seconds)
            ok = [x for x, c in zip(lat, codes, strict=True) if c == 200]
            results[name] = {
                "requests_per_s": len(ok) / args.seconds,
                "p50_ms": float(np.percentile(ok, 50)) * 1e3 if ok else None,
                "p99_ms": float(np.percentile(ok, 99)) * 1e3 if ok else None,
                "errors": len(codes) - len(ok),
            }
        server.should_exit = True
        rate, burst = 50.0, 5.0
        server2, base2 = _serve(create_app(cp, db, queue, rate=rate, burst=burst))
        lat, codes = _load(
            f"{base2}/v1/tasks/{task.id}", "GET", None, auth, args.clients, args.seconds
        )
        admitted = codes.count(200) / args.seconds
        expected = rate + burst / args.seconds  # the saved-up burst is spent once
        results["rate_limit"] = {
            "configured_per_s": rate,
            "burst": burst,
            "offered_per_s": len(codes) / args.seconds,
            "admitted_per_s": admitted,
            "share_429": codes.count(429) / len(codes),
            "admitted_error_pct": (admitted - expected) / expected * 100,
        }
        server2.should_exit = True
    finally:
        cp.deployment.shutdown()
    if args.json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        if name == "rate_limit":
            print(
                f"rate limit {r['configured_per_s']:.0f}/s: offered {r['offered_per_s']:.0f}/s, "
                f"admitted {r['admitted_per_s']:.1f}/s ({r['admitted_error_pct']:+.1f}%), "
                f"{r['share_429'] * 100:.1f}% answered 429"
            )
        else:
            print(
                f"{name:28s} {r['requests_per_s']:7.1f} req/s  p50 {r['p50_ms']:.1f} ms  "
                f"p99 {r['p99_ms']:.1f} ms  errors {r['errors']}"
            )


if __name__ == "__main__":
    main()
