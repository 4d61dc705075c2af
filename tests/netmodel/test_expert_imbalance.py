"""A mixture's routed tokens unevenly shared over the expert-parallel ranks
(``JobSpec.expert_imbalance``): the busiest rank's experts and the all-to-alls through it set the
time; the job's FLOPs and bytes stay those of every token once.

Reference: the expert GEMMs' FLOPs counted by hand from the model's shape (the busiest rank's
tokens are ``imbalance`` times an even share) and the estimate at imbalance 1."""

from __future__ import annotations

import pytest

from dmsc.netmodel import build_layer_costs, estimate_iteration
from dmsc.spec import ClusterSpec, JobSpec, TransformerSpec, resolve_model
from dmsc.spec.errors import SpecError
from dmsc.spec.loader import validate_document


def _cluster() -> ClusterSpec:
    return ClusterSpec.model_validate(
        {
            "device_types": {
                "cpu": {"peak_tflops": {"fp32": 0.1}, "memory_gib": 8, "memory_bw_gbyte_s": 20}
            },
            "node_types": {
                "host": {"device": "cpu", "devices": 2, "link": {"bandwidth_gbit_s": 40}}
            },
            "datacenters": [
                {"name": "a", "nodes": [{"type": "host", "count": 1}],
                 "network": {"gbit_s_per_node": 10}}
            ],
        }
    )  # fmt: skip


def _job(imbalance: float) -> JobSpec:
    return JobSpec(global_batch=8, micro_batch=4, dp=2, ep=2, expert_imbalance=imbalance)


def test_the_busiest_ranks_experts_compute_its_share_of_the_tokens() -> None:
    model = resolve_model("moe-mini")
    assert isinstance(model, TransformerSpec)
    even = build_layer_costs(model, _job(1.0))[1]
    busy = build_layer_costs(model, _job(1.5))[1]
    tokens = 4 * model.seq  # a micro-batch's tokens
    mats = 3  # SwiGLU experts: gate and up, then down
    per_token = 2 * model.hidden * model.ffn * mats * model.top_k  # forward FLOPs, all choices
    assert sum(g.flops for g in even.gemms[-2:]) == pytest.approx(tokens * per_token)
    assert sum(g.flops for g in busy.gemms[-2:]) == pytest.approx(1.5 * tokens * per_token)
    assert busy.busiest_extra_flops == pytest.approx(0.5 * tokens * per_token)
    assert busy.forward_flops == pytest.approx(even.forward_flops)  # the job's FLOPs: even
    assert busy.ep_alltoall_bytes == pytest.approx(1.5 * even.ep_alltoall_bytes)


def test_the_step_grows_with_the_busiest_rank_and_the_traffic_does_not() -> None:
    model = resolve_model("moe-mini")
    even = estimate_iteration(_cluster(), model, _job(1.0))
    busy = estimate_iteration(_cluster(), model, _job(1.5))
    assert busy.breakdown_s["compute"] > even.breakdown_s["compute"]
    assert busy.breakdown_s["ep_comm"] > even.breakdown_s["ep_comm"]
    assert busy.traffic_bytes["ep"] == pytest.approx(even.traffic_bytes["ep"])
    assert busy.flops_per_iteration == pytest.approx(even.flops_per_iteration)
    assert busy.iteration_time_s > even.iteration_time_s


def test_an_imbalance_beyond_ep_or_below_one_is_refused_naming_the_field() -> None:
    for bad in (2.5, 0.9):
        with pytest.raises(SpecError, match="expert_imbalance"):
            validate_document(
                JobSpec,
                {"global_batch": 8, "micro_batch": 4, "dp": 2, "ep": 2, "expert_imbalance": bad},
                "job.yaml",
            )
