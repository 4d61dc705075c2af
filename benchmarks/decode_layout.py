"""Decoding with a stage's weights as built against laid out for decoding, in one process.

The model of ``benchmarks/inference.py`` (Llama-style, 8 layers, hidden 512, vocabulary 8192,
random weights, saved as a Hugging Face checkpoint) is read into its two dmsc stage modules, and
greedy decoding of ``--tokens`` tokens after a 32-token prompt, each stage keeping its keys and
values, runs three ways in turn over ``--rounds`` rounds (one thread each; the median of each):
the stages' weights as built (row-major), the same stages after
:class:`dmsc.runtime.compute.decode_layout.DecodeLayout` laid them out (as a CPU worker does at
its first decoding step), and ``transformers``' model in a loop with its own cache. No process
boundary and no gRPC: what the layout changes, alone.

Prints a table, or with --json one object: ms_per_token (per path), layout_speedup (as built
over laid out), vs_transformers (transformers' time over each dmsc path's), layout (the shapes
chosen, with their timings), same_tokens (all three paths chose the same tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from inference import PROMPT, _checkpoint

from dmsc.runtime.compute.decode_layout import DecodeLayout
from dmsc.runtime.compute.models.attention import StageCache
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.spec import TransformerSpec, resolve_model


def _dmsc(stages: list[Any], prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    caches = [StageCache() for _ in stages]

    def run(x: torch.Tensor, start: int) -> torch.Tensor:
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, cache, start)
        return x[:, -1].argmax(-1, keepdim=True)

    with torch.no_grad():
        token, at, out = run(prompt, 0), prompt.shape[1], []
        t0 = time.perf_counter()
        for _ in range(tokens):
            out.append(int(token))
            token = run(token, at)
            at += 1
        return (time.perf_counter() - t0) / tokens, out


def _transformers(model: Any, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    with torch.no_grad():
        first = model(prompt, use_cache=True)
        past, token, out = first.past_key_values, first.logits[:, -1].argmax(-1, keepdim=True), []
        t0 = time.perf_counter()
        for _ in range(tokens):
            out.append(int(token))
            step = model(token, past_key_values=past, use_cache=True)
            past, token = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / tokens, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a stage worker runs
    import transformers

    with tempfile.TemporaryDirectory(prefix="dmsc-bench-") as tmp:
        ckpt = Path(tmp) / "llama"
        _checkpoint(ckpt)
        spec = resolve_model(f"hf:{ckpt}", {"seq": 512})
        assert isinstance(spec, TransformerSpec)
        built = [
            stage_module(spec, 0, "embedding", "block_3").eval(),
            stage_module(spec, 0, "block_4", "head").eval(),
        ]
        laid = [
            stage_module(spec, 0, "embedding", "block_3").eval(),
            stage_module(spec, 0, "block_4", "head").eval(),
        ]
        layouts = [DecodeLayout(stage) for stage in laid]
        for layout in layouts:
            layout.use(decode=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    prompt = torch.randint(0, spec.vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    paths = {
        "as_built": lambda: _dmsc(built, prompt, args.tokens),
        "laid_out": lambda: _dmsc(laid, prompt, args.tokens),
        "transformers": lambda: _transformers(model, prompt, args.tokens),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    chosen: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, run in paths.items():
            took, chosen[name] = run()
            times[name].append(took)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {
        "model": "llama 8 x 512 (vocab 8192), 2 stages in one process, 1 thread",
        "prompt_tokens": PROMPT,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "ms_per_token": ms,
        "ms_per_token_by_round": {k: [t * 1e3 for t in v] for k, v in times.items()},
        "layout_speedup": ms["as_built"] / ms["laid_out"],
        "vs_transformers": {k: ms["transformers"] / ms[k] for k in ("as_built", "laid_out")},
        "layout": [f"stage {i}: {lay.describe()}" for i, lay in enumerate(layouts)],
        "same_tokens": chosen["as_built"] == chosen["laid_out"] == chosen["transformers"],
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['model']}, {PROMPT}-token prompt, {args.tokens} tokens greedy, median of "
          f"{args.rounds} alternated rounds")  # fmt: skip
    print(f"{'path':<16}{'ms/token':>10}{'transformers / path':>22}")
    for k, v in ms.items():
        print(f"{k:<16}{v:>10.2f}{ms['transformers'] / v:>22.2f}")
    print(f"laid out for decoding: {out['layout_speedup']:.2f}x as built")
    for line in out["layout"]:
        print(line)
    print(f"same tokens on every path: {out['same_tokens']}")


if __name__ == "__main__":
    main()
