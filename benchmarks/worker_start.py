"""Starting a stage worker: a fresh interpreter per worker (``DMSC_WORKER_START=exec``) against a
fork of the launcher's server that imported the worker once (the default,
:mod:`dmsc.runtime.control.launch.forked`), side by side in one run.

Each start is timed from the launcher's call to the worker's ``READY`` line (it has built its
stage of gpt-mini and registered). The forked row's first start includes bringing the server
up.

Prints a table, or with --json one object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dmsc.runtime.business.registry import REGISTRY_SERVICE, Registry, registry_methods
from dmsc.runtime.compute.worker import WorkerConfig
from dmsc.runtime.control.launch.launchers import LocalLauncher
from dmsc.runtime.transport.rpc import serve
from dmsc.spec import resolve_model


def _starts(fork: bool, n: int, registry: str, work: Path) -> list[float]:
    launcher = LocalLauncher(home=work, fork=fork)
    took = []
    for i in range(n):
        cfg = WorkerConfig(
            sid=f"{'fork' if fork else 'exec'}-{i}",
            stage=0,
            stages=2,
            model=resolve_model("gpt-mini").model_dump(),
            first="embedding",
            last="block_1",
            registry=registry,
        )
        t = time.perf_counter()
        handle = launcher.start(cfg, work)
        took.append(time.perf_counter() - t)
        launcher.stop(handle)
    return took


def measure(n: int) -> dict[str, Any]:
    reg = Registry(ttl_s=60)
    server, port = serve(REGISTRY_SERVICE, registry_methods(reg))
    out: dict[str, Any] = {"starts": n}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode, fork in (("exec", False), ("fork", True)):
                took = _starts(fork, n, f"127.0.0.1:{port}", Path(tmp))
                out[mode] = {
                    "first_s": took[0],
                    "median_s": statistics.median(took),
                    "median_after_first_s": statistics.median(took[1:]) if n > 1 else None,
                }
    finally:
        server.stop(0)
    out["ratio_median"] = out["fork"]["median_s"] / out["exec"]["median_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=6, help="Workers started one after another.")
    ap.add_argument("--json", action="store_true", help="One JSON object instead of the table.")
    args = ap.parse_args()
    out = measure(max(1, args.starts))
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'start':<6} {'first (s)':>10} {'median (s)':>11} {'median after first (s)':>23}")
    for mode in ("exec", "fork"):
        row = out[mode]
        after = row["median_after_first_s"]
        after_s = f"{after:.3f}" if after is not None else "-"
        print(f"{mode:<6} {row['first_s']:>10.3f} {row['median_s']:>11.3f} {after_s:>23}")
    print(f"fork / exec, median start: {out['ratio_median']:.3f}")


if __name__ == "__main__":
    main()
