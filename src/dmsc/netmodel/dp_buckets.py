"""The data-parallel all-reduce as the runtime runs it: buckets, one at a time, behind the backward.

The runtime (``dmsc.runtime.compute.dp_collective``) averages a stage's gradients as
``DistributedDataParallel`` does: the parameters are cut into buckets in the order the backward
finishes them (the last layer's first), the first bucket small (:data:`FIRST_BUCKET_BYTES`), the
others up to :data:`BUCKET_BYTES` (a tensor larger than that alone), by :func:`pack_buckets`,
which the runtime calls too. A bucket's all-reduce is launched once the last micro-batch's
backward has made all its gradients whole, and the buckets go one at a time, in order, on one
communication thread (gloo runs a group's collectives in the order they were launched). So the
step waits after its backward for what is left of that queue: at least the last bucket's
all-reduce, which holds the first layers' gradients (the embedding's, finished last) and cannot
start before the backward ends (PyTorch's DDP notes say the same of its last bucket).

:func:`exposed_after_backward` replays that timeline in closed form; the tests hold it to a
step-by-step replay. :func:`stage_exposed_s` (and, over a job's stages,
:func:`dmsc.netmodel.sync.bucketed_exposed_s`) builds a stage's timeline from the cost model's
layers: each layer's gradients whole at the end of its backward in the last micro-batch, its
tensors the weight matrices of its linear GEMMs (last first) and the rest (norms, biases,
tables) as one; a bucket's seconds are the cost model's all-reduce of its bytes.

The cut belongs to what runs the job: a dmsc plan is priced with the runtime's constants (the
job's ``dp_bucket_bytes`` unset); a job run by another framework names that framework's bucket
(``dp_bucket_bytes``: every bucket up to it, no small first one), as the published sets of
:mod:`dmsc.netmodel.validation` do for Megatron-Core's.

Not modelled: the quorum the replicas agree on before the first bucket (one store round trip,
under the backward), copying a bucket into its flat buffer and back (on a GPU, also to the
host and back: the runtime's all-reduce is gloo's, on host memory; never yet run on two GPUs),
and a tied weight's own final bucket (the runtime launches it after the backward; the cost
model counts the shared table once, with the embedding's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a stage worker imports the bucket rule alone (its start stays light)
    from dmsc.netmodel.layers import LayerCost

FIRST_BUCKET_BYTES = 256 << 10  # DDP starts with a small bucket too (1 MiB there)
BUCKET_BYTES = 4 << 20

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "exposed_after_backward",
    "layer_tensors",
    "pack_buckets",
    "stage_exposed_s",
]


def pack_buckets(sizes: Sequence[float], bucket_bytes: float | None = None) -> list[list[int]]:
    """Indices of tensors of ``sizes`` bytes, given in the order the backward finishes them,
    in buckets: the first at most :data:`FIRST_BUCKET_BYTES`, the others :data:`BUCKET_BYTES`
    (dmsc's runtime; ``bucket_bytes`` instead: every bucket at most that, as another framework
    cuts them), unless one tensor alone is more; a bucket closes when the next tensor would
    overflow it."""
    first, rest = (
        (FIRST_BUCKET_BYTES, BUCKET_BYTES) if bucket_bytes is None else (bucket_bytes, bucket_bytes)
    )
    out: list[list[int]] = [[]]
    size, cap = 0.0, float(first)
    for i, nbytes in enumerate(sizes):
        if out[-1] and size + nbytes > cap:
            out.append([])
            size, cap = 0.0, float(rest)
        out[-1].append(i)
        size += nbytes
    return [b for b in out if b]


def exposed_after_backward(
    ready_s: Sequence[float], comm_s: Sequence[float], backward_s: float
) -> float:
    """Seconds after the backward ends (at ``backward_s``) until the last bucket's all-reduce
    is over, bucket ``k`` ready at ``ready_s[k]`` and taking ``comm_s[k]``, one at a time in
    order. The queue ends at ``max_k (ready_k + comm_k + ... + comm_last)`` (the last bucket
    that had to wait for its gradients, then everything after it back to back)."""
    end, tail = 0.0, 0.0
    for ready, comm in zip(reversed(ready_s), reversed(comm_s), strict=True):
        tail += comm
        end = max(end, ready + tail)
    return max(0.0, end - backward_s)


def layer_tensors(lc: LayerCost, grad_bytes: float) -> list[float]:
    """Bytes of the dense (not expert) gradient tensors of ``lc`` on one device, in the order its
    backward finishes them: its linear weight matrices, last first, as long as they fit in its
    dense parameters (a mixture's expert matrices do not), then the rest as one tensor."""
    dense = lc.params_per_device - lc.expert_params_per_device
    out: list[float] = []
    left = dense
    for g in reversed(lc.gemms):
        elements = g.k * g.n * g.batch
        if g.kind != "linear" or elements > left:
            continue
        out.append(elements * grad_bytes)
        left -= elements
    if left > 0:
        out.append(left * grad_bytes)
    return out


def stage_exposed_s(
    members: Sequence[LayerCost],
    backward_s: Sequence[float],
    grad_bytes: float,
    allreduce_s: Callable[[float], float],
    bucket_bytes: float | None = None,
) -> float:
    """Seconds a stage of ``members`` (``backward_s`` each, the last micro-batch's backward)
    waits after its backward for its buckets' all-reduces, one of ``n`` bytes taking
    ``allreduce_s(n)``, cut by :func:`pack_buckets` (``bucket_bytes`` as there; module
    docstring)."""
    sizes: list[float] = []
    ready: list[float] = []
    t = 0.0
    for lc, bwd in zip(reversed(members), reversed(backward_s), strict=True):
        t += bwd
        for nbytes in layer_tensors(lc, grad_bytes):
            sizes.append(nbytes)
            ready.append(t)
    buckets = pack_buckets(sizes, bucket_bytes)
    bucket_ready = [ready[b[-1]] for b in buckets]
    costs: dict[float, float] = {}  # a model's buckets come in few sizes
    comm = []
    for b in buckets:
        nbytes = sum(sizes[i] for i in b)
        if nbytes not in costs:
            costs[nbytes] = allreduce_s(nbytes)
        comm.append(costs[nbytes])
    return exposed_after_backward(bucket_ready, comm, t)
