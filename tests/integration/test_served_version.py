"""Which model version serves: one record of what every replica holds (by checkpoint hash), and
every view of it (the models list's record, the answers' ``model_version``, the log, ``dmsc
export``) checked against the weights themselves: greedy tokens equal those ``transformers``
draws from the version exported."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from runtime_helpers import control_plane, local_plan

from dmsc.runtime.control.serving.held import holding
from dmsc.runtime.control.serving.model_store import export_version, promote, versions
from dmsc.runtime.transport.messages import InferRequest, TrainRequest

pytestmark = pytest.mark.integration

PROMPT, TOKENS = "def ", 8


def greedy_reference(db: object, version: int, out: Path) -> list[int]:
    """The tokens ``transformers`` draws greedily from ``version``, exported."""
    import transformers

    export_version(db, version, out)  # type: ignore[arg-type]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        got = model.generate(
            prompt, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0
        )
    return list(got[0, prompt.shape[1] :].tolist())


def digests_of(db: object, version: int) -> dict[int, str]:
    v = next(v for v in versions(db) if v.id == version)  # type: ignore[arg-type]
    files = json.loads(v.metrics_json)
    return {s: files[str(Path(v.path) / f"stage{s}.safetensors")] for s in (0, 1)}


def test_every_view_of_the_served_version_agrees_with_the_weights(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "mine.txt"
    data.write_text("def finetune(x):\n    return x * 2\n" * 400)
    greedy = InferRequest(prompt=PROMPT, tokens=TOKENS, temperature=0.0)
    with control_plane(local_plan(), tmp_path) as cp:
        cp.log.propagate = True
        v1 = cp.train(TrainRequest(steps=3, lr=3e-3))["model_version"]  # the first: production
        cp.inference.sync_versions()
        v2 = cp.train(TrainRequest(steps=3, lr=3e-3))["model_version"]  # a candidate
        # training changed the replica's weights: until they are loaded again, no version holds
        # them, and no answer says one does
        assert cp.infer(greedy)["model_version"] is None
        assert holding(cp.db, cp.run.id)["replica-0"].version is None
        with caplog.at_level(logging.INFO, logger="dmsc.control"):
            cp.inference.sync_versions()
        assert f"replica 0 serves version {v1}" in caplog.text
        ref1 = greedy_reference(cp.db, v1, tmp_path / "v1")
        out = cp.infer(greedy)
        assert out["model_version"] == v1 and out["token_ids"] == ref1
        held = holding(cp.db, cp.run.id)["replica-0"]
        assert held.version == v1 and held.digests == digests_of(cp.db, v1)

        promote(cp.db, v2)
        cp.inference.sync_versions()
        ref2 = greedy_reference(cp.db, v2, tmp_path / "v2")
        out = cp.infer(greedy)
        assert out["model_version"] == v2 and out["token_ids"] == ref2
        assert holding(cp.db, cp.run.id)["replica-0"].digests == digests_of(cp.db, v2)

        # the README's fine-tune: trained on its own text, from the run's newest weights (v2's,
        # which serve); exported by default, and served once promoted
        v3 = cp.train(TrainRequest(steps=3, lr=3e-3, data=str(data)))["model_version"]
        cp.inference.sync_versions()
        out = cp.infer(greedy)
        assert out["model_version"] == v2 and out["token_ids"] == ref2
        exported = export_version(cp.db, None, tmp_path / "my-finetune")
        assert exported.id == v3
        promote(cp.db, v3)
        cp.inference.sync_versions()
        ref3 = greedy_reference(cp.db, v3, tmp_path / "v3")
        out = cp.infer(greedy)
        assert out["model_version"] == v3 and out["token_ids"] == ref3
        assert holding(cp.db, cp.run.id)["replica-0"].digests == digests_of(cp.db, v3)
        listed = models_list(tmp_path)
        assert listed[v3][-1] == "replica-0" and listed[v3][4] == "production"
        assert all(row[-1] == "" for v, row in listed.items() if v != v3)

        # training goes on from the run's newest weights (v3's), not from what serves (v1)
        promote(cp.db, v1)
        cp.inference.sync_versions()
        assert cp.infer(greedy)["token_ids"] == ref1
        v4 = cp.train(TrainRequest(steps=1, lr=1e-9))["model_version"]
        cp.inference.sync_versions()
        assert holding(cp.db, cp.run.id)["replica-0"].version == v1
        assert cp.infer(greedy)["token_ids"] == ref1
        w1, w3, w4 = (weights(cp.db, v) for v in (v1, v3, v4))
        assert all(torch.allclose(w4[k], w3[k], atol=1e-6) for k in w3)
        assert not all(torch.allclose(w4[k], w1[k], atol=1e-6) for k in w1)


def models_list(home: Path) -> dict[int, list[str]]:
    """``dmsc models list``'s rows by version (cells stripped)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DMSC_HOME": str(home), "COLUMNS": "200"}
    res = subprocess.run(
        [sys.executable, "-m", "dmsc", "models", "list"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines()]
    return {int(r[0]): r for r in rows if r and r[0].isdigit()}


def weights(db: object, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    v = next(v for v in versions(db) if v.id == version)  # type: ignore[arg-type]
    return load_file(str(Path(v.path) / "stage0.safetensors"))
