"""Train GPT-3-shaped models on one GPU in plain PyTorch and measure step time and peak memory.

Issue 13's GPU check, as one prepared run (needs only PyTorch, imports nothing of dmsc, so it
runs on a lent GPU machine as is): GPT-3 350M to 2.7B (shapes of dmsc's presets, sequence 2048,
vocabulary 50257, tied embeddings), bf16 autocast, PyTorch's scaled-dot-product (flash)
attention, fused AdamW. For each model and micro-batch it times ``--steps`` optimizer steps after
``--warmup`` ones and reads ``torch.cuda.max_memory_allocated``; a configuration that runs out of
memory is recorded as such. Writes one JSON object (stdout, or ``--out``);
``gpu_train_compare.py`` puts it beside ``dmsc estimate`` on a one-GPU cluster of that device.
``--tiny`` runs two small models on whatever device there is (CPU included) in seconds, to check
the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# name: (layers, hidden, heads), as dmsc.spec.presets (a test keeps them equal)
MODELS: dict[str, tuple[int, int, int]] = {
    "gpt3-350m": (24, 1024, 16),
    "gpt3-760m": (24, 1536, 16),
    "gpt3-1.3b": (24, 2048, 16),
    "gpt3-2.7b": (32, 2560, 32),
}
TINY: dict[str, tuple[int, int, int]] = {"tiny-a": (2, 64, 4), "tiny-b": (2, 128, 4)}
SEQ, VOCAB = 2048, 50257


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()  # tied output layer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train(shape: tuple[int, int, int], mb: int, seq: int, vocab: int, args: Any) -> dict[str, Any]:
    device = torch.device(args.device)
    layers, h, heads = shape
    model = GPT(layers, h, heads, seq, vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    idx = torch.randint(0, vocab, (mb, seq), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(idx)
            loss = F.cross_entropy(logits.view(-1, vocab), idx.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    _sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "step_ms": statistics.median(times) * 1e3,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def measure(
    name: str, shape: tuple[int, int, int], mb: int, seq: int, vocab: int, args: Any
) -> dict[str, Any]:
    cuda = torch.device(args.device).type == "cuda"
    layers, h, heads = shape
    row: dict[str, Any] = {"model": name, "layers": layers, "hidden": h, "heads": heads}
    row |= {"seq": seq, "vocab": vocab, "micro_batch": mb}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        row |= _train(shape, mb, seq, vocab, args)
        row["status"] = "ok"
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--micro-batches", default="1,4,8", help="comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="two small models, seconds")
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    # as dmsc's GPU workers run (read at the allocator's first use, after this line)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    models, seq, vocab = (TINY, 64, 256) if args.tiny else (MODELS, SEQ, VOCAB)
    device = torch.device(args.device)
    info: dict[str, Any] = {"torch": torch.__version__, "device_type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "device": props.name,
            "memory_gib": props.total_memory / 2**30,
            "sm_count": props.multi_processor_count,
        }
    else:
        info["device"] = "cpu"
    rows = []
    t0 = time.perf_counter()
    for name, shape in models.items():
        for mb in (int(x) for x in args.micro_batches.split(",")):
            rows.append(measure(name, shape, mb, seq, vocab, args))
            if rows[-1]["status"] == "oom":
                break  # larger micro-batches will not fit either
    info["rows"] = rows
    info["wall_s"] = math.ceil(time.perf_counter() - t0)
    text = json.dumps(info, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
