"""Measure GEMMs, a memory copy and a transformer block on a GPU (needs only PyTorch).

Runs on a machine with an accelerator and writes one JSON object (to stdout, or --out FILE):
the device's name, SM count and memory, and the median time of each case. It imports nothing
of dmsc, so it runs where only PyTorch is installed; ``gpu_compare.py`` then puts the figures
beside the cost model's predictions. Cases: the GEMMs one tensor-parallel rank runs for GPT-3 175B
and Llama 3 70B (tp=8, one 2048/8192-token micro-batch), square GEMMs, a device-to-device copy,
and the forward and backward of one GPT block with plain (unfused) attention.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

import torch


def _median_ms(fn: Any, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_cases() -> list[dict[str, int | str]]:
    cases: list[dict[str, int | str]] = []
    for name, T, h, f, kvw, t in (
        ("gpt3-175b", 2048, 12288, 49152, 12288, 8),
        ("llama3-70b", 8192, 8192, 28672, 1024, 8),
    ):
        cases += [
            {"name": f"{name} qkv", "m": T, "n": (h + 2 * kvw) // t, "k": h, "batch": 1},
            {"name": f"{name} proj", "m": T, "n": h, "k": h // t, "batch": 1},
            {"name": f"{name} fc1", "m": T, "n": f // t, "k": h, "batch": 1},
            {"name": f"{name} fc2", "m": T, "n": h, "k": f // t, "batch": 1},
        ]
    cases.append({"name": "gpt3-175b scores", "m": 2048, "n": 2048, "k": 128, "batch": 12})
    for n in (1024, 4096, 8192):
        cases.append({"name": f"square {n}", "m": n, "n": n, "k": n, "batch": 1})
    return cases


def measure_gemm(case: dict[str, Any], dtype: torch.dtype) -> float:
    b, m, n, k = case["batch"], case["m"], case["n"], case["k"]
    a = torch.randn(b, m, k, device="cuda", dtype=dtype)
    w = torch.randn(b, k, n, device="cuda", dtype=dtype)
    if b == 1:
        a2, w2 = a[0], w[0]
        return _median_ms(lambda: torch.matmul(a2, w2))
    return _median_ms(lambda: torch.bmm(a, w))


class Block(torch.nn.Module):
    """A GPT block as Megatron-LM ran it in 2021: LayerNorm, unfused attention, GeLU MLP."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.h, self.heads = h, heads
        self.ln1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.ln2 = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        d = H // self.heads
        q, k, v = self.qkv(self.ln1(x_BSH)).split(H, dim=-1)
        q = q.view(B, S, self.heads, d).transpose(1, 2)
        k = k.view(B, S, self.heads, d).transpose(1, 2)
        v = v.view(B, S, self.heads, d).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        mask = torch.ones(S, S, device=x_BSH.device, dtype=torch.bool).triu(1)
        probs = self.drop(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1))
        att = (probs @ v).transpose(1, 2).reshape(B, S, H)
        x_BSH = x_BSH + self.drop(self.proj(att))
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x_BSH))))
        return x_BSH + self.drop(y)


def measure_block(h: int, heads: int, seq: int, batch: int, dtype: torch.dtype) -> dict[str, float]:
    block = Block(h, heads).to(device="cuda", dtype=dtype)
    x = torch.randn(batch, seq, h, device="cuda", dtype=dtype, requires_grad=True)
    fwd = _median_ms(lambda: block(x))
    out = block(x)
    grad = torch.randn_like(out)

    def fwd_bwd() -> None:
        block(x).backward(grad)

    both = _median_ms(fwd_bwd)
    return {
        "h": h,
        "heads": heads,
        "seq": seq,
        "batch": batch,
        "forward_ms": fwd,
        "forward_backward_ms": both,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    props = torch.cuda.get_device_properties(0)
    dtype = torch.bfloat16
    result: dict[str, Any] = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "memory_gib": props.total_memory / 1024**3,
        "torch": torch.__version__,
        "dtype": "bf16",
        "gemms": [],
    }
    for case in gemm_cases():
        result["gemms"].append({**case, "ms": measure_gemm(case, dtype)})
    n = 1 << 30  # 1 GiB copy: reads and writes 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    result["copy"] = {"bytes_moved": 2 * n, "ms": _median_ms(lambda: dst.copy_(src))}
    result["blocks"] = [
        measure_block(4096, 32, 2048, 1, dtype),
        measure_block(8192, 64, 2048, 1, dtype),
    ]
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
