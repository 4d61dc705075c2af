"""Where a decoding token's time goes on a GPU: dmsc's 2-stage service against the same model's
forward in one process, and against ``transformers`` (issue 31's decoding goal).

``gpu_runtime.py`` measured dmsc's KV-cache decoding at 0.46-0.49 of ``transformers``' tokens a
second on an H200, both bound by the host's time issuing kernels (a 345M model's token is a few
hundred kernels). This splits a token's time into what the model's forward costs in one process
and what the service adds (two worker processes, gRPC, the relay between the stages, the
sampling), each beside ``transformers``:

- ``hf_forward_ms``: ``transformers``' model (bf16 weights) one token's forward with its
  ``DynamicCache``, no ``generate`` around it;
- ``hf_generate_ms``: a token of ``generate`` (greedy);
- ``dmsc_forward_ms``: the same model as one dmsc stage module in this process, one token's
  forward over its session cache under bf16 autocast with :class:`DecodeCasts`, as a GPU worker
  runs it;
- ``dmsc_forward_bf16_ms``: that module held in bf16, no autocast (as ``transformers`` holds it);
- ``dmsc_forward_inference_mode_ms``: the first under ``torch.inference_mode`` instead of
  ``no_grad``;
- ``dmsc_service_ms``: a token of ``Deployment.generate`` over 2 stage workers on the device;
  ``service_stages``: each worker's inference steps a token, the milliseconds a token they
  took and the milliseconds of them computing (the workers' Prometheus metrics).

Each is the median of ``--tokens`` tokens, synchronised per token. ``profile`` lists the ops
with the most host time in a dmsc and a ``transformers`` token (``torch.profiler``, CPU side).
Prints a table, or with ``--json`` one object with the same figures (``--out`` also writes it).
``--tiny`` runs a small model (on the CPU with ``--device cpu``) to check the script.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from gpu_runtime import PROMPT, SHAPES, _checkpoint, emit, gpu_parser, two_stages

from dmsc.runtime.compute.decode_weights import DecodeCasts
from dmsc.runtime.compute.models.attention import StageCache, inference_attention
from dmsc.runtime.compute.models.chain import layer_names
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.control.launch.deployment import Deployment
from dmsc.runtime.transport.messages import Sampling


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_token(device: torch.device, step: Callable[[], None], tokens: int) -> float:
    """Median milliseconds of ``step`` (one token), after 3 unmeasured."""
    times = []
    for i in range(tokens + 3):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _worker_metrics(dep: Deployment) -> list[tuple[float, float, float]]:
    """Each stage worker's (inference steps, their seconds, compute seconds) so far, from its
    Prometheus endpoint: what a token's time is inside the workers' steps."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for h in sorted(dep.health(), key=lambda h: h["stage"]):
        got = {"count": 0.0, "sum": 0.0, "compute": 0.0}
        text = urlopen(f"http://{h['metrics']}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "dmsc_worker_compute_seconds_total":
                    got["compute"] = sample.value
                elif sample.labels.get("mode") == "infer" and sample.name.startswith(
                    "dmsc_worker_step_seconds_"
                ):
                    got[sample.name.rsplit("_", 1)[1]] = sample.value
        out.append((got["count"], got["sum"], got["compute"]))
    return out


def _top_ops(step: Callable[[], None], n: int = 12) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "calls_a_token": e.count / 5,
            "self_us_a_token": e.self_cpu_time_total / 5,
        }
        for e in rows[:n]
    ]


def dmsc_forward(
    spec: Any, device: torch.device, mode: str, prompt: torch.Tensor
) -> Callable[[], None]:
    """One token's forward of the whole model as one stage module, continuing a session, as a
    worker runs it now (``mode`` "worker": bf16 autocast with its casts, no cuDNN attention) or
    as it ran before (``cudnn``), or held in bf16 without autocast (``bf16``), or under
    ``torch.inference_mode`` (``inference_mode``)."""
    names = layer_names(spec)
    module = stage_module(spec, 0, names[0], names[-1]).to(device).eval()
    gpu = device.type == "cuda"
    autocast = torch.bfloat16 if gpu and mode != "bf16" else None
    if mode == "bf16":
        module = module.to(torch.bfloat16 if gpu else torch.float32)
    casts = DecodeCasts(module, autocast) if autocast is not None else None
    grad = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    state = {"cache": StageCache(), "pos": 0}
    x = prompt[None].to(device)

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        with (
            casts.applied() if casts is not None else contextlib.nullcontext(),
            contextlib.nullcontext() if mode == "cudnn" else inference_attention(device),
            grad(),
            torch.autocast(device.type, autocast or torch.float32, enabled=autocast is not None),
        ):
            yield

    def step() -> None:
        if state["pos"] == 0 or state["pos"] >= spec.seq - 1:
            state["cache"], state["pos"] = StageCache(), 0
            with ctx():
                module(x, state["cache"], 0)
            state["pos"] = x.shape[1]
        with ctx():
            y = module(x[:, -1:], state["cache"], state["pos"])
            int(y[0, -1].argmax())  # the token drawn: one sync, as a worker's draw
        state["pos"] += 1

    return step


