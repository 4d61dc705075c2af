"""The charts of ``dmsc simulate --lightpaths`` beyond the blocking curves: fragmentation over
the requests, and a heat map of every fiber's spectrum at one moment."""

from __future__ import annotations

from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fragmentation(path: str, traces: dict[str, Any], out: dict[str, Any], load: float) -> None:
    """Utilisation, external fragmentation and spectrum entropy over the requests, per fit."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    for fit, samples in traces.items():
        xs = [x.request for x in samples]
        axes[0].plot(xs, [x.utilization * 100 for x in samples], label=f"{fit} fit")
        axes[1].plot(xs, [x.external_fragmentation for x in samples], label=f"{fit} fit")
        axes[2].plot(xs, [x.entropy for x in samples], label=f"{fit} fit")
    axes[0].set_ylabel("slots held (%)")
    axes[1].set_ylabel("external fragmentation")
    axes[2].set_ylabel("spectrum entropy")
    axes[2].set_xlabel("request")
    axes[0].set_title(f"{out['topology']} at {load:g} Erlang (seed 0)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmap(path: str, shot: tuple[str, float, Any], out: dict[str, Any], at: int) -> None:
    """Links x slots: each lightpath in its own colour (its guard band too), free slots white."""
    plt = _pyplot()
    fit, load, owner = shot
    grid = np.ma.masked_less(owner % 20, 0)  # 20 colours, cycled by lightpath id
    grid.mask |= owner < 0
    fig, ax = plt.subplots(figsize=(9, 0.25 * len(out["links"]) + 1.5))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="tab20")
    ax.set_yticks(range(len(out["links"])), out["links"], fontsize=6)
    ax.set_xlabel("slot")
    held = float((owner >= 0).mean() * 100)
    ax.set_title(
        f"{out['topology']}: spectrum at request {at} ({fit} fit, {load:g} Erlang, seed 0; "
        f"{held:.0f}% held)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
