"""``dmsc status``'s section per parallel mode: each mode's communication per step, predicted
against measured (:func:`dmsc.runtime.control.status.modes`)."""

from __future__ import annotations

from rich.console import Console

from dmsc.cli.render import fit_table, human_bytes
from dmsc.runtime.transport.replies import StatusReply

MODE_NAMES = {
    "tp": "tensor parallel (all-reduces)",
    "dp": "data parallel (exposed all-reduce)",
    "ep": "expert parallel (all-to-all)",
    "pp": "pipeline (sends, waits)",
}


def caption(basis: str | None) -> str:
    """What the columns are; ``basis``: what the task's step is compared with where that is not
    the plan's prediction (None: it is)."""
    measured = (
        "measured: the slowest worker's wait (data and expert parallel: the least-waiting "
        "replica's, the exchange without the wait for the others' compute; the slowest "
        "worker's in the next column), median over the last steps"
    )
    if basis is None:
        return (
            "predicted: the plan's cost model (pipeline: with its bubble, which a stage waits "
            f"through too); {measured}"
        )
    if basis.startswith("not comparable"):
        return f"predicted: none, the task's step is {basis}; {measured}"
    return f"predicted: the cost model's, {basis}; {measured}"


def print_modes(console: Console, out: StatusReply) -> None:
    """The table, when the run has a traced training task."""
    if not out.modes:
        return

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    t = fit_table(
        "mode",
        "predicted",
        "measured",
        "measured / predicted",
        "slowest worker",
        "bytes sent",
        "steps",
        title=f"communication per step by mode (task {out.modes_task})",
        caption=caption(out.modes_prediction),
    )
    for m in out.modes:
        t.add_row(
            MODE_NAMES[m.mode],
            secs(m.predicted_s),
            secs(m.measured_s),
            "-" if m.ratio is None else f"{m.ratio:.2f}",
            secs(m.slowest_s),
            "-" if m.measured_bytes is None else human_bytes(m.measured_bytes),
            str(m.steps),
        )
    console.print(t)
    if out.expert_imbalance is not None:
        console.print(
            f"expert routing: the busiest expert-parallel rank received "
            f"{out.expert_imbalance:.2f} of an even share of the tokens (the plan priced "
            f"{out.planned_expert_imbalance:.2f}; dmsc plan --expert-imbalance prices another)",
            highlight=False,
        )
