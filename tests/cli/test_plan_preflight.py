"""``dmsc up`` refuses a plan the runtime cannot run as planned before anything starts: an
interleaved plan whose stages do not hold their chunks in order (the runtime runs each stage's
chunks apart, by the interleaved 1F1B schedule; it used to merge a stage's chunks into one range
over other stages' layers: gpt-mini pp=2 v=2 ran blocks 1 and 2 twice); a plan with
tensor parallelism the runtime does not run (sequence parallel with experts, GPUs), and a plan
whose stages, replicas or devices do not add up to its job (issue 31). A plan with expert
parallelism starts (it used to be refused), for training or inference (refused until a request
ran on every replica of an expert-parallel group), with tp = 1 or tp = 2 (refused until the runtime
split each expert over the tp ranks), unless its ep does not divide the experts or the replicas,
or comes with GPUs or spares (Ray runs it: tests/integration/test_ray.py). Spares with tp > 1
(and ep = 1) are taken."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dmsc.cli import main
from dmsc.planner.plan import Plan
from dmsc.planner.solve import plan_job
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model
from tests.conftest import EXAMPLES


def _plan(tmp_path: Path, local_cpu: ClusterSpec, **job: object) -> Path:
    spec = JobSpec(global_batch=16, micro_batch=2, pp=2, **job)
    plan = plan_job(local_cpu, resolve_model("gpt-mini"), spec, fixed=True).plan
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def _up(
    tmp_path: Path,
    plan: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *flags: str,
) -> tuple[int, str]:
    """``dmsc up --plan PLAN [FLAGS]`` with a stand-in control plane that records that it
    started."""
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    script = tmp_path / "control-plane"
    script.write_text(f'#!/bin/sh\ntouch {tmp_path}/started\necho "READY 127.0.0.1:4242"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(script))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--plan", str(plan), *flags])
    return int(exit_.value.code or 0), capsys.readouterr().err


def test_an_interleaved_plan_starts_with_each_stage_holding_its_chunks(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dmsc.runtime.control.training.session import layout_from_plan

    path = _plan(tmp_path, local_cpu, schedule="interleaved", interleave=2)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    plan = Plan.model_validate_json(path.read_text())
    assert plan.model_spec is not None
    layout = layout_from_plan(plan, plan.model_spec)  # type: ignore[arg-type]
    assert layout.chunks == [list(st.chunks) for st in plan.stages]
    assert [len(c) for c in layout.chunks] == [2, 2]
    for s, st in enumerate(plan.stages):  # never one range over other stages' layers
        fields = layout.stage_fields(s)
        assert (fields["first"], fields["last"]) == st.chunks[0]
        assert fields["chunks"] == [list(c) for c in st.chunks]


def test_the_plans_all_reduce_reaches_each_workers_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan whose stages say tree: the layout carries it, and each worker's configuration."""
    from dmsc.runtime.control.launch.deployment import Deployment
    from dmsc.runtime.control.training.session import layout_from_plan

    cluster = load_spec(ClusterSpec, EXAMPLES / "two-sites-cpu.yaml")
    job = JobSpec(global_batch=8, micro_batch=2, tp=1, pp=2, dp=2, allreduce="tree")
    plan = plan_job(cluster, resolve_model("gpt-mini"), job, fixed=True).plan
    layout = layout_from_plan(plan, plan.model_spec)  # type: ignore[arg-type]
    assert layout.allreduce == {0: "tree", 1: "tree"}
    dep = Deployment.__new__(Deployment)  # config() only: no processes
    monkeypatch.setattr(dep, "layout", layout, raising=False)
    monkeypatch.setattr(dep, "epoch", 0, raising=False)
    monkeypatch.setattr(dep, "registry_address", "", raising=False)
    monkeypatch.setattr(dep, "token", None, raising=False)
    monkeypatch.setattr(dep, "home", tmp_path, raising=False)
    monkeypatch.setattr(dep, "tp", type("Store", (), {"address": ""})(), raising=False)
    assert dep.config(1, 1).allreduce == "tree"


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        ("a chunk fewer", "stages[1].chunks", "1 chunks for job.schedule interleaved"),
        ("chunks swapped", "stages[0].chunks[0]", "starts at block_2, the model's first layer"),
    ],
)
def test_an_interleaved_plan_whose_chunks_do_not_add_up_is_refused(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    edit: str,
    field: str,
    reason: str,
) -> None:
    path = _plan(tmp_path, local_cpu, schedule="interleaved", interleave=2)
    data = Plan.model_validate_json(path.read_text()).model_dump(mode="json")
    if edit == "a chunk fewer":
        data["stages"][1]["chunks"].pop()
    else:
        data["stages"][0]["chunks"].reverse()
    if edit == "ep not dividing the replicas":  # a plan no JobSpec takes: written as it is
        path.write_text(json.dumps(data))
        return
    path.write_text(Plan.model_validate(data).model_dump_json())
    err = _refused(tmp_path, path, monkeypatch, capsys, field)
    assert reason in err, err


