"""The sync modes at tp > 1: a tensor-parallel rank's flat vector against its replica's whole one.

At tp > 1 each rank of a replica runs its sync mode (:mod:`.outer_sync`) on its own shard, with
the same rank of the other replicas (its peers, its leader and its data-parallel group are all of
that rank). A rank's flat vector (the order of ``module.parameters()``) holds two kinds of
coordinates: those of the split parameters, which are this rank's alone, and those of the
parameters every rank holds whole (norms, position embeddings, row-parallel biases, a router),
which are the same on every rank. Whatever a mode computes coordinate by coordinate (the mean,
bf16, the median, the trimmed mean, secure aggregation's masked sum) is then the tp = 1 result
cut into shards. What it computes over the whole vector is done here, over the ranks of the
replica's tensor-parallel group (the process's default group: :mod:`.tp_worker`):

- **a norm** (central privacy's clipping, :meth:`ShardLayout.norm`): the squares of the split
  coordinates summed over the ranks, the whole ones counted once (rank 0's);
- **the Krum distances** (:meth:`ShardLayout.sq_distances`): the same sums, per pair of replicas,
  at the leaders (replica 0's ranks, who form one group);
- **the privacy noise** (:meth:`ShardLayout.cut`): drawn for the whole replica as at tp = 1 and cut,
  so that the shards' noise is independent and the whole coordinates' is the same on every rank;
- **the replicas a leader combines** (:meth:`ShardLayout.agree_present`): under ``skip`` one rank
  may have an update in time that another has not; the leaders keep those every rank has;
- **the whole coordinates' result** (:meth:`ShardLayout.same_whole`): rank 0's, broadcast, since a
  codec whose blocks or top-k span a rank's flat vector (int8's scales, top-k, PowerSGD) would
  otherwise give each rank its own, and the ranks must hold the same copy.

A codec of the shard (int8's blocks, top-k's k, PowerSGD's factors) approximates the shard's
update, not the whole one's: those modes train at tp > 1, but not to the tp = 1 losses to the
float (their own approximation differs). A round's state (the anchor and the outer momentum) is
one flat vector per rank; a checkpoint keeps it in the tp = 1 layout (:meth:`ShardLayout.gather`,
read back by :meth:`ShardLayout.cut`), so it moves across a change of tp like the weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from dmsc.runtime.compute.tensor_parallel import Split, shard, split_of, unshard
from dmsc.spec import TransformerSpec

ROUND_STATE = ("dmsc.sync.anchor", "dmsc.sync.momentum")  # flat vectors in a checkpoint


def _whole_shape(shape: torch.Size, split: Split, tp: int, vocab: int) -> tuple[int, ...]:
    if split == "vocab":
        return (vocab, *shape[1:])
    if split == "row":
        return (shape[0], shape[1] * tp, *shape[2:])
    return (shape[0] * tp, *shape[1:])


class ShardLayout:
    """Where rank ``rank`` of ``tp``'s flat vector sits in its replica's whole (tp = 1) one."""

    def __init__(
        self,
        spec: TransformerSpec,
        params: Iterable[tuple[str, torch.Tensor]],
        rank: int,
        tp: int,
    ) -> None:
        """``params``: the rank's parameters by name, in the order of ``module.parameters()``
        (``module.named_parameters()``)."""
        self.spec, self.rank, self.tp = spec, rank, tp
        self.names: list[str] = []
        self.splits: list[Split | None] = []
        self.shapes: list[torch.Size] = []
        self.whole_shapes: list[tuple[int, ...]] = []
        for name, p in params:
            split = split_of(spec, name)
            self.names.append(name)
            self.splits.append(split)
            self.shapes.append(p.shape)
            whole = (
                tuple(p.shape) if split is None else _whole_shape(p.shape, split, tp, spec.vocab)
            )
            self.whole_shapes.append(whole)
        sizes = [s.numel() for s in self.shapes]
        self.n = sum(sizes)
        self.whole_n = sum(int(torch.Size(s).numel()) for s in self.whole_shapes)
        # the coordinates of the parameters every rank holds whole
        marks = [torch.full((n,), s is None) for n, s in zip(sizes, self.splits, strict=True)]
        self.whole = torch.cat(marks) if marks else torch.zeros(0, dtype=torch.bool)

    # -- layouts ---------------------------------------------------------------------------------
    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's flat vector of a whole (tp = 1 layout) one."""
        if whole.numel() != self.whole_n:
            raise ValueError(f"a flat vector of {whole.numel()} for a stage of {self.whole_n}")
        out, offset = [], 0
        for split, shape in zip(self.splits, self.whole_shapes, strict=True):
            n = int(torch.Size(shape).numel())
            t = whole[offset : offset + n].view(shape)
            offset += n
            out.append((t if split is None else shard(t, split, self.rank, self.tp)).reshape(-1))
        return torch.cat(out) if out else whole[:0]

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole (tp = 1 layout) vector of every rank's ``flat`` (a collective: every rank
        of the group calls it; every rank gets it)."""
        parts = [torch.empty_like(flat) for _ in range(self.tp)]
        dist.all_gather(parts, flat.contiguous())
        out, offset = [], 0
        for split, shape in zip(self.splits, self.shapes, strict=True):
            n = shape.numel()
            pieces = [p[offset : offset + n].view(shape) for p in parts]
            offset += n
            whole = pieces[0] if split is None else unshard(pieces, split, self.spec.vocab)
            out.append(whole.reshape(-1))
        return torch.cat(out) if out else flat[:0]

    # -- over the ranks --------------------------------------------------------------------------
    def _over_ranks(self, split_part: torch.Tensor, whole_part: torch.Tensor) -> torch.Tensor:
        """``split_part`` summed over the ranks, plus ``whole_part`` once (rank 0's)."""
        total = split_part + (whole_part if self.rank == 0 else torch.zeros_like(whole_part))
        dist.all_reduce(total)
        return total

    def norm(self, flat: torch.Tensor) -> float:
        """The L2 norm of the replica's whole vector, of which ``flat`` is this rank's part
        (float64, as :func:`~.privacy.clip_update` computes it)."""
        x = flat.detach().to(torch.float64)
        sq = self._over_ranks(
            (x[~self.whole] ** 2).sum().view(1), (x[self.whole] ** 2).sum().view(1)
        )
        return float(sq.sqrt())

    def sq_distances(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The squared distances between the replicas' whole vectors, of which ``parts`` are
        this rank's (Krum's), float64, count x count."""
        count = len(parts)
        split_d = torch.zeros(count, count, dtype=torch.float64)
        whole_d = torch.zeros(count, count, dtype=torch.float64)
        for i in range(count):
            for j in range(i + 1, count):
                d = (parts[i] - parts[j]).to(torch.float64)
                split_d[i, j] = split_d[j, i] = (d[~self.whole] ** 2).sum()
                whole_d[i, j] = whole_d[j, i] = (d[self.whole] ** 2).sum()
        return self._over_ranks(split_d, whole_d)

    def agree_present(self, present: Sequence[int], replicas: int) -> list[int]:
        """The replicas (of ``present``, this rank's) whose update every rank has."""
        mask = torch.zeros(replicas, dtype=torch.int64)
        mask[list(present)] = 1
        dist.all_reduce(mask, op=dist.ReduceOp.MIN)
        return [r for r in range(replicas) if mask[r]]

    def same_whole(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` with its whole coordinates rank 0's (a collective)."""
        if not bool(self.whole.any()):
            return flat
        held = flat[self.whole].contiguous()
        dist.broadcast(held, 0)
        out = flat.clone()
        out[self.whole] = held
        return out


def round_state_whole(
    layout: ShardLayout, extra: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A round's state (:meth:`~.outer_sync.ReplicaSync.state`) in the tp = 1 layout: its flat
    vectors gathered from the ranks (a collective), the rest as it is."""
    return {k: layout.gather(v) if k in ROUND_STATE else v for k, v in extra.items()}


def round_state_cut(layout: ShardLayout, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's round state cut to this rank's shard; a flat vector that is not of the
    whole stage (another model's) is left out, so that the round starts from the weights."""
    out = {}
    for k, v in held.items():
        if k not in ROUND_STATE:
            out[k] = v
        elif v.numel() == layout.whole_n:
            out[k] = layout.cut(v.float())
    return out
