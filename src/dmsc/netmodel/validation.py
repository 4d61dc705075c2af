"""The cost model against published measurements: several sets, each on one device generation.

Every set is a table copied into the package with its source line (``*.csv`` beside this module).
A table gives what its authors ran, rarely every knob (micro-batch, interleaving, recomputation);
where it leaves one out, the authors report their best configuration, so every candidate the table
allows is predicted and the fastest kept. Every row of every set uses the default calibration,
which holds one set of constants per device generation (:mod:`dmsc.netmodel.constants`).

The error of a row is that of the predicted throughput: ``predicted / published - 1`` for
TFLOP/s per GPU, ``published / predicted - 1`` for iteration times.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources

from dmsc.netmodel.comm import CommModel
from dmsc.netmodel.constants import DEFAULT_CALIBRATION, Calibration
from dmsc.netmodel.iteration import DoesNotFit, Estimate, estimate_iteration
from dmsc.netmodel.topology import Topology
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec


def _dgx_cluster(
    name: str, preset: str, nodes: int, nvlink_gbit_s: float, net_gbit_s: float
) -> ClusterSpec:
    """``nodes`` DGX-class servers of 8 GPUs on one fabric."""
    return ClusterSpec.model_validate(
        {
            "name": name,
            "device_types": {"gpu": {"preset": preset}},
            "node_types": {
                "dgx": {
                    "device": "gpu",
                    "devices": 8,
                    "link": {"bandwidth_gbit_s": nvlink_gbit_s, "latency_us": 1.0},
                }
            },
            "datacenters": [
                {
                    "name": name,
                    "nodes": [{"type": "dgx", "count": nodes}],
                    "network": {"gbit_s_per_node": net_gbit_s, "latency_us": 2.0},
                }
            ],
        }
    )


# Selene (SC'21, MLSys'23): DGX A100, NVLink 3 (300 GB/s per direction), 8 x 200 Gbit/s HDR.
SELENE = _dgx_cluster("a100-selene", "a100-sxm-80gb", 384, 2400, 1600)
# DGX H100 (Megatron-Core, NeMo): NVLink 4 (450 GB/s per direction), 8 x 400 Gbit/s NDR.
DGX_H100 = _dgx_cluster("dgx-h100", "h100-sxm", 768, 3600, 3200)
# DGX B200: NVLink 5 (900 GB/s per direction), 8 x 400 Gbit/s.
DGX_B200 = _dgx_cluster("dgx-b200", "b200", 64, 7200, 3200)
# Meta's Grand Teton H100 servers: NVLink 4, 400 Gbit/s RoCE per GPU.
GRAND_TETON = _dgx_cluster("grand-teton-h100", "h100-sxm", 2048, 3600, 3200)


def megatron_core_bucket_bytes(dp: int, grad_bytes: int = 2) -> int:
    """Bytes of Megatron-Core's default data-parallel bucket at ``dp`` replicas: max(40,000,000,
    1,000,000 x dp) parameters (Megatron-LM core_r0.8.0, commit baf94af3c667,
    megatron/core/distributed/distributed_data_parallel.py lines 51-54, documented at
    distributed_data_parallel_config.py lines 25-28; the same rule in NeMo 24.07 and 25.02,
    which wrap Megatron-Core's DDP), of ``grad_bytes`` each as the cost model reduces them (bf16
    gradients). Not modelled: Megatron-Core puts every stage after the first, and every
    interleaved chunk after the first, in one bucket (lines 66-74 there, and
    megatron/training/training.py line 458), its reduction off the critical path."""
    return max(40_000_000, 1_000_000 * dp) * grad_bytes


@dataclass(frozen=True)
class Candidate:
    """One configuration the published row allows."""

    model: TransformerSpec
    job: JobSpec


@dataclass(frozen=True)
class ValidationRow:
    """One row of a table, predicted (its best candidate)."""

    label: str
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int
    interleave: int
    recompute: str
    metric: str  # "tflops_per_gpu" or "iteration_s"
    published: float
    predicted: float

    @property
    def error_pct(self) -> float:
        """Error of the predicted throughput, in percent (positive: predicted faster)."""
        if self.metric == "iteration_s":
            return (self.published / self.predicted - 1) * 100
        return (self.predicted / self.published - 1) * 100


@dataclass(frozen=True)
class ValidationSet:
    name: str
    source: str
    device: str
    generation: str
    csv: str
    metric: str
    flops: str  # "executed" (recomputation counted, as SC'21) or "model" (MFU-style)
    cluster: ClusterSpec
    candidates: Callable[[dict[str, str]], Iterator[Candidate]]
    label: Callable[[dict[str, str]], str]


def _chunks(layers: int, pp: int) -> list[int]:
    """Interleaving degrees a pipeline of ``pp`` stages over ``layers`` blocks allows."""
    if pp == 1:
        return [1]
    per_stage = layers // pp
    return [v for v in range(1, per_stage + 1) if layers % (pp * v) == 0] or [1]


def _gpt(row: dict[str, str], seq: int, vocab: int, dtype: str, **more: object) -> TransformerSpec:
    """The GPT model of a Megatron-LM table row (its layers, hidden size and heads)."""
    return TransformerSpec.model_validate(
        {
            "name": f"gpt-{row['params_billion']}b",
            "layers": int(row["layers"]),
            "hidden": int(row["hidden"]),
            "heads": int(row["heads"]),
            "seq": seq,
            "vocab": vocab,
            "dtype": dtype,
            **more,
        }
    )


def _sc21(row: dict[str, str]) -> Iterator[Candidate]:
    layers, tp, pp, gpus = int(row["layers"]), int(row["tp"]), int(row["pp"]), int(row["gpus"])
    gb, dp = int(row["global_batch"]), gpus // (tp * pp)
    model = _gpt(row, 2048, 51200, "fp16", tied_embeddings=True, dropout=0.1)
    for v in _chunks(layers, pp):
        for mb in (1, 2, 4, 8):
            if gb % (mb * dp) == 0:
                yield Candidate(
                    model,
                    JobSpec(
                        global_batch=gb,
                        micro_batch=mb,
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        schedule="interleaved" if v > 1 else "1f1b",
                        interleave=v,
                        recompute="full",
                        attention="standard",  # Megatron-LM of 2021 had no fused attention
                        overlap_dp_comm=False,  # it reduced gradients after the pipeline flush
                        overlap_tp_comm=False,  # nor the tensor-parallel ones in the backward
                        overlap_pp_comm=False,  # and waited for each chunk's activations
                    ),
                )


def _mlsys23(row: dict[str, str]) -> Iterator[Candidate]:
    v = int(row["interleave"])
    selective = row["recompute"] == "selective"
    model = _gpt(row, 2048, 51200, "bf16", tied_embeddings=True, dropout=0.1)
    yield Candidate(
        model,
        JobSpec(
            global_batch=int(row["global_batch"]),
            micro_batch=int(row["micro_batch"]),
            tp=int(row["tp"]),
            pp=int(row["pp"]),
            schedule="interleaved" if v > 1 else "1f1b",
            interleave=v,
            recompute="selective" if selective else "full",
            sequence_parallel=selective,
            sequence_parallel_edges="fused",  # Megatron-LM's (dmsc.netmodel.tp_calls)
            attention="standard",
            overlap_pp_comm=False,  # Megatron-LM of 2022 waited for each chunk's activations
        ),
    )


def _mcore_h100(row: dict[str, str]) -> Iterator[Candidate]:
    layers, tp, pp, dp = int(row["layers"]), int(row["tp"]), int(row["pp"]), int(row["dp"])
    gb = int(row["global_batch"])
    model = _gpt(row, 4096, 131072, "bf16")
    for v in _chunks(layers, pp):
        for mb in (1, 2, 4):
            if gb % (mb * dp):
                continue
            for recompute in ("none", "selective"):
                yield Candidate(
                    model,
                    JobSpec(
                        global_batch=gb,
                        micro_batch=mb,
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        schedule="interleaved" if v > 1 else "1f1b",
                        interleave=v,
                        recompute=recompute,
                        sequence_parallel=tp > 1,
                        sequence_parallel_edges="fused",  # Megatron-LM's (dmsc.netmodel.tp_calls)
                        zero=1,  # Megatron-Core's distributed optimizer
                        dp_bucket_bytes=megatron_core_bucket_bytes(dp),
                    ),
                )


def _nemo_fp8(row: dict[str, str]) -> Iterator[Candidate]:
    tp, pp, v, gpus = int(row["tp"]), int(row["pp"]), int(row["vp"]), int(row["gpus"])
    model = TransformerSpec(
        name=row["model"],
        layers=int(row["layers"]),
        hidden=int(row["hidden"]),
        heads=int(row["heads"]),
        kv_heads=int(row["kv_heads"]),
        ffn=int(row["ffn"]),
        seq=int(row["seq"]),
        vocab=int(row["vocab"]),
        dtype="bf16",
        mlp=row["mlp"],
        tied_embeddings=row["mlp"] == "gelu",
    )
    for recompute in ("none", "selective"):
        yield Candidate(
            model,
            JobSpec(
                global_batch=int(row["global_batch"]),
                micro_batch=int(row["micro_batch"]),
                tp=tp,
                pp=pp,
                dp=gpus // (tp * pp),
                schedule="interleaved" if v > 1 else "1f1b",
                interleave=v,
                recompute=recompute,
                sequence_parallel=tp > 1,
                sequence_parallel_edges="fused",  # Megatron-LM's (dmsc.netmodel.tp_calls)
                zero=1,
                precision="fp8",
                dp_bucket_bytes=megatron_core_bucket_bytes(gpus // (tp * pp)),
            ),
        )


LLAMA3_405B = TransformerSpec(
    name="llama3-405b",
    layers=126,
    hidden=16384,
    heads=128,
    kv_heads=8,
    ffn=53248,
    seq=8192,
    vocab=128000,
    dtype="bf16",
    mlp="swiglu",
)


def _llama3(row: dict[str, str]) -> Iterator[Candidate]:
    tp, pp, dp = int(row["tp"]), int(row["pp"]), int(row["dp"])
    gb = dp * int(row["batch_per_dp"])
    for v in range(1, 9):
        for mb in (1, 2):
            yield Candidate(
                LLAMA3_405B,
                JobSpec(
                    global_batch=gb,
                    micro_batch=mb,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    schedule="interleaved" if v > 1 else "1f1b",
                    interleave=v,
                    sequence_parallel=True,
                    sequence_parallel_edges="fused",  # Megatron-LM's (dmsc.netmodel.tp_calls)
                    zero=2,  # FSDP sharding optimizer states and gradients, not weights
                    # dp_bucket_bytes unset: the paper does not say how its FSDP cuts the
                    # gradient reductions, so dmsc's own buckets stand in for them
                    # "we reduce one Transformer layer each from the first and the last stages"
                    split_counts_embedding_and_loss=True,
                ),
            )


VALIDATION_SETS: dict[str, ValidationSet] = {
    s.name: s
    for s in (
        ValidationSet(
            "megatron-sc21",
            "Narayanan et al., Megatron-LM, SC'21, Table 1",
            "A100 80GB",
            "a100",
            "megatron_sc21_table1.csv",
            "tflops_per_gpu",
            "executed",
            SELENE,
            _sc21,
            lambda r: f"GPT {r['params_billion']}B",
        ),
        ValidationSet(
            "korthikanti-mlsys23",
            "Korthikanti et al., MLSys 2023, Tables 3 and 5",
            "A100 80GB",
            "a100",
            "korthikanti_mlsys23_table5.csv",
            "iteration_s",
            "executed",
            SELENE,
            _mlsys23,
            lambda r: f"GPT {r['params_billion']}B {r['recompute']}",
        ),
        ValidationSet(
            "megatron-core-h100",
            "Megatron-LM README (Megatron-Core r0.8.0) H100 weak scaling",
            "H100 80GB",
            "h100",
            "megatron_core_h100.csv",
            "tflops_per_gpu",
            "model",
            DGX_H100,
            _mcore_h100,
            lambda r: f"GPT {r['params_billion']}B",
        ),
        ValidationSet(
            "nemo-h100-fp8",
            "NVIDIA NeMo 24.07 performance summary, DGX-H100, FP8",
            "H100 80GB",
            "h100",
            "nemo_2407_h100_fp8.csv",
            "tflops_per_gpu",
            "model",
            DGX_H100,
            _nemo_fp8,
            lambda r: f"{r['model']} {r['gpus']} GPUs",
        ),
        ValidationSet(
            "nemo-b200-fp8",
            "NVIDIA NeMo 25.02 performance summary, DGX-B200, FP8",
            "B200",
            "b200",
            "nemo_2502_b200_fp8.csv",
            "tflops_per_gpu",
            "model",
            DGX_B200,
            _nemo_fp8,
            lambda r: f"{r['model']} {r['gpus']} GPUs",
        ),
        ValidationSet(
            "llama3-405b",
            "The Llama 3 Herd of Models, Table 4",
            "H100 80GB",
            "h100",
            "llama3_405b_table4.csv",
            "tflops_per_gpu",
            "model",
            GRAND_TETON,
            _llama3,
            lambda r: f"Llama 3 405B, {r['gpus']} GPUs",
        ),
    )
}


def read_table(filename: str) -> list[dict[str, str]]:
    text = resources.files("dmsc.netmodel").joinpath(filename).read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


def _measure(vs: ValidationSet, est: Estimate) -> float:
    if vs.metric == "iteration_s":
        return est.iteration_time_s
    flops = est.flops_per_iteration if vs.flops == "executed" else est.model_flops_per_iteration
    return flops / est.iteration_time_s / est.devices / 1e12


@functools.lru_cache(maxsize=32)
def _validate(name: str, calib: Calibration) -> tuple[ValidationRow, ...]:
    return tuple(_predict(name, calib))


def validate(name: str, calib: Calibration = DEFAULT_CALIBRATION) -> list[ValidationRow]:
    """Predicted against published figures for every row of the set ``name`` (pure: the result
    of a set and calibration is kept for the next call)."""
    return list(_validate(name, calib))


def _predict(name: str, calib: Calibration) -> list[ValidationRow]:
    vs = VALIDATION_SETS[name]
    topo = Topology(vs.cluster)
    comm = CommModel(topo, calib)
    out: list[ValidationRow] = []
    for row in read_table(vs.csv):
        best: ValidationRow | None = None
        for cand in vs.candidates(row):
            try:
                est = estimate_iteration(
                    vs.cluster, cand.model, cand.job, calib, topology=topo, comm_model=comm
                )
            except DoesNotFit:
                continue
            job = cand.job
            got = ValidationRow(
                vs.label(row),
                job.devices,
                job.tp,
                job.pp,
                job.dp,
                job.global_batch,
                job.micro_batch,
                job.chunks,
                job.recompute,
                vs.metric,
                float(row[vs.metric]),
                _measure(vs, est),
            )
            if best is None or got.error_pct > best.error_pct:  # the fastest candidate
                best = got
        if best is None:
            raise RuntimeError(f"{name}: no configuration of row {row} fits")
        out.append(best)
    return out


def summary(rows: list[ValidationRow]) -> tuple[float, float]:
    """(mean, max) absolute error in percent."""
    errors = [abs(r.error_pct) for r in rows]
    return sum(errors) / len(errors), max(errors)


def validate_megatron(calib: Calibration = DEFAULT_CALIBRATION) -> list[ValidationRow]:
    """The Megatron-LM SC'21 Table 1 set."""
    return validate("megatron-sc21", calib)