def hf_forward(
    model: Any, device: torch.device, prompt: torch.Tensor, cudnn: bool
) -> Callable[[], None]:
    """One token's forward of ``transformers``' model with its ``DynamicCache``; without
    ``cudnn``, under the same choice of attention backends as dmsc's workers."""
    import transformers

    x = prompt[None].to(device)
    state: dict[str, Any] = {"cache": None, "pos": 0}

    def step() -> None:
        with (
            torch.no_grad(),
            contextlib.nullcontext() if cudnn else inference_attention(device),
        ):
            if state["cache"] is None or state["pos"] >= 200:
                state["cache"] = transformers.DynamicCache()
                model(x, past_key_values=state["cache"], use_cache=True)
                state["pos"] = 0
            out = model(x[:, -1:], past_key_values=state["cache"], use_cache=True)
            int(out.logits[0, -1].argmax())
        state["pos"] += 1

    return step


def main() -> None:
    parser = gpu_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = "tiny" if args.tiny else "llama-345m"
    out: dict[str, Any] = {"model": name, "tokens": args.tokens, "prompt": PROMPT}
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="dmsc-decode-") as tmp:
        home = Path(tmp)
        spec, _ = _checkpoint(SHAPES[name], home / "ckpt")
        g = torch.Generator().manual_seed(1)
        # each measurement its own prompt length, so that no shape one saw is new to the next:
        # cuDNN's attention keeps the graphs it built, per shape, for the process's lifetime
        stride = 0 if args.tiny else 64
        prompts = [
            torch.randint(0, spec.vocab, (PROMPT + stride * k,), generator=g) for k in range(8)
        ]
        import transformers

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(home / "ckpt", dtype=dtype)
        model = model.to(device).eval()
        hf_cudnn = hf_forward(model, device, prompts[0], cudnn=True)
        out["hf_forward_cudnn_ms"] = _per_token(device, hf_cudnn, args.tokens)
        hf_step = hf_forward(model, device, prompts[1], cudnn=False)
        out["hf_forward_ms"] = _per_token(device, hf_step, args.tokens)
        x = prompts[2][None].to(device)
        with torch.no_grad():
            model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
            _sync(device)
            t0 = time.perf_counter()
            n = args.tokens
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            _sync(device)
        out["hf_generate_ms"] = (time.perf_counter() - t0) / n * 1e3
        out["profile_hf"] = _top_ops(hf_step)
        del model, hf_step, hf_cudnn
        for k, mode in enumerate(("worker", "cudnn", "bf16", "inference_mode"), start=3):
            step = dmsc_forward(spec, device, mode, prompts[k])
            key = {"worker": "dmsc_forward_ms"}.get(mode, f"dmsc_forward_{mode}_ms")
            out[key] = _per_token(device, step, args.tokens)
            if mode == "worker":
                out["profile_dmsc"] = _top_ops(step)
            del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
        layout = two_stages(spec, args.device)
        greedy = Sampling(temperature=0)
        ids = prompts[7].tolist()
        with Deployment(layout, home=home / "dep") as dep:
            dep.generate(ids, 4, sampling=greedy)
            before = _worker_metrics(dep)
            t0 = time.perf_counter()
            dep.generate(ids, args.tokens, sampling=greedy)
            out["dmsc_service_ms"] = (time.perf_counter() - t0) / args.tokens * 1e3
            after = _worker_metrics(dep)
        out["service_stages"] = [
            {
                "stage": stage,
                "steps_a_token": (a[0] - b[0]) / args.tokens,
                "step_ms_a_token": (a[1] - b[1]) / args.tokens * 1e3,
                "compute_ms_a_token": (a[2] - b[2]) / args.tokens * 1e3,
            }
            for stage, (b, a) in enumerate(zip(before, after, strict=True))
        ]
    out["service_over_forward"] = out["dmsc_service_ms"] / out["dmsc_forward_ms"]
    out["service_over_hf_generate"] = out["dmsc_service_ms"] / out["hf_generate_ms"]
    if emit(out, args):
        return
    print(f"{name} on {out['device']}: ms a token (median of {args.tokens}, prompts from {PROMPT})")
    for key in ("hf_forward_cudnn_ms", "hf_forward_ms", "hf_generate_ms", "dmsc_forward_ms",
                "dmsc_forward_cudnn_ms", "dmsc_forward_bf16_ms", "dmsc_forward_inference_mode_ms",
                "dmsc_service_ms"):  # fmt: skip
        print(f"  {key:34s} {out[key]:9.2f}")
    for row in out["service_stages"]:
        print(
            f"  stage {row['stage']}: {row['steps_a_token']:.2f} steps a token, "
            f"{row['step_ms_a_token']:.2f} ms in them, {row['compute_ms_a_token']:.2f} computing"
        )
    for who in ("dmsc", "hf"):
        print(f"host time by op, {who} (us a token, calls a token):")
        for row in out[f"profile_{who}"]:
            print(
                f"  {row['op'][:46]:46s} {row['self_us_a_token']:9.1f} {row['calls_a_token']:6.0f}"
            )


if __name__ == "__main__":
    main()