def test_a_plan_of_one_chunk_per_stage_still_starts(
    tmp_path: Path,
    local_cpu: ClusterSpec,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dmsc.runtime.control.training.session import layout_from_plan

    path = _plan(tmp_path, local_cpu)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()
    plan = Plan.model_validate_json(path.read_text())
    assert plan.model_spec is not None
    ranges = layout_from_plan(plan, plan.model_spec).ranges  # type: ignore[arg-type]
    assert [tuple(r) for r in ranges] == [st.chunks[0] for st in plan.stages]
    assert ranges[0][0] == "embedding" and ranges[-1][1] == "head"


def _two_sites_plan(tmp_path: Path, model: str = "gpt-mini", **job: object) -> Path:
    """A plan on two-sites-cpu.yaml (two sites of two devices), the issue's example."""
    cluster = load_spec(ClusterSpec, EXAMPLES / "two-sites-cpu.yaml")
    spec = JobSpec(global_batch=8, micro_batch=2, **job)
    plan = plan_job(cluster, resolve_model(model), spec, fixed=True).plan
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def _refused(
    tmp_path: Path,
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    field: str,
) -> str:
    """``dmsc up`` exits 2 on ``path`` with one line naming ``field``, and starts nothing."""
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {path}: {field}: "), err
    assert "Traceback" not in err and not (tmp_path / "started").exists()
    return err


def test_a_tensor_parallel_plan_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # dmsc plan --tp 2 --pp 2 --dp 1 --no-sequence-parallel on two-sites-cpu.yaml: the runtime
    # runs each replica as two ranks (tests/integration/test_tensor_parallel_cli.py)
    path = _two_sites_plan(tmp_path, tp=2, pp=2, dp=1)
    assert Plan.model_validate_json(path.read_text()).job.tp == 2
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()


def test_a_tensor_parallel_plan_with_sequence_parallelism_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the runtime splits the blocks' sequence too (tests/runtime/compute/test_sequence_parallel.py)
    path = _two_sites_plan(tmp_path, tp=2, pp=2, dp=1, sequence_parallel=True)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err


def test_sequence_parallelism_for_a_mixture_of_experts_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _two_sites_plan(tmp_path, "moe-mini", tp=2, pp=2, dp=1, sequence_parallel=True)
    err = _refused(tmp_path, path, monkeypatch, capsys, "job.sequence_parallel")
    assert "mixture of experts" in err and "--no-sequence-parallel" in err


def test_a_plan_priced_with_another_frameworks_buckets_is_refused() -> None:
    """A job that names another framework's data-parallel bucket (``dp_bucket_bytes``, as the
    published sets price Megatron-Core's) was predicted with it; dmsc's runtime cuts its own,
    so such a plan would run another all-reduce than the one predicted."""
    from dmsc.cli.preflight import check_plan_parallelism
    from dmsc.spec import SpecError

    spec = JobSpec(global_batch=16, micro_batch=2, dp=2, dp_bucket_bytes=80_000_000)
    plan = SimpleNamespace(job=spec, model_spec=resolve_model("gpt-mini"))  # what it reads
    with pytest.raises(SpecError) as err:
        check_plan_parallelism("plan.json", plan)
    assert err.value.field == "job.dp_bucket_bytes"
    assert "4 MiB" in str(err.value)
    plan.job = spec.model_copy(update={"dp_bucket_bytes": None})
    check_plan_parallelism("plan.json", plan)


def test_a_tensor_parallel_plan_on_gpus_is_refused(tmp_path: Path) -> None:
    from dmsc.cli.preflight import check_plan_devices
    from dmsc.spec import SpecError

    path = _two_sites_plan(tmp_path, tp=2, pp=2, dp=1)
    plan = Plan.model_validate_json(path.read_text())
    with pytest.raises(SpecError) as err:
        check_plan_devices(str(path), plan, "cuda:0")
    assert err.value.field == "--device"
    assert "tensor-parallel ranks run on the CPU" in str(err.value)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 1)])
