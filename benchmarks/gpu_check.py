"""Every GPU measurement dmsc has, as one prepared run for a lent GPU machine (under 5 minutes).

GPU time is scarce and lent by chance, so this one script runs each check in its own process with
its own time limit, and writes what it has after each (``--out``), so a check that breaks or runs
long costs only itself. The checks:

1. **env**: the device, torch, CUDA and NCCL versions, dmsc's version.
2. **nccl**: an NCCL process group on the one GPU (world size 1: one GPU cannot hold two NCCL
   ranks), an all-reduce and a broadcast checked for their values and timed; and the runtime's
   modules that form a process group or name NCCL (a tensor-parallel group is NCCL's on CUDA,
   but ``dmsc up`` refuses tp > 1 on GPUs: a plan names one GPU a replica, not one a rank; the
   data-parallel collective is gloo's on the host; the pipeline's sends go through host memory).
3. **train**: ``gpu_train_measure.py`` (GPT-3 350M to 2.7B trained in plain PyTorch on the GPU)
   beside ``dmsc estimate`` of the same model and micro-batch (``gpu_train_compare.py``).
4. **runtime**: ``gpu_runtime.py``: dmsc pp=2 on the GPU against plain PyTorch, KV-cache decoding
   against ``transformers``, ``dmsc calibrate --device cuda`` and its prediction of the step.
5. **gemms**: ``gpu_measure.py``'s GEMMs, copy and block beside the cost model
   (``gpu_compare.py``).
6. **hostside** (run third): a codec's exchange work as the runtime runs it off the GPU (the
   gradient copied down, int8 encoded and decoded on one host thread, copied back) against the
   cost model's price of it on the host figures ``dmsc calibrate --device cuda`` measures and
   on its defaults (:mod:`dmsc.netmodel.sync`'s host side; never run on a GPU yet).
7. **tp**: ``gpu_tp_path.py``: the runtime's tensor-parallel code path on the one device (its
   split stages over a one-rank NCCL group: every family, sequence parallelism, a mixture's
   experts) beside the same stages whole: the losses and gradients against each other, the
   step times, the calls.
8. **decode** (run last): ``gpu_decode.py``: a decoding token's time split into the model's
   forward in one process and what the 2-stage service adds, each beside ``transformers``, and
   the ops with the most host time in each.

Prints a table, or with ``--json`` one object with the same figures. ``--tiny`` runs the same
checks small on whatever device there is (the CPU included, where the NCCL check reports it has
no CUDA) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _env() -> dict[str, Any]:
    from importlib.metadata import version

    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "dmsc": version("dmsc"),
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {
            "device": props.name,
            "sm_count": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
            "capability": list(torch.cuda.get_device_capability(0)),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
        }
        # the host's cost of one kernel launch: small models on a slow host are bound by it
        x = torch.zeros(16, device="cuda")
        for _ in range(100):
            x.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5000):
            x.add_(1)
        torch.cuda.synchronize()
        out["launch_us"] = (time.perf_counter() - t0) / 5000 * 1e6
    return out


def _nccl() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"nccl_available": dist.is_nccl_available()}
    if not torch.cuda.is_available():
        out["skipped"] = "no CUDA device"
        return out
    device = torch.device("cuda:0")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=device)
        try:
            for mib in (1, 64, 256):
                x = torch.full((mib * 2**20 // 2,), 1.5, dtype=torch.bfloat16, device=device)
                dist.all_reduce(x)
                dist.broadcast(x, src=0)
                torch.cuda.synchronize()
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                ok = bool(torch.all(x == 1.5))
                out[f"allreduce_{mib}mib_ms"] = statistics.median(times) * 1e3
                out[f"allreduce_{mib}mib_correct"] = ok
        finally:
            dist.destroy_process_group()
    runtime = subprocess.run(
        ["grep", "-rlE", 'init_process_group|"nccl"', str(HERE.parent / "src" / "dmsc")],
        capture_output=True,
        text=True,
    ).stdout.split()
    out["runtime_nccl_modules"] = [str(Path(p).relative_to(HERE.parent)) for p in runtime]
    return out


def _hostside() -> dict[str, Any]:
    """A codec's exchange work as the runtime runs it off a GPU: the gradient copied to the
    host, int8-encoded and decoded there (one worker thread), the answer copied back; timed
    against the cost model's price of it (:func:`dmsc.netmodel.sync.work_s` of a leader's star
    among 2 replicas) on the host figures ``dmsc calibrate --device cuda`` measures and on the
    defaults it falls back to."""
    import torch

    from dmsc.netmodel import DEFAULT_CALIBRATION
    from dmsc.netmodel.codec_work import decode_bytes, encode_bytes
    from dmsc.netmodel.sync import HostSide
    from dmsc.runtime.compute.compression import make_codec
    from dmsc.runtime.compute.device_calibration import measure_host_side
    from dmsc.runtime.compute.host_memory import keep_freed_memory
    from dmsc.spec.sync_forms import parse_compress

    keep_freed_memory()  # as a worker
    torch.set_num_threads(1)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if gpu else "cpu")
    elements = (16 if gpu else 1) * 2**20
    grad = torch.randn(elements, device=device)
    codec = make_codec("int8", elements)

    def exchange() -> None:
        host = grad.cpu() if gpu else grad.clone()
        back = codec.decode(codec.encode(host), elements)  # a replica's part of the star
        grad.copy_(back)
        if gpu:
            torch.cuda.synchronize(device)

    for _ in range(2):
        exchange()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        exchange()
        times.append(time.perf_counter() - t0)
    measured = statistics.median(times)
    side = measure_host_side(device)
    int8 = parse_compress("int8")
    passes = elements * (encode_bytes(int8) + decode_bytes(int8))  # one encode, one decode
    gen = DEFAULT_CALIBRATION.generation("h100" if gpu else "generic")

    def price(h: HostSide) -> float:
        copies = 2 * 4 * elements / h.copy_bytes_s if gpu and h.copy_bytes_s else 0.0
        return passes / h.memory_bytes_s + copies

    on_measured = price(HostSide(side["memory_gbyte_s"] * 1e9, side["copy_gbyte_s"] * 1e9))
    on_defaults = price(HostSide(gen.host_memory_bytes_s, gen.host_copy_bytes_s))
    return {
        "device": str(device),
        "elements": elements,
        "measured_ms": measured * 1e3,
        "host_side": side,
        "predicted_on_measured_ms": on_measured * 1e3,
        "predicted_on_defaults_ms": on_defaults * 1e3,
        "ratio_on_measured": measured / on_measured,
        "ratio_on_defaults": measured / on_defaults,
    }


PARTS_INLINE = {"env": _env, "nccl": _nccl, "hostside": _hostside}


def _run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return 124, "", f"timed out after {timeout:.0f} s\n{err}"
    return res.returncode, res.stdout, res.stderr


def _tail(text: str, lines: int = 12) -> list[str]:
    return text.strip().splitlines()[-lines:]


def part(name: str, tiny: bool, timeout: float, tmp: Path) -> dict[str, Any]:
    py = sys.executable
    t0 = time.perf_counter()
    if name in PARTS_INLINE:
        rc, out, err = _run([py, __file__, "--part", name], timeout)
        result = json.loads(out) if rc == 0 else {"error": _tail(err)}
    elif name == "train":
        measured = tmp / "train.json"
        cmd = [py, str(HERE / "gpu_train_measure.py"), "--out", str(measured)]
        cmd += ["--tiny"] if tiny else ["--micro-batches", "1,4", "--warmup", "2", "--steps", "5"]
        rc, out, err = _run(cmd, timeout)
        if rc != 0:
            return {"error": _tail(err), "seconds": time.perf_counter() - t0}
        result = {"measured": json.loads(measured.read_text())}
        rc, out, err = _run([py, str(HERE / "gpu_train_compare.py"), str(measured), "--json"], 60)
        result["compare"] = json.loads(out) if rc == 0 else {"error": _tail(err)}
    elif name == "runtime":
        cmd = [py, str(HERE / "gpu_runtime.py"), "--json"]
        cmd += ["--tiny", "--device", "cpu" if not _has_cuda() else "cuda:0", "--steps", "2",
                "--tokens", "8"] if tiny else ["--steps", "8", "--tokens", "64"]  # fmt: skip
        rc, out, err = _run(cmd, timeout)
        result = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"error": _tail(err)}
    elif name == "tp":
        cmd = [py, str(HERE / "gpu_tp_path.py"), "--json"]
        cmd += ["--steps", "2", "--only", "gpt-mini,moe-mini"] if tiny else []
        rc, out, err = _run(cmd, timeout)
        result = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"error": _tail(err)}
    elif name == "decode":
        cmd = [py, str(HERE / "gpu_decode.py"), "--json"]
        cmd += (
            ["--tiny", "--device", "cpu" if not _has_cuda() else "cuda:0", "--tokens", "4"]
            if tiny
            else []
        )
        rc, out, err = _run(cmd, timeout)
        result = json.loads(out.strip().splitlines()[-1]) if rc == 0 else {"error": _tail(err)}
    elif name == "gemms":
        if not _has_cuda():
            return {"skipped": "no CUDA device"}
        measured = tmp / "gemms.json"
        rc, out, err = _run([py, str(HERE / "gpu_measure.py"), "--out", str(measured)], timeout)
        if rc != 0:
            return {"error": _tail(err), "seconds": time.perf_counter() - t0}
        result = {"measured": json.loads(measured.read_text())}
        rc, out, err = _run([py, str(HERE / "gpu_compare.py"), str(measured), "--json"], 60)
        result["compare"] = json.loads(out) if rc == 0 else {"error": _tail(err)}
    else:
        raise SystemExit(f"error: unknown part {name!r}")
    result["seconds"] = time.perf_counter() - t0
    return result


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# (check, its time limit in seconds); all took 231 s on an H100 (results/gpu_check_h100.json),
# about 220 s on an H200 (gpu_check_h200.json: 172 s before decode, then decode 44-60 s); tp
# (added 2026-12-05) has not run on a GPU yet: its five cases took 8.5 s on this project's CPU
PARTS = [
    ("env", 30),
    ("nccl", 40),
    ("hostside", 30),
    ("train", 160),
    ("runtime", 160),
    ("gemms", 40),
    ("tp", 60),
    ("decode", 90),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="Also write the JSON object here (after every check).")
    parser.add_argument("--tiny", action="store_true", help="small checks, any device")
    parser.add_argument("--only", help="comma-separated checks to run (default all)")
    parser.add_argument("--limit", action="append", default=[], help="CHECK=SECONDS, a new limit")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        print(json.dumps(PARTS_INLINE[args.part]()))
        return
    only = set(args.only.split(",")) if args.only else {p for p, _ in PARTS}
    limits = dict(PARTS) | {k: float(v) for k, v in (x.split("=") for x in args.limit)}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dmsc-gpu-check-") as tmp:
        for name, _ in PARTS:
            if name not in only:
                continue
            result[name] = part(name, args.tiny, limits[name], Path(tmp))
            print(f"[gpu_check] {name}: {result[name].get('seconds', 0):.1f} s", file=sys.stderr)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return
    for name, res in result.items():
        print(f"== {name} ({res.get('seconds', 0):.1f} s)")
        for key, value in res.items():
            if key in ("seconds", "measured", "compare") or isinstance(value, (dict, list)):
                text = json.dumps(value)
                value = text if len(text) < 100 else text[:97] + "..."
            print(f"  {key:32s} {value}")


if __name__ == "__main__":
    main()
