"""A stage's sums taken from the layers' columns (dmsc.netmodel.stage_sums) are the floats that
adding up its members one by one gives, and the search's compute bound is the one the full
estimate's own per-stage compute gives: both checked against a member-by-member reference (the
cost model's code before the columns), over models, schedules, splits, modes and device types."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from dmsc.netmodel import DEFAULT_CALIBRATION, DoesNotFit, Topology, build_layer_costs
from dmsc.netmodel.fit import check_memory, stage_types
from dmsc.netmodel.iteration import _stage_compute, compute_bound
from dmsc.netmodel.layers import LayerCost, matrix_elements
from dmsc.netmodel.memory import stage_memory
from dmsc.netmodel.parallel import Layout, split_layers
from dmsc.netmodel.stage_sums import assign_stage_layers, columns, stage_cut
from dmsc.spec import ClusterSpec, JobSpec, load_spec, resolve_model

CLUSTERS = Path(__file__).resolve().parents[2] / "examples" / "clusters"
GIB = 1024**3


def _reference_stages(layers: list[LayerCost], job: JobSpec) -> list[list[LayerCost]]:
    """Each stage's layers as the cost model cut them before (member lists, no indices)."""
    body = [lc for lc in layers if lc.kind not in ("embedding", "head")]
    ends = job.split_counts_embedding_and_loss and layers[0].kind == "embedding"
    ends = ends and layers[-1].kind == "head"
    stages: list[list[LayerCost]] = [[] for _ in range(job.pp)]
    if job.stage_layers is not None:
        starts = [sum(job.stage_layers[:i]) for i in range(job.pp + 1)]
        chunks = [range(starts[i], starts[i + 1]) for i in range(job.pp)]
    elif ends:
        items = [layers[0], *body, layers[-1]]
        for c, rng in enumerate(split_layers(len(items), job.pp * job.chunks)):
            stages[c % job.pp].extend(items[i] for i in rng)
        return stages
    else:
        chunks = split_layers(len(body), job.pp * job.chunks)
    for c, rng in enumerate(chunks):
        stages[c % job.pp].extend(body[i] for i in rng)
    if layers[0].kind == "embedding":
        stages[0].insert(0, layers[0])
    if layers[-1].kind == "head":
        stages[-1].append(layers[-1])
    return stages


def _reference_memory(cluster, topo, model, job, stages):  # type: ignore[no-untyped-def]
    """Each stage's memory summed member by member, as the cost model did before."""
    layout = Layout.of(job)
    B = 2 if model.dtype in ("bf16", "fp16") else 4
    train = job.mode == "train"
    out = []
    for s, members in enumerate(stages):
        types = stage_types(cluster, topo, layout, s)
        dense = sum(lc.params_per_device - lc.expert_params_per_device for lc in members)
        expert = sum(lc.expert_params_per_device for lc in members)
        matrices = sum(matrix_elements(lc) for lc in members)
        if train:
            acts = sum(lc.activation_bytes for lc in members)
        else:
            acts = max((lc.activation_bytes for lc in members), default=0.0)
        if not train:
            n_blocks = sum(1 for lc in members if lc.kind in ("block", "moe_block"))
            kv = 2 * n_blocks * job.micro_batch * model.seq * model.kv_heads_count
            acts += kv * model.head_dim * B / job.tp
        working = max((lc.working_bytes for lc in members), default=0.0) if train else 0.0
        worst = min(types, key=lambda t: cluster.device_types[t].memory_gib)
        dc = DEFAULT_CALIBRATION.for_device(cluster.device_types[worst])
        mem = stage_memory(
            job, model.dtype, s, dense, expert, acts, working, matrices,
            dc.framework_bytes, dc.allocator_overhead,
        )  # fmt: skip
        out.append((mem, cluster.device_types[worst].memory_gib * GIB))
    return out


def _two_types() -> ClusterSpec:
    """Selene with half its nodes on 40 GB A100s at a lower memory bandwidth."""
    doc = load_spec(ClusterSpec, CLUSTERS / "a100-selene.yaml").model_dump(mode="json")
    small = {**doc["device_types"]["a100-80gb"], "memory_gib": 40, "memory_bw_gbyte_s": 1555}
    doc["device_types"]["a100-40gb"] = small
    doc["node_types"]["dgx-a100-40"] = {**doc["node_types"]["dgx-a100"], "device": "a100-40gb"}
    nodes = doc["datacenters"][0]["nodes"]
    doc["datacenters"][0]["nodes"] = [
        {**nodes[0], "count": 8},
        {**nodes[0], "type": "dgx-a100-40", "count": 8},
    ]
    return ClusterSpec.model_validate(doc)


