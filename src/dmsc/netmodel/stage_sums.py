"""Which layers each pipeline stage holds, and the sums over them that price its memory and compute.

A stage is a list of indices into the model's layers (:func:`stage_cut`): the chunks of the
``pp x v`` cut that run on it, the embedding with the first chunk and the head with the last. The
per-layer quantities a stage adds up (parameters, kept activations, weight matrices, each device
type's forward and backward time) sit in one column per quantity (:class:`Columns`), built once
for the layers of a strategy search (:func:`.layers.build_layer_costs` hands out the same layer
objects to every strategy with the same layer key), and a stage's sum is taken over its indices
in its members' order: the same floats as adding up the members one by one.

Why columns: the strategy search bounds every configuration by its memory and compute
(:func:`.iteration.compute_bound`; GPT-3 175B on 1,024 A100s: 993 of them, about 100 layers
each), and reading each layer's attributes in generator loops took 0.3-0.5 s of a 0.6-1.0 s search
on this project's 2-core machine (cProfile and wall clock, ``benchmarks/estimate_speed.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from dmsc.netmodel.compute import DtypeUnsupported, layer_time
from dmsc.netmodel.constants import Calibration
from dmsc.netmodel.layers import BLOCKS, LayerCost, matrix_elements
from dmsc.netmodel.parallel import split_layers
from dmsc.spec.cluster import DeviceTypeSpec
from dmsc.spec.job import JobSpec

ENDS = ("embedding", "head")
RECOMPUTED = ("block", "moe_block", "layer")  # the kinds a recompute policy applies to
_CACHE_SIZE = 1024


def _getter(idx: tuple[int, ...]) -> Callable[[Sequence[float]], tuple[float, ...]]:
    """The values of a column at ``idx``, in that order, as a tuple (``itemgetter`` gives one
    index's value bare, and nothing for none)."""
    if len(idx) == 1:
        i = idx[0]
        return lambda col: (col[i],)
    if not idx:
        return lambda col: ()
    return itemgetter(*idx)


@dataclass(frozen=True)
class StageCut:
    """Each stage's layer indices, and a getter of a column's values at them."""

    indices: tuple[tuple[int, ...], ...]
    getters: tuple[Callable[[Sequence[float]], tuple[float, ...]], ...]


_cuts: dict[tuple[object, ...], StageCut] = {}


def stage_cut(layers: Sequence[LayerCost], job: JobSpec) -> StageCut:
    """The layers of each stage as indices into ``layers``.

    With ``split_counts_embedding_and_loss`` the embedding and the head each count as one layer
    of the split, so the first and last chunks take one block fewer (Llama 3's balancing;
    Megatron-Core's account-for-embedding/loss-in-pipeline-split).
    """
    cols = columns(layers)
    n, ends, first, last = len(layers), cols.ends, cols.first_embedding, cols.last_head
    split = None if job.stage_layers is None else tuple(job.stage_layers)
    key = (n, ends, first, last, job.pp, job.chunks, split, job.split_counts_embedding_and_loss)
    hit = _cuts.get(key)
    if hit is None:
        hit = _cut(n, ends, first, last, job)
        if len(_cuts) >= _CACHE_SIZE:
            _cuts.clear()
        _cuts[key] = hit
    return hit


def _cut(n: int, ends: tuple[int, ...], first: bool, last: bool, job: JobSpec) -> StageCut:
    body = [i for i in range(n) if i not in ends]
    stages: list[list[int]] = [[] for _ in range(job.pp)]
    if job.stage_layers is not None:
        starts = [sum(job.stage_layers[:i]) for i in range(job.pp + 1)]
        chunks = [range(starts[i], starts[i + 1]) for i in range(job.pp)]
    elif job.split_counts_embedding_and_loss and first and last:
        items = [0, *body, n - 1]
        for c, rng in enumerate(split_layers(len(items), job.pp * job.chunks)):
            stages[c % job.pp].extend(items[i] for i in rng)
        chunks = []
        first = last = False  # already placed
    else:
        chunks = split_layers(len(body), job.pp * job.chunks)
    for c, rng in enumerate(chunks):
        stages[c % job.pp].extend(body[i] for i in rng)
    if first:
        stages[0].insert(0, 0)
    if last:
        stages[-1].append(n - 1)
    indices = tuple(tuple(s) for s in stages)
    return StageCut(indices, tuple(_getter(s) for s in indices))


def assign_stage_layers(layers: list[LayerCost], job: JobSpec) -> list[list[LayerCost]]:
    """Layers of each stage, embedding with the first chunk and head with the last."""
    return [[layers[i] for i in idx] for idx in stage_cut(layers, job).indices]


@dataclass
class Columns:
    """One value per layer for each quantity a stage sums (same order as the layers)."""

    layers: tuple[LayerCost, ...]  # held, so that no layer's id is reused while this lives
    dense: tuple[float, ...]  # parameters on a device less the experts'
    expert: tuple[float, ...]
    matrices: tuple[float, ...]  # elements of the weight matrices (blocks only)
    activations: tuple[float, ...]
    working: tuple[float, ...]
    blocks: tuple[int, ...]  # 1 for a transformer block
    ends: tuple[int, ...]  # where the embeddings and heads are
    first_embedding: bool
    last_head: bool
    # A device type's per-layer forward (+ backward and recomputation when training) seconds,
    # and why a layer's dtype cannot run on it, by (device, dtype, recompute, calib, train); the
    # device and calibration are held beside them, so that their ids are not reused.
    _times: dict[tuple[object, ...], tuple[object, object, tuple[float, ...], dict[int, str]]]

    @classmethod
    def build(cls, layers: Sequence[LayerCost]) -> Columns:
        return cls(
            tuple(layers),
            tuple(lc.params_per_device - lc.expert_params_per_device for lc in layers),
            tuple(lc.expert_params_per_device for lc in layers),
            tuple(matrix_elements(lc) for lc in layers),
            tuple(lc.activation_bytes for lc in layers),
            tuple(lc.working_bytes for lc in layers),
            tuple(1 if lc.kind in BLOCKS else 0 for lc in layers),
            tuple(i for i, lc in enumerate(layers) if lc.kind in ENDS),
            bool(layers) and layers[0].kind == "embedding",
            bool(layers) and layers[-1].kind == "head",
            {},
        )

    def seconds(
        self, device: DeviceTypeSpec, dtype: str, recompute: str, calib: Calibration, train: bool
    ) -> tuple[tuple[float, ...], dict[int, str]]:
        """Each layer's time on ``device`` (forward, and backward with recomputation when
        training), and the reason of each layer whose dtype the device cannot run."""
        key = (id(device), dtype, recompute, id(calib), train)
        hit = self._times.get(key)
        if hit is not None and hit[0] is device and hit[1] is calib:
            return hit[2], hit[3]
        out: list[float] = []
        unsupported: dict[int, str] = {}
        for i, lc in enumerate(self.layers):
            policy = recompute if lc.kind in RECOMPUTED else "none"
            try:
                lt = layer_time(lc, device, dtype, policy, calib)
            except DtypeUnsupported as exc:
                unsupported[i] = str(exc)
                out.append(0.0)
                continue
            out.append(lt.forward + (lt.backward + lt.recompute if train else 0.0))
        self._times[key] = (device, calib, tuple(out), unsupported)
        return tuple(out), unsupported


_columns: dict[tuple[int, int], Columns] = {}


def columns(layers: Sequence[LayerCost]) -> Columns:
    """The columns of ``layers``, built once for the same layer objects."""
    if not layers:
        return Columns.build(layers)
    key = (id(layers[0]), len(layers))
    hit = _columns.get(key)
    if hit is not None and all(map(operator.is_, hit.layers, layers)):
        return hit
    hit = Columns.build(layers)
    if len(_columns) >= _CACHE_SIZE:
        _columns.clear()
    _columns[key] = hit
    return hit
