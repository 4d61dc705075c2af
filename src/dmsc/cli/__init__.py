"""The ``dmsc`` command: one module per command group, assembled here in the order
``dmsc --help`` lists them. ``main`` is the console script (``dmsc = "dmsc.cli:main"``), ``app``
the Typer app."""

from __future__ import annotations

from dmsc.cli import (
    chaos,
    demo,
    estimate,
    export,
    logs,
    models,
    modules,
    plan,
    runtime,
    segment,
    simulate,
    specs,
    task_records,
    tasks,
    tokens,
    topology,
)
from dmsc.cli.app import app, main

__all__ = ["app", "main"]

app.command()(specs.schema)
app.command()(estimate.estimate)
app.command()(plan.plan)
app.command()(segment.segment)
app.command()(simulate.simulate)
app.add_typer(topology.topology_app, name="topology")
app.command()(runtime.calibrate)
app.command()(runtime.up)
app.add_typer(tokens.token_app, name="token")
app.add_typer(models.models_app, name="models")
app.add_typer(task_records.tasks_app, name="tasks")
app.add_typer(modules.modules_app, name="modules")
app.command()(runtime.status)
app.command()(tasks.train)
app.command()(chaos.chaos)
app.command()(tasks.infer)
app.command()(modules.replan)
app.command()(export.export)
app.command()(runtime.down)
app.command()(logs.logs)
app.command()(demo.demo)
