"""Data parallelism across two datacenters joined by a thin link: gpt-mini, dp=2, one replica in
each datacenter, the replicas' traffic limited to 100 Mbit/s each way.

The link is shaped in the data plane (``StageLayout.dp_link_mbps``: every data-parallel send
waits for its bytes to pass a link of that rate, :class:`dmsc.runtime.compute.gradient_sync.
LinkShaper`), not with ``tc``: the benchmark runs unprivileged on one machine, and the pipeline's
own frames are not slowed. Every mode trains the same steps on the same batches (the same tokens)
from the same weights; for each: validation loss at the end, wall time, and the bytes the
replicas sent each other per step.

Modes: ``every-step`` (fp32 gradients every step), ``diloco-10``, ``diloco-50`` (inner AdamW,
outer SGD rate 1.0 with Nesterov momentum 0.5: see ``OUTER``), ``diloco-50-paper`` (the DiLoCo
paper's outer rate 0.7 and momentum 0.9), ``diloco-50-int8`` (the pseudo-gradient in int8
with per-block scales), ``powersgd`` (every step, rank 4 with error feedback), ``fedavg-25``,
``fedavg-25-dp`` (each site's update clipped to norm 1, Gaussian noise of 0.8 x 1 on their sum:
epsilon from the RDP accountant at delta 1e-5) and ``fedavg-25-secure`` (pairwise masks).

Prints a table, or with --json one object: ``modes``: per mode ``bytes_per_step``, ``val_loss``,
``wall_s`` (and ``loss_last``), plus the ratios the issue asks about.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from dmsc.data.corpus import Corpus, stdlib_text
from dmsc.runtime.control.launch.deployment import Deployment, StageLayout
from dmsc.runtime.control.training.session import train, validation_loss
from dmsc.runtime.transport.messages import SyncSettings
from dmsc.spec import resolve_model

SPEC = resolve_model("gpt-mini")
WHOLE = [("embedding", "head")]

# DiLoCo's outer step: rate 1.0 with Nesterov momentum 0.5, the best of five settings measured at
# H=50 over this benchmark's 300 steps (validation loss, unshaped link): 0.7/0.9 (the paper's,
# tuned for runs of many more rounds) 2.400, 1.0/0.9 2.438, 0.8/0.7 2.362, 1.0/0.5 2.359, and
# 1.0/0 (FedAvg) 2.356; momentum pays over many rounds, and here there are six.
OUTER = {"outer_lr": 1.0, "outer_momentum": 0.5}

MODES: dict[str, SyncSettings] = {
    "every-step": SyncSettings(),
    "diloco-10": SyncSettings(mode="diloco", inner_steps=10, **OUTER),
    "diloco-50": SyncSettings(mode="diloco", inner_steps=50, **OUTER),
    "diloco-50-int8": SyncSettings(mode="diloco", inner_steps=50, compress="int8", **OUTER),
    "diloco-50-paper": SyncSettings(mode="diloco", inner_steps=50),  # outer 0.7, Nesterov 0.9
    "powersgd": SyncSettings(compress="powersgd:4"),
    "fedavg-25": SyncSettings(mode="fedavg", inner_steps=25),
    # the federated example: clipping to 1 and noise 0.8 on the sum (central DP), masks
    "fedavg-25-dp": SyncSettings(
        mode="fedavg", inner_steps=25, privacy_clip=1.0, privacy_noise=0.8
    ),
    "fedavg-25-secure": SyncSettings(mode="fedavg", inner_steps=25, secure=True),
}


def run(steps: int, batch: int, mbps: float, modes: list[str]) -> dict[str, Any]:
    text, held_out = stdlib_text(max_bytes=4_000_000)
    corpus, valid = Corpus(text, SPEC.seq, seed=0), Corpus(held_out, SPEC.seq, seed=1)
    layout = StageLayout(
        SPEC,
        WHOLE,
        replicas=2,
        lr=1e-3,
        datacenters={(0, 0): "dc-a", (0, 1): "dc-b"},
        dp_link_mbps=mbps,
    )
    out: dict[str, Any] = {"modes": {}}
    with Deployment(layout, step_deadline_s=600) as dep:
        start = dep.checkpoint(0, dep.home / "start")
        out["val_start"] = validation_loss(dep, valid, batch, 1, batches=8)
        for name in modes:
            dep.restore(start)
            t0 = time.perf_counter()
            rep = train(dep, corpus, valid, steps, batch, 1, validate=False, sync=MODES[name])
            wall = time.perf_counter() - t0
            val = validation_loss(dep, valid, batch, 1, batches=8)
            out["modes"][name] = {
                "bytes_per_step": rep.dp_bytes / steps,
                "val_loss": val,
                "loss_last": rep.losses[-1],
                "wall_s": wall,
                "rounds": rep.rounds,
            }
            privacy = rep.sync_json().get("privacy")
            if privacy:
                out["modes"][name]["epsilon"] = privacy["epsilon"]
                out["modes"][name]["delta"] = privacy["delta"]
            print(f"# {name}: {out['modes'][name]}", flush=True)
    base = out["modes"].get("every-step")
    if base:
        for m in out["modes"].values():
            m["bytes_vs_every_step"] = base["bytes_per_step"] / max(1.0, m["bytes_per_step"])
            m["val_loss_vs_every_step"] = m["val_loss"] / base["val_loss"]
    out.update(steps=steps, batch=batch, link_mbps=mbps, tokens=steps * batch * SPEC.seq)
    out["shaping"] = "data plane (LinkShaper on data-parallel sends), not tc"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="global batch (half per replica)")
    ap.add_argument("--mbps", type=float, default=100.0, help="the link's rate (0: unshaped)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON object to this file")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    res = run(a.steps, a.batch, a.mbps, modes)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    if a.json:
        print(json.dumps(res))
        return
    print(
        f"gpt-mini, dp=2 across two datacenters, {a.mbps:g} Mbit/s link, {a.steps} steps of "
        f"{a.batch} sequences ({res['tokens']:,} tokens); validation loss before: "
        f"{res['val_start']:.4f}"
    )
    head = ("mode", "bytes/step", "x fewer", "val loss", "vs every", "wall s")
    print(f"{head[0]:16} {head[1]:>12} {head[2]:>8} {head[3]:>9} {head[4]:>9} {head[5]:>8}")
    for name, m in res["modes"].items():
        print(
            f"{name:16} {m['bytes_per_step']:12,.0f} {m.get('bytes_vs_every_step', 0):8.1f} "
            f"{m['val_loss']:9.4f} {m.get('val_loss_vs_every_step', 0):9.3f} {m['wall_s']:8.1f}"
        )


if __name__ == "__main__":
    main()
