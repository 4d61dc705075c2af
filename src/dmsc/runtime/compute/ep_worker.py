"""A stage worker's expert-parallel side: its share of the experts, its groups, its checkpoints.

A plan with ``ep`` > 1 cuts the ``dp`` replicas of each stage into expert-parallel groups of
``ep`` consecutive replicas (:func:`~.expert_parallel.expert_parallel_groups`, the cost model's
layout): replica ``r`` holds share ``r % ep`` of the experts (:mod:`.expert_parallel`) and
exchanges tokens with the others of its group by all-to-all. Here a worker

- builds its stage whole (from the seed) and keeps its share of the experts
  (:meth:`ExpertRanks.split`);
- joins its expert-parallel group through the deployment's TCPStore (``cfg.tp_store``, the
  store the data-parallel groups meet at; keys under ``ep/STAGE/eEPOCH/tpT/groupN``): a gloo
  group of its own beside the process's default one, which at tp > 1 is the replica's
  tensor-parallel group. At tp > 1 tp rank ``t`` of each replica meets tp rank ``t`` of the
  others (:mod:`.expert_parallel`: the same tokens on every tp rank of a replica, each rank
  holding its tp shard of the replica's experts). The group is formed at the first mixture
  forward of each epoch (a forward
  pre-hook), not at start: a replacement started by a recovery builds its stage before the
  others moved to its epoch, and they meet again at the next step's forward. A member that
  died fails the all-to-all (gloo sees the socket close) or leaves it waiting for the receive
  timeout; the recovery's new epoch re-forms the group around the replacement;
- has its gradients averaged as :func:`~.expert_parallel.gradient_averaging` says: the shared
  (non-expert) ones by the data-parallel collective over all ``dp`` replicas
  (:mod:`.dp_collective`, which takes only those), the experts' summed over the ``dp / ep``
  replicas holding the same share at the same tp rank (a plain gloo group formed per epoch at
  the step's averaging, under ``ep/STAGE/eEPOCH/tpT/shareN``; none at dp = ep) and divided by
  ``dp``
  (:meth:`ExpertRanks.average_expert_grads`);
- saves the gathered (ep = 1, tp = 1) stage: every replica of the first group gathers its
  experts' weights and moments, at tp > 1 each part then gathered over the tp ranks, replica 0's
  tp rank 0 writes (:func:`write_gathered`), so a checkpoint loads at any ep and tp and exports
  as any other. Loading needs nothing of its own: a worker's parameters keep their global
  names, so it reads just its experts from an ep = 1 file (cut to its tp shard at tp > 1).

An inference step runs as a training step's forward: the deployment sends a request to every
replica of the group, with the same tokens (:mod:`dmsc.runtime.control.launch.forwarding`), so
their mixtures' all-to-alls pair up (it used to be refused here). What does not run at ep > 1
is refused, not approximated: sequence parallelism at tp > 1 (each tp rank would route its own
slice of the sequence, and the tp peers would no longer send the same tokens) and, for a
training task, the sync modes and late policies other than ``wait`` (:func:`task_problem`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dmsc.runtime.compute.checkpoints import write_checkpoint
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.expert_parallel import (
    ExpertParallelMoE,
    all_gather,
    expert_of,
    expert_parallel_groups,
    gradient_averaging,
    kind_of,
    parallelize_experts,
)
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.compute.outer_sync import make_optimizer, optimizer_kind, plain_sync
from dmsc.runtime.transport.messages import LatePolicy, SyncSettings
from dmsc.spec import TransformerSpec


def task_problem(
    ep: int, planned_dp: int, dp: int, sync: SyncSettings, late_policy: LatePolicy
) -> str | None:
    """Why a training task cannot run on a deployment whose replicas hold ``1 / ep`` of the
    experts each (None: it can): the experts' groups are the planned replicas', the round modes
    and the leader's star would average one share's experts with another's, and a replica left
    out of a step has already sent and received its tokens."""
    if ep == 1:
        return None
    if dp != planned_dp:
        return f"dp: the deployment runs ep = {ep} over {planned_dp} replicas; resizing is not run"
    if not plain_sync(sync) or sync.task_heads:
        return (
            f"sync: at ep = {ep} the replicas average every step's gradients, nothing else "
            "(no rounds, compression, robust aggregators, privacy or task heads)"
        )
    if late_policy != "wait":
        return (
            f"late_policy: at ep = {ep} every replica of an expert-parallel group takes part in "
            f"each step's token exchange, so none can be left out ({late_policy}): use wait"
        )
    return None


class ExpertRanks:
    """This replica's place among the expert-parallel replicas of its stage and the groups it
    meets them in, formed per epoch (``epoch()``: the worker's current one)."""

    def __init__(self, cfg: WorkerConfig, epoch: Callable[[], int]) -> None:
        if cfg.sequence_parallel:
            raise ValueError(
                f"ep={cfg.ep} with sequence parallelism: each tp rank would route its own "
                "slice of the sequence"
            )
        if cfg.replicas % cfg.ep:
            raise ValueError(f"ep={cfg.ep} does not divide the stage's {cfg.replicas} replicas")
        self.cfg, self.epoch = cfg, epoch
        self.ep, self.dp = cfg.ep, cfg.replicas
        # who exchanges tokens with whom, and who averages which gradients: the core's layout
        exchange = expert_parallel_groups(self.dp, self.ep)
        self.group = next(i for i, g in enumerate(exchange) if cfg.replica in g)
        self.rank = exchange[self.group].index(cfg.replica)  # = this replica's share
        self.averaging = gradient_averaging(self.dp, self.ep)["expert"]
        self.holding = self.averaging.group_of(cfg.replica)  # replicas with the same share
        self.timeout = timedelta(seconds=cfg.recv_timeout_s)
        self._store: Any = None
        self.mixtures: list[ExpertParallelMoE] = []
        self.group_pg: Any = None  # this epoch's expert-parallel group (a ProcessGroupGloo)
        self.formed = -1  # the epoch the expert-parallel group was formed in
        self.holders: Any = None  # a ProcessGroupGloo over the replicas of this share (dp > ep)
        self.holders_epoch = -1

    def split(self, module: StageModule) -> StageModule:
        """Keep this replica's experts of each mixture of ``module`` (built whole); the
        mixtures join the group before their first forward of an epoch."""
        parallelize_experts(module, None, self.rank, self.ep)
        self.mixtures = [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]
        for m in self.mixtures:
            m.register_forward_pre_hook(lambda *_: self.join())
        return module

    def store(self) -> Any:
        if self._store is None:
            host, _, port = self.cfg.tp_store.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"tp_store: {self.cfg.tp_store!r} is not host:port")
            # torch's stubs do not export the stores' names
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port), is_master=False, timeout=self.timeout
            )
        return self._store

    def join(self) -> None:
        """Form this epoch's expert-parallel group, once (every replica of the group calls it at
        the same point: its first mixture's forward of the epoch, or a Save)."""
        epoch = self.epoch()
        if self.formed == epoch:
            return
        # an older epoch's group is dropped: its members may have moved on
        prefix = f"{self._prefix(epoch)}/group{self.group}"
        store = dist.PrefixStore(prefix, self.store())  # type: ignore[attr-defined]
        self.group_pg = dist.ProcessGroupGloo(store, self.rank, self.ep, self.timeout)
        for m in self.mixtures:
            m.group = self.group_pg
        self.formed = epoch

    def _prefix(self, epoch: int) -> str:
        return f"ep/{self.cfg.stage}/e{epoch}/tp{self.cfg.tp_rank}"

    def _holders(self) -> Any:
        """This epoch's group of the replicas holding this share of the experts, one from each
        expert-parallel group (a ProcessGroupGloo; None at dp = ep), formed at the first step's
        averaging."""
        epoch = self.epoch()
        if len(self.holding) == 1:
            return None
        if self.holders is None or self.holders_epoch != epoch:
            name = f"{self._prefix(epoch)}/share{self.rank}"
            share = dist.PrefixStore(name, self.store())  # type: ignore[attr-defined]
            rank = self.holding.index(self.cfg.replica)
            self.holders = dist.ProcessGroupGloo(share, rank, len(self.holding), self.timeout)
            self.holders_epoch = epoch
        return self.holders

    def average_expert_grads(self, module: nn.Module) -> None:
        """The experts' gradients of the step: summed over the replicas holding the same
        experts, divided by ``dp`` (the dense ones are the collective's). At dp = ep each
        share is held once and its gradient is divided where the backward left it; else the
        gradients are summed in one flat buffer and, on the host, left as views of it (as the
        dense buckets are). Until 2026-12-04 both went through a flat copy and a copy back:
        about 1 ms of moe-mini's 2 ms data-parallel wait at dp = ep = 2 on this machine, in a
        window the cost model prices as the dense exchange alone."""
        params = [p for n, p in module.named_parameters() if kind_of(n) == "expert"]
        if not params:
            return
        for p in params:  # an expert no token reached: a zero gradient, as its peers'
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        holders = self._holders()
        if holders is None:
            for p in params:
                assert p.grad is not None
                p.grad.div_(self.averaging.divisor)
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).cpu()
        holders.allreduce([flat]).wait()
        flat.div_(self.averaging.divisor)
        offset = 0
        for p in params:  # views on the host (no pass), copies onto a GPU
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device)
            offset += p.numel()