def test_an_expert_parallel_plan_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tp: int,
    pp: int,
) -> None:
    # the runtime shares moe-mini's experts out among the replicas of each stage, at tp = 2
    # each expert split over the replica's two ranks
    # (tests/integration/test_expert_parallel_deployment.py); it used to refuse ep > 1, then
    # ep > 1 with tp > 1
    path, cluster = tmp_path / "plan.json", str(EXAMPLES / "two-sites-cpu.yaml")
    if tp > 1:  # a stage's two replicas of two ranks in one site: one of four devices
        text = (EXAMPLES / "two-sites-cpu.yaml").read_text().replace("devices: 2", "devices: 4")
        (tmp_path / "four.yaml").write_text(text)
        cluster = str(tmp_path / "four.yaml")
    args = ["--model", "moe-mini", "--global-batch", "8", "--micro-batch", "2", "--out", str(path)]
    args += ["--no-sequence-parallel"] if tp > 1 else []
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "plan",
                "--cluster",
                cluster,
                *args,
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--dp",
                "2",
                "--ep",
                "2",
            ]
        )
    assert exit_.value.code == 0, capsys.readouterr().err
    job = Plan.model_validate_json(path.read_text()).job
    assert (job.tp, job.pp, job.dp, job.ep) == (tp, pp, 2, 2)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()


def test_an_expert_parallel_plan_for_inference_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to be refused, naming job.ep: a request now runs on every replica of an
    # expert-parallel group (tests/integration/test_expert_parallel_deployment.py decodes)
    path = _two_sites_plan(tmp_path, "moe-mini", tp=1, pp=2, dp=2, ep=2, mode="infer")
    assert Plan.model_validate_json(path.read_text()).job.mode == "infer"
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()


def test_an_expert_parallel_plan_starts_on_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to be refused, naming --launcher (tests/integration/test_ray.py trains one)
    path = _two_sites_plan(tmp_path, "moe-mini", tp=1, pp=2, dp=2, ep=2)
    code, err = _up(tmp_path, path, monkeypatch, capsys, "--launcher", "ray")
    assert code == 0, err
    assert (tmp_path / "started").exists()


def test_an_expert_parallel_plan_on_gpus_is_refused(tmp_path: Path) -> None:
    from dmsc.cli.preflight import check_plan_devices
    from dmsc.spec import SpecError

    path = _two_sites_plan(tmp_path, "moe-mini", tp=1, pp=2, dp=2, ep=2)
    plan = Plan.model_validate_json(path.read_text())
    with pytest.raises(SpecError) as err:
        check_plan_devices(str(path), plan, "cuda:0")
    assert err.value.field == "--device"
    assert "cuda:0 at ep=2: the experts' tokens are exchanged by gloo on the CPU" in str(err.value)


@pytest.mark.parametrize(
    ("flags", "reason"),
    [(["--spares", "1"], "--spares: the plan's ep is 2: warm spares do not take over")],
)
def test_an_expert_parallel_plan_with_spares_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    flags: list[str], reason: str,
) -> None:  # fmt: skip
    # --launcher ray was refused too, until the expert-parallel groups met at the control
    # plane's store on Ray (tests/integration/test_ray.py)
    path = _two_sites_plan(tmp_path, "moe-mini", tp=1, pp=2, dp=2, ep=2)
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--plan", str(path), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and reason in err, err


# the edits made to a plan of a model with experts (the others: gpt-mini's)
_ON_EXPERTS = {
    "ep not dividing the experts",
    "ep not dividing the replicas",
}


