"""One tenant attacks inside its rate limit; does another tenant still get served?

The issue's starvation scenario, through the real stack: ``dmsc up --gateway`` with a gpt-mini
pp=2 x dp=2 plan on this machine, two tenants with keys from ``dmsc token create``. The attacker
keeps ``--attackers`` requests of 1,024 tokens in flight (its burst is 40: all fit its rate
limit); the victim sends 4-token requests one after another before, during and after the attack.

Prints a table, or with --json one object: the victim's latency (p50, p99, max, errors) before,
during and after the attack, the attacker's answers by status, and ``normal_after_s``: seconds
from the attack's end until the victim's latency is back under twice its median before.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from _deployment import free_port, home_and_dmsc, two_by_two_plan

ROOT = Path(__file__).resolve().parents[1]
TENANTS = ("mallory", "alice")  # the attacker, the victim


def _summary(lat: list[float], errors: int) -> dict[str, float | int | None]:
    if not lat:
        return {"requests": 0, "errors": errors, "p50_s": None, "p99_s": None, "max_s": None}
    return {
        "requests": len(lat),
        "errors": errors,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "max_s": float(max(lat)),
    }


def attack(base: str, authorization: str, clients: int) -> None:
    """``clients`` threads sending 1,024-token requests until SIGINT; prints the answers' codes
    as JSON."""
    codes: Counter[int] = Counter()
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                try:
                    r = c.post(
                        f"{base}/v1/infer",
                        json={"prompt": "x" * 64, "tokens": 1024},
                        headers={"Authorization": authorization},
                    )
                    codes[r.status_code] += 1
                    if r.status_code == 429:
                        time.sleep(float(r.headers.get("retry-after", "1")))
                except httpx.HTTPError:
                    codes[0] += 1

    for _ in range(clients):
        threading.Thread(target=loop, daemon=True).start()
    try:
        while True:
            time.sleep(0.2)
    except KeyboardInterrupt:
        print(json.dumps({str(k): n for k, n in sorted(codes.items())}), flush=True)
        os._exit(0)  # the threads' requests in flight are dropped with their connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attack", nargs=3, metavar=("URL", "AUTH", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--attack-s", type=float, default=30.0)
    parser.add_argument("--attackers", type=int, default=40)
    parser.add_argument("--quiet-s", type=float, default=10.0, help="Before and after the attack.")
    args = parser.parse_args()
    if args.attack:
        attack(args.attack[0], args.attack[1], int(args.attack[2]))
        return
    home, dmsc = home_and_dmsc("dmsc-tenants-")
    plan = two_by_two_plan(home, dmsc)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    dmsc("up", "--plan", str(plan), "--gateway", f"127.0.0.1:{port}")
    try:
        keys = {t: dmsc("token", "create", "--tenant", t, "--scopes", "infer") for t in TENANTS}
        attacker = {"Authorization": f"Bearer {keys['mallory']}"}
        victim = {"Authorization": f"Bearer {keys['alice']}"}
        phases: dict[str, tuple[list[float], list[int]]] = {
            p: ([], []) for p in ("before", "during", "after")
        }
        phase = ["before"]
        after_log: list[tuple[float, float]] = []  # (since the attack ended, latency)
        stop_victim = threading.Event()
        attack_end = [0.0]

        def victim_loop() -> None:
            with httpx.Client(timeout=120) as c:
                while not stop_victim.is_set():
                    t0 = time.perf_counter()
                    try:
                        r = c.post(
                            f"{base}/v1/infer", json={"prompt": "def ", "tokens": 4}, headers=victim
                        )
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    dt = time.perf_counter() - t0
                    lat, errs = phases[phase[0]]
                    (lat if ok else errs).append(dt if ok else 1)
                    if phase[0] == "after" and ok:
                        after_log.append((time.monotonic() - attack_end[0], dt))
                    time.sleep(0.05)

        v = threading.Thread(target=victim_loop)
        v.start()
        time.sleep(args.quiet_s)
        phase[0] = "during"
        # The attacker is a process of its own: the attack ends when it is killed, its
        # connections closing as a real client's would.
        attacking = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--attack",
                base,
                attacker["Authorization"],
                str(args.attackers),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(args.attack_s)
        attacking.send_signal(signal.SIGINT)
        codes_line = attacking.communicate(timeout=30)[0].strip().splitlines()
        attack_end[0] = time.monotonic()
        phase[0] = "after"
        time.sleep(args.quiet_s)
        stop_victim.set()
        v.join()
    finally:
        dmsc("down")
    out: dict[str, object] = {
        name: _summary(lat, len(errs)) for name, (lat, errs) in phases.items()
    }
    before_p50 = out["before"]["p50_s"]  # type: ignore[index]
    normal = next((t for t, dt in after_log if dt < 2 * before_p50), None)
    out["normal_after_s"] = normal
    out["attacker_answers"] = json.loads(codes_line[-1]) if codes_line else {}
    out["attack_s"], out["attackers"] = args.attack_s, args.attackers
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"attack: {args.attackers} clients sending 1024-token requests for {args.attack_s:g} s; "
        f"answers by status {out['attacker_answers']}"
    )
    for name in ("before", "during", "after"):
        r: dict[str, float] = out[name]  # type: ignore[assignment]
        print(
            f"victim {name:6s}: {r['requests']:4d} ok, {r['errors']} errors, "
            f"p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, max {r['max_s']:.3f} s"
        )
    print(
        f"victim back to normal {normal:.2f} s after the attack"
        if normal is not None
        else "victim not back to normal"
    )


if __name__ == "__main__":
    main()
