"""Where the ranks of a job sit and which ranks talk: the Megatron rank layout.

Rank ``r`` has tensor rank ``r % tp``, data rank ``(r // tp) % dp`` and stage ``r // (tp * dp)``;
it runs on device ``first_device + r``. Expert-parallel groups are runs of ``ep`` consecutive data
ranks. Layers are cut into ``pp x v`` chunks as evenly as possible; chunk ``c`` runs on stage
``c % pp`` (the interleaved schedule's round-robin), the embedding with the first chunk and the
head with the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from dmsc.spec.job import JobSpec

Group = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Device of every rank and the communication groups of each parallelism mode."""

    tp: int
    pp: int
    dp: int
    ep: int
    first_device: int

    @classmethod
    def of(cls, job: JobSpec) -> Layout:
        return cls(job.tp, job.pp, job.dp, job.ep, job.first_device)

    def device(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return self.first_device + (stage * self.dp + dp_rank) * self.tp + tp_rank

    # The groups below are runs of :meth:`device` with a fixed step (device numbers grow with the
    # tensor rank, then the data rank, then the stage), written as ranges: a strategy search
    # asks for them about a hundred thousand times.

    def stage_devices(self, stage: int) -> list[int]:
        base = self.device(stage, 0, 0)
        return list(range(base, base + self.tp * self.dp))

    def tp_groups(self, stage: int) -> list[Group]:
        base, tp = self.device(stage, 0, 0), self.tp
        return [tuple(range(base + d * tp, base + (d + 1) * tp)) for d in range(self.dp)]

    def dp_groups(self, stage: int) -> list[Group]:
        base, tp, end = self.device(stage, 0, 0), self.tp, self.dp * self.tp
        return [tuple(range(base + t, base + end + t, tp)) for t in range(tp)]

    def ep_groups(self, stage: int) -> list[Group]:
        base, tp, ep = self.device(stage, 0, 0), self.tp, self.ep
        return [
            tuple(range(base + d0 * tp + t, base + (d0 + ep) * tp + t, tp))
            for t in range(tp)
            for d0 in range(0, self.dp, ep)
        ]

    def expert_dp_groups(self, stage: int) -> list[Group]:
        """Replicas of the same experts: one rank from each expert-parallel group."""
        base, tp, end = self.device(stage, 0, 0), self.tp, self.dp * self.tp
        return [
            tuple(range(base + i * tp + t, base + end + t, self.ep * tp))
            for t in range(tp)
            for i in range(self.ep)
        ]

    def pp_flows(self, stage: int) -> list[tuple[int, int]]:
        """Sender and receiver of every activation crossing from ``stage`` to ``stage + 1``."""
        base, width = self.device(stage, 0, 0), self.tp * self.dp
        return [(a, a + width) for a in range(base, base + width)]


def split_layers(n_layers: int, chunks: int) -> list[range]:
    """``n_layers`` cut into ``chunks`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(n_layers, chunks)
    out: list[range] = []
    start = 0
    for c in range(chunks):
        size = base + (
            1 if c < extra else 0
        )  # the first chunks take the remainder (the last has the head)
        out.append(range(start, start + size))
        start += size
    return out