def _edited(path: Path, edit: str) -> None:
    """The plan at ``path`` (pp=2, dp=2, one device per replica) edited by hand."""
    plan = Plan.model_validate_json(path.read_text())
    data = plan.model_dump(mode="json")
    stages = data["stages"]
    if edit == "tp not dividing the heads":
        data["job"]["tp"] = 3
    elif edit == "ep on a model without experts":
        data["job"]["ep"] = 2
    elif edit == "ep not dividing the experts":
        data["job"].update(dp=3, ep=3, global_batch=12)
    elif edit == "ep not dividing the replicas":
        data["job"]["ep"] = 4
    elif edit == "more ranks than devices":
        stages[1]["replicas"][1]["devices"] = stages[0]["replicas"][0]["devices"]
    elif edit == "a replica fewer than dp":
        stages[1]["replicas"].pop()
    elif edit == "a stage fewer than pp":
        stages.pop()
    elif edit == "a layer left out":
        stages[1]["chunks"] = [["block_3", "head"]]
    elif edit == "stages out of order":
        stages.reverse()
    elif edit == "devices other than tp":
        stages[0]["replicas"][0]["devices"] = [0, 1]
    if edit == "ep not dividing the replicas":  # a plan no JobSpec takes: written as it is
        path.write_text(json.dumps(data))
        return
    path.write_text(Plan.model_validate(data).model_dump_json())


@pytest.mark.parametrize(
    ("edit", "field", "reason"),
    [
        ("tp not dividing the heads", "job.tp", "tp=3 does not divide the model's heads (4)"),
        ("ep on a model without experts", "job.ep", "ep=2: the model has no experts"),
        ("ep not dividing the experts", "job.ep", "ep=3 does not divide the model's experts (4)"),
        ("ep not dividing the replicas", "job.ep", "dp=2 is not divisible by ep=4"),
        ("more ranks than devices", "stages[1].replicas[1].devices", "also holds stages[0]"),
        ("a replica fewer than dp", "stages[1].replicas", "1 replicas for job.dp 2"),
        ("a stage fewer than pp", "stages", "1 stages for job.pp 2"),
        ("a layer left out", "stages[1].chunks", "starts at block_3, after block_1"),
        ("stages out of order", "stages[0].index", "is 1"),
        ("devices other than tp", "stages[0].replicas[0].devices", "2 devices for job.tp 1"),
    ],
)
def test_a_plan_that_does_not_add_up_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    edit: str,
    field: str,
    reason: str,
) -> None:
    model = "moe-mini" if edit in _ON_EXPERTS else "gpt-mini"
    path = _two_sites_plan(tmp_path, model, tp=1, pp=2, dp=2)
    _edited(path, edit)
    err = _refused(tmp_path, path, monkeypatch, capsys, field)
    assert reason in err, err


def test_the_two_sites_plan_without_tp_or_ep_still_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _two_sites_plan(tmp_path, tp=1, pp=2, dp=2)
    code, err = _up(tmp_path, path, monkeypatch, capsys)
    assert code == 0, err
    assert (tmp_path / "started").exists()


def test_sequence_parallel_and_ep_flags_need_a_fixed_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = str(EXAMPLES / "two-sites-cpu.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", cluster, "--model", "gpt-mini", "--no-sequence-parallel"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--sequence-parallel: only with a fixed strategy" in err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--cluster", cluster, "--model", "moe-mini", "--ep", "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--ep: only with a fixed strategy" in err


def test_spares_with_a_tensor_parallel_plan_are_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a spare waits as a whole stage and takes one rank over, a replica's ranks together
    # (dmsc.runtime.control.launch.spares); it used to be refused here
    from dmsc.cli.up_settings import control_settings

    path = _two_sites_plan(tmp_path, tp=2, pp=2, dp=1)
    monkeypatch.setenv("DMSC_HOME", str(tmp_path / "home"))
    settings = control_settings(str(path), tmp_path, None, "round_robin", 3.0, 2)
    assert settings.spares == 2


def test_checking_a_cpu_plans_devices_imports_no_torch(tmp_path: Path) -> None:
    """``dmsc up`` checks the plan's devices before it starts the control plane; for the usual
    CPU plan that must not cost torch's import (3.3 s of CPU on every ``dmsc up``: the check
    imported the training session for the devices)."""
    import subprocess

    path = _two_sites_plan(tmp_path, tp=1, pp=2, dp=1)
    probe = (
        "import sys\n"
        "from dmsc.cli.preflight import check_plan_devices\n"
        "from dmsc.planner.plan import Plan\n"
        f"plan = Plan.model_validate_json(open({str(path)!r}).read())\n"
        f"check_plan_devices({str(path)!r}, plan, 'plan')\n"
        "check_plan_devices('x', plan, 'cpu')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
