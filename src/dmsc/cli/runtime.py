"""The runtime commands: calibrate, up, status, train, infer, down, and the demo's main job."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dmsc.spec import SpecError

ROOT = Path(__file__).resolve().parents[3]
LOCAL_CPU = ROOT / "examples" / "clusters" / "local-cpu.yaml"


def calibrated_path() -> Path:
    from dmsc.data.db import data_dir

    return data_dir() / "local-cpu.calibrated.yaml"


def do_calibrate(template: str | None, out: str | None, console: Console) -> dict[str, float]:
    from dmsc.runtime.compute.calibrate import calibrate

    src = Path(template) if template else LOCAL_CPU
    dst = Path(out) if out else calibrated_path()
    measured = calibrate(src, dst)
    console.print(
        f"matmul {measured['matmul_flops'] / 1e9:.1f} GFLOP/s per core, memory "
        f"{measured['memory_bytes_s'] / 1e9:.1f} GB/s, loopback "
        f"{measured['loopback_bytes_s'] * 8 / 1e9:.2f} Gbit/s, round trip "
        f"{measured['loopback_rtt_s'] * 1e6:.0f} us, per-kernel overhead "
        f"{measured['op_overhead_s'] * 1e6:.1f} us, {measured['cores']:.0f} cores -> {dst}",
        highlight=False,
    )
    return measured


def _control() -> Any:
    from dmsc.runtime.control.plane import control_file
    from dmsc.runtime.transport.messages import CONTROL_SERVICE
    from dmsc.runtime.transport.rpc import Client

    path = control_file()
    if not path.exists():
        raise SpecError("control plane", "", "not running (start it with `dmsc up --plan FILE`)")
    info = json.loads(path.read_text())
    return Client(info["address"], CONTROL_SERVICE, timeout_s=3600)


def do_up(
    plan_path: str,
    console: Console,
    gateway: str | None = None,
    router: str = "least_outstanding",
    failure_timeout_s: float = 10.0,
    spares: int = 0,
) -> None:
    from dmsc.planner.plan import Plan
    from dmsc.runtime.control.plane import control_file

    if not Path(plan_path).is_file():
        raise SpecError(plan_path, "", "no such file")
    try:
        Plan.model_validate_json(Path(plan_path).read_text())
    except ValueError as exc:
        raise SpecError(plan_path, "", f"not a dmsc plan ({str(exc).splitlines()[0]})") from None
    from dmsc.runtime.business.router import POLICIES

    if router not in POLICIES:
        raise SpecError(
            "command line", "--router", f"unknown policy (known: {', '.join(POLICIES)})"
        )
    if control_file().exists():
        pid = json.loads(control_file().read_text()).get("pid", 0)
        try:
            os.kill(int(pid), 0)
        except (OSError, ValueError):  # it died without cleaning up: a stale file
            control_file().unlink()
        else:
            raise SpecError("control plane", "", "already running (`dmsc down` first)")
    if not failure_timeout_s > 0:
        raise SpecError("command line", "--failure-timeout", "must be positive")
    cmd = [sys.executable, "-m", "dmsc.runtime.control.plane", "--plan", plan_path]
    if not 0 <= spares <= 64:
        raise SpecError("command line", "--spares", "must be between 0 and 64")
    cmd += ["--failure-timeout", str(failure_timeout_s), "--spares", str(spares)]
    if gateway:
        host, _, port = gateway.rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port.isdigit():
            raise SpecError("command line", "--gateway", "expected 127.0.0.1:PORT")
        cmd += ["--gateway", gateway, "--router", router]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise SpecError(plan_path, "", "the control plane failed to start")
    console.print(
        f"control plane up at {line.split()[1]} (pid {proc.pid})"
        + (f", gateway http://{gateway}" if gateway else ""),
        highlight=False,
    )


def do_status(console: Console, as_json: bool) -> dict[str, Any]:
    out: dict[str, Any] = _control().call("Status")
    if as_json:
        print(json.dumps(out))
        return out
    t = Table(
        "SID",
        "stage",
        "replica",
        "address",
        "health",
        "last heartbeat",
        "pid",
        title=f"run {out['run']}: {out['model']}, {out['steps']} steps trained",
    )
    for s in out["services"]:
        age = s.get("heartbeat_age_s")
        beat = f"{age:.1f} s ago" if s["registered"] and age is not None else "not registered"
        t.add_row(
            s["sid"],
            str(s["stage"]),
            str(s["replica"]),
            s["address"],
            s["health"],
            beat,
            str(s["pid"]),
        )
    console.print(t)
    if out["tasks"]:
        tt = Table("task", "kind", "state")
        for task in out["tasks"]:
            tt.add_row(str(task["id"]), task["kind"], task["state"])
        console.print(tt)
    if out.get("faults"):
        ft = Table(
            "fault", "task", "replaced", "reason", "recovered after", "back to step", title="faults"
        )
        for f in out["faults"]:
            took = (
                f"{f['recovered_at'] - f['detected_at']:.1f} s" if f["recovered_at"] else "not yet"
            )
            ft.add_row(
                f"{f['id']} {f['kind']}",
                str(f["task"] or ""),
                f["services"],
                f["reason"][:80],
                took,
                str(f["checkpoint_step"]),
            )
        console.print(ft)
    return out


def do_train(
    steps: int,
    console: Console,
    as_json: bool,
    checkpoint_every: int = 50,
    late_policy: str = "wait",
    grad_wait_s: float = 5.0,
) -> dict[str, Any]:
    if steps <= 0:
        raise SpecError("command line", "--steps", "must be positive")
    if checkpoint_every < 0:
        raise SpecError("command line", "--checkpoint-every", "must be 0 or positive")
    if late_policy not in ("wait", "skip", "restart"):
        raise SpecError("command line", "--late-policy", "must be wait, skip or restart")
    if not grad_wait_s > 0:
        raise SpecError("command line", "--grad-wait", "must be positive")
    req = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "late_policy": late_policy,
        "grad_wait_s": grad_wait_s,
    }
    out: dict[str, Any] = _control().call("Train", req)
    if as_json:
        print(json.dumps(out))
    else:
        console.print(
            f"task {out['task']}: {out['steps']} steps, loss {out['loss_first']:.3f} -> "
            f"{out['loss_last']:.3f}, validation {out['val_start']:.3f} -> {out['val_end']:.3f}, "
            f"step {out['median_step_s'] * 1e3:.1f} ms (predicted "
            f"{out['predicted_step_s'] * 1e3:.1f} ms), {out['tokens_per_s']:,.0f} tokens/s",
            highlight=False,
        )
        for r in out.get("recoveries", []):
            console.print(
                f"recovered: replaced {', '.join(r['services']) or 'nothing'} "
                f"({r['reason'][:100]}) in {r['recovered_after_s']:.1f} s, "
                f"back to the checkpoint of step {r['checkpoint_step']}",
                highlight=False,
            )
    return out


def parse_target(text: str) -> tuple[int, int]:
    """``stage=N[,replica=R]`` -> (stage, replica)."""
    fields: dict[str, int] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in ("stage", "replica") or not value.strip().isdigit():
            raise SpecError(
                "command line", "--kill-worker", f"expected stage=N[,replica=R], got {text!r}"
            )
        fields[name.strip()] = int(value)
    if "stage" not in fields:
        raise SpecError("command line", "--kill-worker", "names no stage (stage=N)")
    return fields["stage"], fields.get("replica", 0)


def do_chaos(
    target: str, after_s: float, freeze: bool, watch_s: float, console: Console, as_json: bool
) -> dict[str, Any]:
    """Kill -9 (or freeze) one stage worker of the running deployment after ``after_s`` seconds,
    then watch the control plane detect and repair it."""
    import signal

    stage, replica = parse_target(target)
    if after_s < 0 or watch_s <= 0:
        raise SpecError("command line", "--after", "must be 0 or positive (and --watch positive)")
    control = _control()
    before = control.call("Status")
    victim = next(
        (s for s in before["services"] if (s["stage"], s["replica"]) == (stage, replica)), None
    )
    if victim is None:
        raise SpecError(
            "command line", "--kill-worker", f"no worker at stage {stage} replica {replica}"
        )
    seen = {f["id"] for f in before.get("faults", [])}
    time.sleep(after_s)
    os.kill(int(victim["pid"]), signal.SIGSTOP if freeze else signal.SIGKILL)
    injected = time.time()
    fault = None
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        now = control.call("Status")
        fresh = [
            f
            for f in now.get("faults", [])
            if f["id"] not in seen and victim["sid"] in f["services"].split(",")
        ]
        if fresh and fresh[-1]["recovered_at"]:
            fault = fresh[-1]
            break
        time.sleep(0.2)
    if freeze:  # let the frozen instance run again: fencing must keep it out
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(victim["pid"]), signal.SIGCONT)
    out = {
        "fault": "freeze" if freeze else "kill -9",
        "target": victim["sid"],
        "pid": victim["pid"],
        "recovered": fault is not None,
        "detected_after_s": fault["detected_at"] - injected if fault else None,
        "recovered_after_s": fault["recovered_at"] - injected if fault else None,
        "checkpoint_step": fault["checkpoint_step"] if fault else None,
        "steps_lost": fault["steps_lost"] if fault else None,
    }
    if as_json:
        print(json.dumps(out))
    elif fault is None:
        console.print(
            f"{out['fault']} {victim['sid']} (pid {victim['pid']}): "
            f"no recovery seen within {watch_s:g} s",
            highlight=False,
        )
    else:
        console.print(
            f"{out['fault']} {victim['sid']} (pid {victim['pid']}): detected after "
            f"{out['detected_after_s']:.2f} s, recovered after {out['recovered_after_s']:.2f} s, "
            f"back to the checkpoint of step {out['checkpoint_step']} "
            f"({out['steps_lost']} steps run again)",
            highlight=False,
        )
    if fault is None:
        raise SystemExit(1)
    return out


def do_infer(prompt: str, tokens: int, console: Console) -> str:
    out = _control().call("Infer", {"prompt": prompt, "tokens": tokens})
    console.print(prompt + out["text"], highlight=False, markup=False)
    return str(out["text"])


def do_down(console: Console) -> None:
    from dmsc.runtime.control.plane import control_file

    info = json.loads(control_file().read_text()) if control_file().exists() else None
    _control().call("Down")
    deadline = time.time() + 30
    while control_file().exists() and time.time() < deadline:
        time.sleep(0.2)
    console.print(f"control plane down (pid {info['pid'] if info else '?'})", highlight=False)


def runtime_demo(console: Console, steps: int = 200) -> dict[str, Any]:
    """Calibrate, plan gpt-mini on this machine, deploy, train, compare, sample, shut down."""
    from dmsc.cli.plan_render import print_plan
    from dmsc.data.corpus import Corpus, stdlib_text
    from dmsc.data.db import Database, ModelVersionRecord, ServiceRecord
    from dmsc.planner.solve import plan_job
    from dmsc.runtime.control.deployment import Deployment
    from dmsc.runtime.control.training import layout_from_plan, train
    from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, load_spec, resolve_model

    console.rule("runtime: gpt-mini as three micro-model services on this machine")
    do_calibrate(None, None, console)
    cluster = load_spec(ClusterSpec, calibrated_path())
    model = resolve_model("gpt-mini")
    assert isinstance(model, TransformerSpec)
    job = JobSpec(global_batch=16, micro_batch=4, pp=3, schedule="1f1b", overlap_dp_comm=False)
    plan = plan_job(cluster, model, job, fixed=True).plan
    print_plan(console, plan)
    db = Database()
    run = db.new_run(plan.model, plan.cluster, json.loads(plan.model_dump_json()))
    train_text, valid_text = stdlib_text()
    corpus, valid = Corpus(train_text, model.seq, 0), Corpus(valid_text, model.seq, 1)
    with Deployment(layout_from_plan(plan, model)) as dep:
        for h in dep.handles:
            db.add(
                ServiceRecord(
                    run_id=run.id,
                    sid=h.config.sid,
                    stage=h.config.stage,
                    replica=h.config.replica,
                    address=h.address,
                )
            )
        console.print(
            "services: " + ", ".join(f"{h.config.sid}@{h.address}" for h in dep.handles),
            highlight=False,
        )
        task = db.new_task(run.id, "train", {"steps": steps})
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            bar = progress.add_task("training", total=steps)

            def on_step(step: int, out: dict[str, Any]) -> None:
                progress.update(
                    bar,
                    advance=1,
                    description=(
                        f"step {step + 1}/{steps} loss {out['loss']:.3f} "
                        f"{out['tokens_per_s']:,.0f} tok/s {out['step_s'] * 1e3:.0f} ms"
                    ),
                )

            report = train(
                dep,
                corpus,
                valid,
                steps,
                job.global_batch,
                job.microbatches,
                "1f1b",
                db,
                task.id,
                on_step,
            )
        saved = dep.clients[(0, 0)].call(
            "Save",
            {
                "path": str(
                    Path(db.url.split("///")[-1]).parent / "checkpoints" / f"demo-run{run.id}.pt"
                )
            },
        )
        db.add(
            ModelVersionRecord(
                run_id=run.id, step=steps, path=saved["path"], sha256=saved["sha256"]
            )
        )
        sample = dep.generate(b"def main(", 80)
    predicted = plan.prediction.iteration_time_s
    measured = report.median_step_s
    console.print(
        f"validation loss {report.val_start:.3f} -> {report.val_end:.3f}; step time measured "
        f"{measured * 1e3:.1f} ms vs predicted {predicted * 1e3:.1f} ms "
        f"({(predicted / measured - 1) * 100:+.1f}%)",
        highlight=False,
    )
    console.print(
        "sample: def main(" + sample.decode("utf-8", errors="replace"),
        highlight=False,
        markup=False,
    )
    console.print(f"run {run.id} recorded in {db.url}", highlight=False)
    return {
        "val_start": report.val_start,
        "val_end": report.val_end,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
    }