JOBS = [
    dict(global_batch=64, tp=8, pp=8, dp=1, schedule="interleaved", interleave=3),
    dict(global_batch=64, tp=4, pp=4, dp=2, recompute="selective", sequence_parallel=True),
    dict(global_batch=64, tp=2, pp=5, dp=1, split_counts_embedding_and_loss=True),
    dict(global_batch=64, tp=1, pp=3, dp=4, schedule="gpipe", recompute="full", zero=1),
    dict(global_batch=32, tp=2, pp=2, dp=2, mode="infer"),
    dict(global_batch=64, tp=1, pp=4, dp=2, stage_layers=(8, 12, 10, 10)),
    dict(global_batch=64, tp=1, pp=1, dp=8, zero=3),
]
MODELS = ["gpt3-13b", "llama3-8b", "mixtral-8x7b"]


@pytest.mark.parametrize(("model_name", "job_fields"), list(itertools.product(MODELS, JOBS)))
@pytest.mark.parametrize("two_types", [False, True])
def test_column_sums_are_the_member_sums(
    model_name: str, job_fields: dict[str, object], two_types: bool
) -> None:
    cluster = _two_types() if two_types else load_spec(ClusterSpec, CLUSTERS / "a100-selene.yaml")
    model = resolve_model(model_name)
    fields = dict(job_fields)
    if fields.get("stage_layers") is not None and model.layers != 40:
        fields["stage_layers"] = None
    if model.is_moe:
        fields["ep"] = 2 if fields["dp"] % 2 == 0 else 1  # type: ignore[operator]
    job = JobSpec(**fields)  # type: ignore[arg-type]
    topo = Topology(cluster)
    layers = build_layer_costs(model, job)
    want = _reference_stages(layers, job)
    got = assign_stage_layers(layers, job)
    assert [[id(lc) for lc in s] for s in got] == [[id(lc) for lc in s] for s in want]

    cols, cut = columns(layers), stage_cut(layers, job)
    reference = _reference_memory(cluster, topo, model, job, want)
    try:
        memories = check_memory(cluster, topo, model, job, cols, cut, DEFAULT_CALIBRATION)
    except DoesNotFit:
        assert any(mem.required > cap for mem, cap in reference)
        with pytest.raises(DoesNotFit):
            compute_bound(cluster, model, job, topology=topo)
        return
    assert memories == reference  # the same floats, not close ones

    layout = Layout.of(job)
    per_mb = [
        _stage_compute(
            cluster, topo, job, model.dtype, members, stage_types(cluster, topo, layout, s),
            DEFAULT_CALIBRATION,
        ).seconds
        for s, members in enumerate(want)
    ]  # fmt: skip
    p = job.pp
    bound = job.microbatches * max(per_mb) + (p - 1) / job.chunks * (sum(per_mb) / p)
    assert compute_bound(cluster, model, job, topology=topo) == bound


def test_the_columns_of_other_layer_objects_are_their_own() -> None:
    """Columns are cached by the layers' identity: two layer lists of equal length whose first
    layers are the same object but whose others differ get their own columns."""
    model = resolve_model("gpt3-13b")
    a = build_layer_costs(model, JobSpec(global_batch=8, tp=1))
    b = build_layer_costs(model, JobSpec(global_batch=8, tp=2))
    mixed = [a[0], *b[1:]]
    assert columns(mixed).dense[1:] == columns(b).dense[1:]
    assert columns(a).dense[1] != columns(mixed).dense[1]


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "ep", "first"),
    [(1, 1, 1, 1, 0), (2, 3, 4, 2, 5), (8, 2, 6, 3, 0), (4, 1, 8, 8, 16)],
)
def test_layout_groups_are_the_ranks_of_each_device(
    tp: int, pp: int, dp: int, ep: int, first: int
) -> None:
    """The groups written as ranges are the ones rank by rank (Megatron's layout: the device of
    (stage, data rank, tensor rank))."""
    lay = Layout(tp, pp, dp, ep, first)
    dev = lay.device
    for s in range(pp):
        assert lay.tp_groups(s) == [tuple(dev(s, d, t) for t in range(tp)) for d in range(dp)]
        assert lay.dp_groups(s) == [tuple(dev(s, d, t) for d in range(dp)) for t in range(tp)]
        assert lay.ep_groups(s) == [
            tuple(dev(s, d0 + i, t) for i in range(ep))
            for t in range(tp)
            for d0 in range(0, dp, ep)
        ]
        assert lay.expert_dp_groups(s) == [
            tuple(dev(s, d, t) for d in range(i, dp, ep)) for t in range(tp) for i in range(ep)
        ]
        assert lay.pp_flows(s) == [
            (dev(s, d, t), dev(s + 1, d, t)) for d in range(dp) for t in range(tp)
        ]
