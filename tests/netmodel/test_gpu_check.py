"""Issue 13's GPU check is one prepared run (benchmarks/gpu_train_measure.py, PyTorch only) and a
comparison (gpu_train_compare.py); here both run on this CPU at a tiny size, so a lent GPU
machine gets a script that works, and its models are dmsc's presets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dmsc.spec import TransformerSpec, resolve_model

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def test_the_measured_models_are_the_presets() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_train_measure
    finally:
        sys.path.remove(str(BENCH))
    for name, (layers, hidden, heads) in gpu_train_measure.MODELS.items():
        spec = resolve_model(name)
        assert isinstance(spec, TransformerSpec)
        assert (spec.layers, spec.hidden, spec.heads) == (layers, hidden, heads)
        assert (spec.seq, spec.vocab, spec.tied_embeddings) == (
            gpu_train_measure.SEQ,
            gpu_train_measure.VOCAB,
            True,
        )


def test_measure_then_compare_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    cmd = [sys.executable, str(BENCH / "gpu_train_measure.py"), "--tiny", "--device", "cpu"]
    cmd += ["--micro-batches", "1", "--steps", "1", "--warmup", "0", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=120)
    measured = json.loads(out.read_text())
    assert [r["status"] for r in measured["rows"]] == ["ok", "ok"]
    assert all(r["step_ms"] > 0 for r in measured["rows"])
    # The comparison needs a GPU name; an H100's is what a lent machine reports.
    measured["device"] = "NVIDIA H100 80GB HBM3"
    out.write_text(json.dumps(measured))
    res = subprocess.run(
        [sys.executable, str(BENCH / "gpu_train_compare.py"), str(out), "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    cmp = json.loads(res.stdout)
    assert cmp["every_run_predicted_to_fit"] is True
    assert [r["model"] for r in cmp["rows"]] == ["tiny-a", "tiny-b"]


def test_gpu_check_runs_its_checks_and_reports_a_missing_gpu(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py (every GPU check in one run) works before a GPU machine gets it:
    each check in its own process, the JSON written after each, no CUDA said plainly."""
    out = tmp_path / "check.json"
    cmd = [
        sys.executable,
        str(BENCH / "gpu_check.py"),
        "--tiny",
        "--only",
        "env,nccl,gemms,hostside",
    ]
    res = subprocess.run([*cmd, "--json", "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result == json.loads(out.read_text())
    assert set(result) == {"env", "nccl", "gemms", "hostside"}
    assert result["env"]["cuda_available"] is False and result["env"]["torch"]
    assert result["nccl"]["skipped"] == "no CUDA device"
    assert result["gemms"]["skipped"] == "no CUDA device"
    host = result["hostside"]  # on the CPU: the codec's passes, no copy to price
    assert host["device"] == "cpu" and host["measured_ms"] > 0
    assert host["predicted_on_measured_ms"] > 0 and host["ratio_on_defaults"] > 0


@pytest.mark.integration
def test_the_runtime_and_decode_checks_report_what_they_measured_on_the_cpu() -> None:
    """gpu_check's runtime check (benchmarks/gpu_runtime.py) and decode check
    (benchmarks/gpu_decode.py) at their tiny size on the CPU, in one run: the pipeline's step
    beside plain torch's; decoding beside transformers' generate both as it runs by default and
    on the workers' attention backends; a token's time split, each ratio the ratio of its
    figures, and the ops with the most host time on each side."""
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--tiny", "--only", "runtime,decode"]
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    r, d = got["runtime"], got["decode"]
    assert "error" not in r and "error" not in d, got
    t, i = r["train"], r["infer"]
    assert t["ratio"] == t["dmsc_pp2_step_s"] / t["torch_step_s"]
    dmsc = i["dmsc_tokens_per_s"]
    assert i["vs_transformers_ratio"] == pytest.approx(dmsc / i["transformers_tokens_per_s"])
    same = i["transformers_same_backends_tokens_per_s"]
    assert i["vs_transformers_same_backends_ratio"] == pytest.approx(dmsc / same)
    assert i["same_first_tokens"] == 8  # float32 on the CPU: the same greedy tokens
    times = [k for k in d if k.endswith("_ms")]
    assert len(times) == 8 and all(d[k] > 0 for k in times)
    assert d["service_over_forward"] == d["dmsc_service_ms"] / d["dmsc_forward_ms"]
    assert d["service_over_hf_generate"] == d["dmsc_service_ms"] / d["hf_generate_ms"]
    assert [s["stage"] for s in d["service_stages"]] == [0, 1]
    for s in d["service_stages"]:  # one inference step a token at each stage
        assert s["steps_a_token"] == 1 and 0 < s["compute_ms_a_token"] <= s["step_ms_a_token"]
    for who in ("dmsc", "hf"):
        ops = d[f"profile_{who}"]
        assert ops and all(row["calls_a_token"] > 0 for row in ops)
        assert any(row["op"] == "aten::mm" for row in ops)


@pytest.mark.integration
def test_the_tp_check_runs_the_tensor_parallel_path_on_one_device() -> None:
    """gpu_check's tp check (benchmarks/gpu_tp_path.py) on the CPU at its tiny size: the
    runtime's split stages over a one-rank group train as the stages whole do, each side
    timed, the tensor-parallel calls counted (a lent GPU runs the same over NCCL)."""
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--tiny", "--only", "tp", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    tp = json.loads(res.stdout)["tp"]
    assert "error" not in tp, tp
    assert (tp["backend"], tp["world_size"], tp["device"]) == ("gloo", 1, "cpu")
    assert [c["case"] for c in tp["cases"]] == ["gpt-mini", "moe-mini"]
    for c in tp["cases"]:
        assert c["max_loss_diff"] < 1e-5 and c["first_step_max_grad_diff"] < 1e-6, c
        assert c["split_over_whole"] == c["split_step_s"] / c["whole_step_s"]
        assert c["tp_calls_per_step"] > 0  # every collective of the path ran
