"""A stage worker's expert-parallel side: its share of the experts, its groups, its checkpoints.

A plan with ``ep`` > 1 cuts the ``dp`` replicas of each stage into expert-parallel groups of
``ep`` consecutive replicas (:func:`~.expert_parallel.expert_parallel_groups`, the cost model's
layout): replica ``r`` holds share ``r % ep`` of the experts (:mod:`.expert_parallel`) and
exchanges tokens with the others of its group by all-to-all. Here a worker

- builds its stage whole (from the seed) and keeps its share of the experts
  (:meth:`ExpertRanks.split`);
- joins its expert-parallel group through the deployment's TCPStore (``cfg.tp_store``, the
  store the data-parallel groups meet at; keys under ``ep/STAGE/eEPOCH/groupN``): the process's
  default group, as a tensor-parallel rank's is (a plan with ep > 1 has tp = 1: ``dmsc up``
  refuses both). The group is formed at the first mixture forward of each epoch (a forward
  pre-hook), not at start: a replacement started by a recovery builds its stage before the
  others moved to its epoch, and they meet again at the next step's forward. A member that
  died fails the all-to-all (gloo sees the socket close) or leaves it waiting for the receive
  timeout; the recovery's new epoch re-forms the group around the replacement;
- has its gradients averaged as :func:`~.expert_parallel.gradient_averaging` says: the shared
  (non-expert) ones by the data-parallel collective over all ``dp`` replicas
  (:mod:`.dp_collective`, which takes only those), the experts' summed over the ``dp / ep``
  replicas holding the same share (a plain gloo group formed per epoch at the step's averaging,
  under ``ep/STAGE/eEPOCH/shareN``; none at dp = ep) and divided by ``dp``
  (:meth:`ExpertRanks.average_expert_grads`);
- saves the gathered (ep = 1) stage: every replica of the first group gathers its experts'
  weights and moments, replica 0 writes (:func:`write_gathered`), so a checkpoint loads at any
  ep and exports as any other. Loading needs nothing of its own: a worker's parameters keep
  their global names, so it reads just its experts from an ep = 1 file.

What does not run at ep > 1 is refused, not approximated: inference (a mixture's forward needs
every replica of its group, and a request goes through one replica's pipeline) and, for a
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

# why a worker refuses an inference step at ep > 1
EP_INFERENCE = (
    "a mixture's forward needs every replica of its expert-parallel group, and a request goes "
    "through one replica's pipeline; serve an ep = 1 deployment of the checkpoint"
)


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
        if cfg.tp > 1:
            raise ValueError(f"ep={cfg.ep} with tp={cfg.tp} is not run")
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
        self.formed = -1  # the epoch the expert-parallel group was formed in
        self.holders: Any = None  # a ProcessGroupGloo over the replicas of this share (dp > ep)
        self.holders_epoch = -1

    def split(self, module: StageModule) -> StageModule:
        """Keep this replica's experts of each mixture of ``module`` (built whole); the
        mixtures join the group before their first forward of an epoch."""
        parallelize_experts(module, None, self.rank, self.ep)
        for m in module.modules():
            if isinstance(m, ExpertParallelMoE):
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
        if dist.is_initialized():
            dist.destroy_process_group()  # an older epoch's: its members may have moved on
        prefix = f"ep/{self.cfg.stage}/e{epoch}/group{self.group}"
        store = dist.PrefixStore(prefix, self.store())  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo", store=store, rank=self.rank, world_size=self.ep, timeout=self.timeout
        )
        self.formed = epoch

    def _holders(self) -> Any:
        """This epoch's group of the replicas holding this share of the experts, one from each
        expert-parallel group (a ProcessGroupGloo; None at dp = ep), formed at the first step's
        averaging."""
        epoch = self.epoch()
        if len(self.holding) == 1:
            return None
        if self.holders is None or self.holders_epoch != epoch:
            name = f"ep/{self.cfg.stage}/e{epoch}/share{self.rank}"
            share = dist.PrefixStore(name, self.store())  # type: ignore[attr-defined]
            rank = self.holding.index(self.cfg.replica)
            self.holders = dist.ProcessGroupGloo(share, rank, len(self.holding), self.timeout)
            self.holders_epoch = epoch
        return self.holders

    def average_expert_grads(self, module: nn.Module) -> None:
        """The experts' gradients of the step: summed over the replicas holding the same
        experts, divided by ``dp`` (the dense ones are the collective's)."""
        params = [p for n, p in module.named_parameters() if kind_of(n) == "expert"]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).cpu()
        holders = self._holders()
        if holders is not None:
            holders.allreduce([flat]).wait()
        flat /= self.averaging.divisor
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.device, copy=True)
            offset += p.numel()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return [p.cpu() for p in parts]


def write_gathered(
    path: Path,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    ranks: ExpertRanks,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
) -> list[str]:
    """Gather the stage's experts, weights and optimizer moments, from the replicas of this
    group (a collective: each calls it) and write the ep = 1 stage at replica 0; the weights'
    names (none elsewhere)."""
    ranks.join()
    whole = stage_module(spec, cfg.seed, cfg.first, cfg.last, cfg.ranges())
    opt = make_optimizer(optimizer_kind(optimizer), whole, cfg.lr)
    for mine, theirs in zip(opt.param_groups, optimizer.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    into = dict(whole.named_parameters())
    mixtures = [m for m in module.modules() if isinstance(m, ExpertParallelMoE)]
    local = len(mixtures[0].experts) if mixtures else 0  # a stage may hold none (moe_every)
    with torch.no_grad():
        for name, p in module.named_parameters():  # the same order on every replica
            expert = expert_of(name)
            slots = optimizer.state.get(p, {})
            if expert is None:
                into[name].copy_(p.detach().cpu())
                if slots:
                    opt.state[into[name]] = {s: v.detach().cpu().clone() for s, v in slots.items()}
                continue
            moments = {s: _gather(v) for s, v in slots.items()}
            for source, part in enumerate(_gather(p)):
                global_name = _renamed(name, expert, source * local + expert % local)
                into[global_name].copy_(part)
                if moments:
                    opt.state[into[global_name]] = {s: v[source] for s, v in moments.items()}
    if cfg.replica != 0:
        return []
    return write_checkpoint(path, spec, whole, opt, steps)


def _renamed(name: str, old: int, new: int) -> str:
    """``name`` (of expert ``old``) for expert ``new``."""
    return name.replace(f"experts.{old}.", f"experts.{new}.", 1)