def _host(_name: str, t: torch.Tensor) -> torch.Tensor:
    """A tp = 1 tensor as it is, on the host."""
    return t.detach().cpu().clone()


def write_gathered(
    path: Path,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    ranks: ExpertRanks,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    whole_of: Callable[[str, torch.Tensor], torch.Tensor] = _host,
) -> list[str]:
    """Gather the stage's experts, weights and optimizer moments, from the replicas of this
    group (a collective: each calls it) and write the ep = 1 stage at replica 0 (its tp rank 0);
    the weights' names (none elsewhere). At tp > 1 ``whole_of(name, shard)`` gathers a tensor's
    tp shards into the whole one (a collective over the replica's tp ranks), each expert's
    after the experts were gathered over the expert-parallel group."""
    ranks.join()
    whole = stage_module(spec, cfg.seed, cfg.first, cfg.last, cfg.ranges())
    opt = make_optimizer(optimizer_kind(optimizer), whole, cfg.lr)
    for mine, theirs in zip(opt.param_groups, optimizer.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    into = dict(whole.named_parameters())
    mixtures = [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]
    local = len(mixtures[0].experts) if mixtures else 0  # a stage may hold none (moe_every)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        return all_gather(t.cpu(), ranks.group_pg)

    with torch.no_grad():
        # the same order on every replica and tp rank: the collectives pair up
        for name, p in module.named_parameters():
            expert = expert_of(name)
            slots = optimizer.state.get(p, {})
            if expert is None:
                into[name].copy_(whole_of(name, p))
                if slots:
                    opt.state[into[name]] = {s: whole_of(name, v) for s, v in slots.items()}
                continue
            moments = {s: gather(v) for s, v in slots.items()}
            for source, part in enumerate(gather(p)):
                global_name = _renamed(name, expert, source * local + expert % local)
                into[global_name].copy_(whole_of(global_name, part))
                if moments:
                    opt.state[into[global_name]] = {
                        s: whole_of(global_name, v[source]) for s, v in moments.items()
                    }
    if cfg.replica != 0 or cfg.tp_rank != 0:
        return []
    return write_checkpoint(path, spec, whole, opt, steps)


def _renamed(name: str, old: int, new: int) -> str:
    """``name`` (of expert ``old``) for expert ``new``."""
    return name.replace(f"experts.{old}.", f"experts.{new}.", 1)
