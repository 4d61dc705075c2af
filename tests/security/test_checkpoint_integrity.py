"""A Hugging Face checkpoint cannot be walked around its integrity check (issue 29, item 14): the
plan's SHA-256 covers every file the runtime loads (the shard index too), an index cannot name a
file outside the directory, and a checkpoint the workers would refuse (a bad ``config.json``, a
pickle-only directory, a safetensors header whose shape does not fit its bytes) is refused when
planning, as one line with exit 2."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import run_dmsc
from safetensors.torch import save_file

from dmsc.runtime.compute.models.hf import CheckpointError, SafetensorsDir
from dmsc.spec import SpecError
from dmsc.spec.hf import checkpoint_files, checkpoint_sha256, hf_document

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _sharded(directory: Path) -> Path:
    """A two-shard checkpoint with an index (the weights are not a model: only files matter)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    save_file({"a": torch.ones(4)}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(directory / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_the_hash_covers_the_index_and_every_file_it_names(tmp_path: Path) -> None:
    ckpt = _sharded(tmp_path / "ckpt")
    names = [p.name for p in checkpoint_files(ckpt)]
    assert names == [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    before = checkpoint_sha256(ckpt)
    # the same files, the tensors' homes swapped in the index: another model
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["a"], index["weight_map"]["b"] = (
        index["weight_map"]["b"],
        index["weight_map"]["a"],
    )
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_sha256(ckpt) != before


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/tmp/model.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path: Path, name: str) -> None:
    ckpt = _sharded(tmp_path / "ckpt")
    (tmp_path / "other").mkdir()
    save_file({"b": torch.full((4,), 9.0)}, str(tmp_path / "other" / "model.safetensors"))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = name
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SpecError, match=r"weight_map\.b: .* is not a \.safetensors file name"):
        checkpoint_sha256(ckpt)
    # and the runtime, loading it, refuses it too (it never reads the other file)
    with pytest.raises(CheckpointError, match=r"weight_map\.b"):
        SafetensorsDir(ckpt)


def test_a_shard_that_links_outside_the_directory_is_refused(tmp_path: Path) -> None:
    ckpt = _sharded(tmp_path / "ckpt")
    (tmp_path / "other").mkdir()
    save_file({"b": torch.full((4,), 9.0)}, str(tmp_path / "other" / "model.safetensors"))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    (ckpt / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "other/model.safetensors")
    with pytest.raises(SpecError, match="outside"):
        checkpoint_sha256(ckpt)
    with pytest.raises(CheckpointError, match="outside"):
        list(SafetensorsDir(ckpt).read(["b"]))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"hidden_size": "abc"}, "hidden_size: 'abc' is not a whole number"),
        ({"num_attention_heads": 0}, "num_attention_heads: 0 must be at least 1"),
        ({"max_position_embeddings": 1.5}, "max_position_embeddings: 1.5 is not a whole number"),
        (
            {"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0}},
            "rope_scaling.factor: missing",
        ),
        ({"rope_scaling": "big"}, "rope_scaling: 'big' is not a mapping"),
        ({"rope_theta": "x"}, "rope_theta: 'x' is not a positive number"),
    ],
)
def test_a_bad_config_is_a_spec_error(tmp_path: Path, change: dict, reason: str) -> None:  # type: ignore[type-arg]
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **change}))
    with pytest.raises(SpecError, match=reason.replace(".", r"\.")):
        hf_document(f"hf:{tmp_path}")


def _header_file(path: Path, header: dict) -> None:  # type: ignore[type-arg]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("config", "hidden_size: 'abc' is not a whole number"),
        ("rope", "rope_scaling.factor: missing"),
        ("pickle", "pytorch_model.bin: pickle checkpoints are not loaded"),
        ("huge", "needs 18,446,744,073,709,551,616 bytes"),
    ],
)
def test_dmsc_plan_refuses_a_checkpoint_the_workers_would_refuse(
    tmp_path: Path, setup: str, reason: str
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = dict(CONFIG)
    if setup == "config":
        config["hidden_size"] = "abc"
    if setup == "rope":
        config["rope_scaling"] = {"rope_type": "llama3", "low_freq_factor": 1.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    if setup == "pickle":
        torch.save({"a": torch.ones(2)}, ckpt / "pytorch_model.bin")
    elif setup == "huge":
        big = {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 8]}
        _header_file(ckpt / "model.safetensors", {"model.embed_tokens.weight": big})
    else:
        save_file({"a": torch.ones(4)}, str(ckpt / "model.safetensors"))
    res = run_dmsc(
        "plan",
        "--cluster",
        str(ROOT / "examples/clusters/local-cpu.yaml"),
        "--model",
        f"hf:{ckpt}",
        "--out",
        str(tmp_path / "plan.json"),
        home=tmp_path,
        timeout=600,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and reason in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
