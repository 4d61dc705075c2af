"""The cost model against published measurements (Megatron-LM SC'21 Table 1).

The table does not give the micro-batch size nor the number of interleaved chunks; the authors
report their best configuration, so for each row we search micro-batch in {1, 2, 4, 8} and every
chunk count that divides the layers of a stage, and keep the best predicted throughput. Every row
uses the same calibration.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

from dmsc.netmodel import DEFAULT_CALIBRATION, Calibration, DoesNotFit, Topology, estimate_iteration
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec

# The Selene cluster of the paper, as in examples/clusters/a100-selene.yaml.
SELENE = ClusterSpec.model_validate(
    {
        "name": "a100-selene",
        "device_types": {
            "a100-80gb": {
                "peak_tflops": {"fp16": 312, "bf16": 312, "tf32": 156, "fp32": 19.5},
                "memory_gib": 80,
                "memory_bw_gbyte_s": 2039,
                "sm_count": 108,
            }
        },
        "node_types": {
            "dgx-a100": {
                "device": "a100-80gb",
                "devices": 8,
                "link": {"bandwidth_gbit_s": 2400, "latency_us": 1.0},
            }
        },
        "datacenters": [
            {
                "name": "selene",
                "nodes": [{"type": "dgx-a100", "count": 384}],
                "network": {"gbit_s_per_node": 1600, "latency_us": 2.0},
            }
        ],
    }
)


@dataclass(frozen=True)
class ValidationRow:
    """One row of the table, predicted."""

    params_billion: float
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    micro_batch: int
    interleave: int
    published_tflops: float
    predicted_tflops: float

    @property
    def error_pct(self) -> float:
        return (self.predicted_tflops - self.published_tflops) / self.published_tflops * 100


def read_megatron_table() -> list[dict[str, float]]:
    text = resources.files("dmsc.netmodel").joinpath("megatron_sc21_table1.csv").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(lines)]


def validate_megatron(calib: Calibration = DEFAULT_CALIBRATION) -> list[ValidationRow]:
    """Predicted vs published TFLOP/s per GPU for every row of the table."""
    topo = Topology(SELENE)
    out: list[ValidationRow] = []
    for row in read_megatron_table():
        layers, tp, pp, gpus = int(row["layers"]), int(row["tp"]), int(row["pp"]), int(row["gpus"])
        gb = int(row["global_batch"])
        dp = gpus // (tp * pp)
        model = TransformerSpec(
            name=f"gpt-{row['params_billion']}b",
            layers=layers,
            hidden=int(row["hidden"]),
            heads=int(row["heads"]),
            seq=2048,
            vocab=51200,
            dtype="fp16",
            tied_embeddings=True,
        )
        per_stage = layers // pp
        chunk_options = (
            [1] if pp == 1 else [v for v in range(1, per_stage + 1) if per_stage % v == 0]
        )
        best: ValidationRow | None = None
        for v in chunk_options:
            for mb in (1, 2, 4, 8):
                if gb % (mb * dp):
                    continue
                job = JobSpec(
                    global_batch=gb,
                    micro_batch=mb,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    schedule="interleaved" if v > 1 else "1f1b",
                    interleave=v,
                    recompute="full",
                    attention="standard",  # Megatron-LM of SC'21 had no fused attention
                    overlap_dp_comm=False,  # Megatron-LM of SC'21 reduced gradients after the flush
                )
                try:
                    est = estimate_iteration(SELENE, model, job, calib, topology=topo)
                except DoesNotFit:
                    continue
                cand = ValidationRow(
                    row["params_billion"],
                    gpus,
                    tp,
                    pp,
                    dp,
                    gb,
                    mb,
                    v,
                    row["tflops_per_gpu"],
                    est.tflops_per_gpu,
                )
                if best is None or cand.predicted_tflops > best.predicted_tflops:
                    best = cand
        if best is None:
            raise RuntimeError(f"no configuration of row {row} fits")
        out.append(best)
    return out
