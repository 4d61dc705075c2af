"""How long `dmsc plan` searches and places GPT-3 175B on 1,024 of the Selene example's A100s.

Runs the command as a user does (``dmsc plan --cluster examples/clusters/a100-selene.yaml --model
gpt3-175b --global-batch 1536 --gpus 1024 --json``), each run a fresh process, and reads the
seconds it reports for its search and placement (``search_seconds``, the figure the table prints
as "searched N strategies and placed in ..."), with the process's wall time. With ``--against
SRC`` (another checkout's ``src`` folder) the same command runs from that tree too, the two
alternated run by run, so that both see the same machine, and the two plans' strategies are
compared (``same_plan``; their iteration times stand beside, which differ where the cost model
changed between the trees). Prints a
table, or with ``--json`` one object with the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "plan",
    "--cluster",
    str(ROOT / "examples" / "clusters" / "a100-selene.yaml"),
    "--model",
    "gpt3-175b",
    "--global-batch",
    "1536",
    "--gpus",
    "1024",
    "--json",
]


def _run(src: Path) -> tuple[float, float, dict[str, object]]:
    """One command from the tree of ``src``: its search and placement seconds, its wall
    seconds, and the plan's strategy and iteration time."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = "import sys; from dmsc.cli import app; sys.argv = ['dmsc', *sys.argv[1:]]; app()"
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, *ARGS], env=env, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    plan = json.loads(out.stdout)
    chosen = {"strategy": plan["strategy"], "iteration_time_s": plan["iteration_time_s"]}
    return float(plan["search_seconds"]), wall, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--against", type=Path, help="another checkout's src folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trees = {"this tree": ROOT / "src"}
    if args.against is not None:
        trees["against"] = args.against.resolve()
    search: dict[str, list[float]] = {name: [] for name in trees}
    wall: dict[str, list[float]] = {name: [] for name in trees}
    plans: dict[str, dict[str, object]] = {}
    for _ in range(args.runs):
        for name, src in trees.items():
            s, w, plan = _run(src)
            search[name].append(s)
            wall[name].append(w)
            if plans.setdefault(name, plan) != plan:
                raise SystemExit(f"{name}: the plan changed between runs: {plan}")
    out: dict[str, object] = {
        "command": "dmsc " + " ".join(a if "/" not in a else Path(a).name for a in ARGS),
        "runs": args.runs,
        "search_s": {n: statistics.median(v) for n, v in search.items()},
        "search_s_all": search,
        "wall_s": {n: statistics.median(v) for n, v in wall.items()},
        "plan": plans["this tree"],
        "load_average": list(os.getloadavg()),
    }
    if len(trees) == 2:
        # the same strategy chosen (its iteration time may differ where the cost model did)
        out["same_plan"] = plans["this tree"]["strategy"] == plans["against"]["strategy"]
        out["plan_against"] = plans["against"]
        out["ratio_by_run"] = [
            a / b for a, b in zip(search["this tree"], search["against"], strict=True)
        ]
        out["search_ratio"] = statistics.median(out["ratio_by_run"])  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(out, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{out['command']}: median of {args.runs} runs, alternated")
    for col in ("tree", "search and placement (s)", "fastest (s)", "slowest (s)", "command (s)"):
        table.add_column(col)
    for name in trees:
        v = search[name]
        table.add_row(
            name,
            f"{statistics.median(v):.3f}",
            f"{min(v):.3f}",
            f"{max(v):.3f}",
            f"{statistics.median(wall[name]):.2f}",
        )
    Console().print(table)
    if len(trees) == 2:
        print(f"search ratio (this tree / against), median by run: {out['search_ratio']:.2f}")
        print(f"same strategy: {out['same_plan']}")


if __name__ == "__main__":
    main()
