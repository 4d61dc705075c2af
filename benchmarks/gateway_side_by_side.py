"""The gateway's own overhead, side by side in one run: a bare FastAPI endpoint, dmsc's
unauthenticated ``/v1/health`` and an authenticated read (``/v1/models``), each served by
uvicorn with the same settings and loaded by wrk (16 connections, one wrk thread) from another
process. With taskset (util-linux) both servers run on CPU 1 and wrk on CPU 0.

The dmsc gateway is the real one: ``dmsc up --gateway`` on a gpt-mini pp=2 plan in a
temporary home, with a key made by ``dmsc token create`` and a rate limit the load cannot reach
(``--rate 1e6``: the gateway's work is measured, not its 429 answers). The bare app runs
in a process of its own (``--serve-bare PORT``), as the gateway does inside the control
plane's process.

wrk comes from the system's packages (Debian: ``apt-get install wrk``); without it the program
says so and exits 2. With ``--tls`` a second deployment (a home of its own) serves its gateway
over HTTPS (``dmsc up --tls``, a self-signed certificate), and its two targets join the same
interleaved rounds: the cost of TLS side by side (``ratio_to_plain``: requests/s over the same
route's over plain HTTP). Prints a table, or with --json one object: per target requests_per_s,
latency p50/p99 in ms, non-2xx answers, ``ratio_to_bare`` (requests/s over the bare
endpoint's, measured in the same run) and ``server_cpu_us_per_request`` (the serving process's
CPU time over the requests answered, the median of the rounds; with ``--tls``,
``cpu_ratio_to_plain`` is plain's over HTTPS's: the requests/s one core serves, which other
jobs on a shared machine move far less than they move requests/s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {timeout_s:g} s")


def serve_bare(port: int) -> None:
    """The reference: FastAPI's smallest JSON endpoint under uvicorn's defaults."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (with util-linux's taskset; a no-op without it)."""
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], capture_output=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds so far of the process ``pid`` (all its threads)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def wrk(
    url: str, seconds: float, connections: int, header: str | None = None, pid: int | None = None
) -> dict[str, float]:
    """One wrk run; with ``pid``, also the server process's CPU microseconds per request."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", url]
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:  # the load on its own CPU
        cmd = ["taskset", "-c", "0", *cmd]
    if header:
        cmd += ["-H", header]
    cpu0 = _cpu_s(pid) if pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = _cpu_s(pid) - cpu0 if pid else 0.0
    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "requests_per_s": rps,
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": errors.group(1) if errors else "",  # type: ignore[dict-item]
        "server_cpu_us_per_request": 1e6 * cpu / done if pid and done else None,  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="Each target this many times.")
    parser.add_argument("--tls", action="store_true", help="Also the gateway over HTTPS.")
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(args.serve_bare)
        return
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        raise SystemExit(2)
    home = Path(tempfile.mkdtemp(prefix="dmsc-gw-bench-"))
    tls_home = Path(tempfile.mkdtemp(prefix="dmsc-gw-bench-tls-"))
    env = {**os.environ, "DMSC_HOME": str(home)}
    tls_env = {**os.environ, "DMSC_HOME": str(tls_home)}
    dmsc = [sys.executable, "-m", "dmsc"]

    def run(*a: str, where: dict[str, str] = env) -> str:
        res = subprocess.run([*dmsc, *a], env=where, capture_output=True, text=True, timeout=600)
        if res.returncode:
            raise SystemExit(f"dmsc {' '.join(a)} failed: {res.stderr}")
        return res.stdout

    plan = home / "plan.json"
    cluster = ROOT / "examples/clusters/local-cpu.yaml"
    run(
        *("plan", "--cluster", str(cluster), "--model", "gpt-mini", "--global-batch", "8"),
        *("--micro-batch", "2", "--tp", "1", "--pp", "2", "--dp", "1", "--out", str(plan)),
    )
    gport, bport, tport = _port(), _port(), _port()
    bare = subprocess.Popen([sys.executable, __file__, "--serve-bare", str(bport)])
    try:
        # A rate limit the load cannot reach: the gateway's work is measured, not its 429s.
        run("up", "--plan", str(plan), "--gateway", f"127.0.0.1:{gport}", "--rate", "1e6")
        key = run("token", "create", "--tenant", "bench", "--scopes", "read").strip()
        tls_key = ""
        if args.tls:
            gw = ("--gateway", f"127.0.0.1:{tport}", "--tls", "--rate", "1e6")
            run("up", "--plan", str(plan), *gw, where=tls_env)
            tls_key = run("token", "create", "--tenant", "bench", "--scopes", "read", where=tls_env)
        _wait(f"http://127.0.0.1:{bport}/ping")
        _wait(f"http://127.0.0.1:{gport}/v1/health")
        # Both servers on CPU 1, wrk on CPU 0: each server has one core, as uvicorn uses one,
        # and the load generator does not compete with it (far less noise on a 2-core machine).
        control = json.loads((home / "control.json").read_text())["pid"]
        _pin(bare.pid, 1)
        _pin(control, 1)
        tls_control = 0
        if args.tls:
            tls_control = json.loads((tls_home / "control.json").read_text())["pid"]
            _pin(tls_control, 1)
        targets = {
            "bare FastAPI GET /ping": (f"http://127.0.0.1:{bport}/ping", None, bare.pid),
            "dmsc GET /v1/health": (f"http://127.0.0.1:{gport}/v1/health", None, control),
            "dmsc GET /v1/models (key)": (
                f"http://127.0.0.1:{gport}/v1/models",
                f"Authorization: Bearer {key}",
                control,
            ),
        }
        if args.tls:
            targets["dmsc GET /v1/health (https)"] = (
                f"https://127.0.0.1:{tport}/v1/health",
                None,
                tls_control,
            )
            targets["dmsc GET /v1/models (key, https)"] = (
                f"https://127.0.0.1:{tport}/v1/models",
                f"Authorization: Bearer {tls_key.strip()}",
                tls_control,
            )
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
        for _ in range(args.rounds):  # interleaved, so drift hits all targets alike
            for name, (url, header, pid) in targets.items():
                runs[name].append(wrk(url, args.seconds, args.connections, header, pid))
    finally:
        bare.terminate()
        subprocess.run([*dmsc, "down"], env=env, capture_output=True, timeout=120)
        if args.tls:
            subprocess.run([*dmsc, "down"], env=tls_env, capture_output=True, timeout=120)
    results: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["requests_per_s"])
        cpu = sorted(r["server_cpu_us_per_request"] for r in rs)
        results[name] = {
            **best,
            "all_requests_per_s": [r["requests_per_s"] for r in rs],  # type: ignore[dict-item]
            # the median over the rounds: CPU per request varies far less with the machine's
            # other load than requests/s does
            "server_cpu_us_per_request": cpu[len(cpu) // 2],
        }
    bare_rps = results["bare FastAPI GET /ping"]["requests_per_s"]
    for r in results.values():
        r["ratio_to_bare"] = r["requests_per_s"] / bare_rps
    for name, r in results.items():  # over HTTPS against the same route over plain HTTP
        if name.endswith("https)"):
            plain = results[name.replace(", https)", ")").replace(" (https)", "")]
            r["ratio_to_plain"] = r["requests_per_s"] / plain["requests_per_s"]
            # plain's CPU per request over HTTPS's: the requests/s one core would serve
            r["cpu_ratio_to_plain"] = (
                plain["server_cpu_us_per_request"] / r["server_cpu_us_per_request"]
            )
    out = {"connections": args.connections, "seconds": args.seconds, "targets": results}
    if args.json:
        print(json.dumps(out))
        return
    print(f"wrk, {args.connections} connections, {args.seconds:g} s each, best of {args.rounds}")
    for name, r in results.items():
        cpu = r.get("cpu_ratio_to_plain")
        print(
            f"{name:28s} {r['requests_per_s']:8.0f} req/s  x{r['ratio_to_bare']:.2f} of bare  "
            f"p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms  non-2xx {r['non_2xx']}  "
            f"server CPU {r['server_cpu_us_per_request']:.0f} us/request"
            + (f"  x{cpu:.3f} of plain (CPU)" if cpu is not None else "")
        )


if __name__ == "__main__":
    main()
