"""A stage worker's tensor-parallel rank: joining its group, and checkpoints across tp.

The ranks of one stage replica meet in a torch.distributed process group (gloo on the CPU, NCCL
on CUDA) through the TCPStore the deployment hosts (its address in each
:class:`~dmsc.runtime.compute.config.WorkerConfig`; keys under a prefix per stage, replica and
epoch, so that groups never mix). Each process serves one stage, so the group is the process's
default one. Checkpoints stay in the tp = 1 format: :func:`write_gathered` puts the weights, the
optimizer's moments and a sync mode's round state back together (a collective: every rank calls
it, rank 0 writes) and :func:`load_sharded` (:func:`round_state` for the round) reads a tp = 1
file and keeps this rank's shard. At ep > 1 the stage keeps its replica's experts (each cut to
this rank's shard at tp > 1) and its checkpoint is gathered over the expert-parallel group, then
over the tp ranks (:mod:`.ep_worker`).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dmsc.runtime.compute import ep_worker
from dmsc.runtime.compute.checkpoints import StageState, load_state, write_checkpoint
from dmsc.runtime.compute.config import WorkerConfig
from dmsc.runtime.compute.ep_worker import ExpertRanks
from dmsc.runtime.compute.models.chain import StageModule
from dmsc.runtime.compute.models.hf import stage_module
from dmsc.runtime.compute.outer_sync import make_optimizer, optimizer_kind
from dmsc.runtime.compute.tensor_parallel import parallelize_stage, shard, split_of, unshard
from dmsc.runtime.compute.tp_sync import ShardLayout, round_state_cut, round_state_whole
from dmsc.spec import TransformerSpec

JOIN_TIMEOUT_S = 120.0  # for every rank of the group to arrive, and for a collective


def join_group(cfg: WorkerConfig) -> None:
    """Join this replica's tensor-parallel group (rank ``cfg.tp_rank`` of ``cfg.tp``)."""
    host, _, port = cfg.tp_store.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"tp_store: {cfg.tp_store!r} is not host:port")
    timeout = timedelta(seconds=JOIN_TIMEOUT_S)
    # torch's stubs do not export the stores' names
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    prefix = dist.PrefixStore(  # type: ignore[attr-defined]
        f"tp/{cfg.stage}/{cfg.replica}/{cfg.epoch}", store
    )
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, store=prefix, rank=cfg.tp_rank, world_size=cfg.tp, timeout=timeout
    )


def stage(
    spec: TransformerSpec, cfg: WorkerConfig, experts: ExpertRanks | None = None
) -> StageModule:
    """The stage ``cfg`` names, on the host: whole, or at tp > 1 this rank's shard of it (the
    group joined first), or at ep > 1 with only this replica's experts (``experts``)."""
    module = stage_module(spec, cfg.seed, cfg.first, cfg.last, cfg.ranges())
    if cfg.tp > 1:
        join_group(cfg)
        parallelize_stage(spec, module, sequence=cfg.sequence_parallel)
    if experts is not None:
        experts.split(module)
    return module


def write(
    path: Path,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
    steps: int,
    extra: dict[str, torch.Tensor] | None = None,
    experts: ExpertRanks | None = None,
) -> list[str]:
    """Write the stage's checkpoint (:func:`write_gathered` at tp > 1, the experts gathered at
    ep > 1); the weights' names."""
    if experts is not None:
        if cfg.tp == 1:
            return ep_worker.write_gathered(path, spec, cfg, experts, module, optimizer, steps)
        whole_of = lambda name, t: _gather(spec, name, t)  # noqa: E731
        return ep_worker.write_gathered(
            path, spec, cfg, experts, module, optimizer, steps, whole_of
        )
    if cfg.tp > 1:
        return write_gathered(path, spec, cfg, module, optimizer, steps, extra)
    return write_checkpoint(path, spec, module, optimizer, steps, extra)


def load(
    state: StageState,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    module: StageModule,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load a checkpoint's state (:func:`load_sharded` at tp > 1); the steps done."""
    if cfg.tp > 1:
        return load_sharded(state, spec, cfg, module, optimizer)
    return load_state(state, spec, module, optimizer)


def shard_layout(spec: TransformerSpec, cfg: WorkerConfig, module: nn.Module) -> ShardLayout | None:
    """Where this rank's flat vector sits in its replica's (None at tp = 1), for a sync mode."""
    if cfg.tp == 1:
        return None
    return ShardLayout(spec, module.named_parameters(), cfg.tp_rank, cfg.tp)


def round_state(
    state: StageState, spec: TransformerSpec, cfg: WorkerConfig, module: nn.Module
) -> dict[str, torch.Tensor]:
    """A loaded checkpoint's sync round state (``dmsc.sync.*``), at tp > 1 cut to this rank."""
    held = {k: v for k, v in state.moments.items() if k.startswith("dmsc.sync.")}
    layout = shard_layout(spec, cfg, module)
    return held if layout is None else round_state_cut(layout, held)


def _whole(
    spec: TransformerSpec, cfg: WorkerConfig, optimizer: torch.optim.Optimizer
) -> tuple[StageModule, torch.optim.Optimizer]:
    """A tp = 1 copy of this stage on the host, with an optimizer of the same kind and rates."""
    whole = stage_module(spec, cfg.seed, cfg.first, cfg.last, cfg.ranges())
    opt = make_optimizer(optimizer_kind(optimizer), whole, cfg.lr)
    for mine, theirs in zip(opt.param_groups, optimizer.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    return whole, opt


def _gather(spec: TransformerSpec, name: str, t: torch.Tensor) -> torch.Tensor:
    split = split_of(spec, name)
    if split is None or t.dim() == 0:
        return t.detach().cpu().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return unshard([p.cpu() for p in parts], split, spec.vocab)


def write_gathered(
    path: Path,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """Gather the stage's weights, optimizer moments and round state (``extra``, of
    :meth:`~.outer_sync.ReplicaSync.state`) from every rank (a collective) and write them at
    rank 0 in the tp = 1 format; the names of the weights (none at other ranks)."""
    whole, opt = _whole(spec, cfg, optimizer)
    if extra:
        layout = ShardLayout(spec, module.named_parameters(), cfg.tp_rank, cfg.tp)
        extra = round_state_whole(layout, extra)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in whole.named_parameters():
            p.copy_(_gather(spec, name, params[name]))
    whole_params = dict(whole.named_parameters())
    for name, p in params.items():  # every rank holds the same slots in the same order
        slots = optimizer.state.get(p, {})
        if slots:
            opt.state[whole_params[name]] = {s: _gather(spec, name, v) for s, v in slots.items()}
    if cfg.tp_rank != 0:
        return []
    return write_checkpoint(path, spec, whole, opt, steps, extra)


def load_sharded(
    state: StageState,
    spec: TransformerSpec,
    cfg: WorkerConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> int:
    """Load a tp = 1 checkpoint's state into this rank's shard; the steps done. A state that
    does not fit raises :class:`~dmsc.runtime.compute.checkpoints.CheckpointError`."""
    whole, opt = _whole(spec, cfg, optimizer)
    steps = load_state(state, spec, whole, opt)
    held = dict(whole.named_parameters())

    def cut(name: str, t: torch.Tensor) -> torch.Tensor:
        split = split_of(spec, name)
        return t if split is None or t.dim() == 0 else shard(t, split, cfg.tp_rank, cfg.tp)

    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(cut(name, held[name].detach()))
            slots = opt.state.get(held[name], {})
            if slots:
                optimizer.state[p] = {  # contiguous: the fused AdamW (.checkpoints.load_state)
                    s: cut(name, v).to(p.device, copy=True, memory_format=torch.contiguous_format)
                    for s, v in slots.items()
                }
            else:
                optimizer.state.pop(p, None)
    for mine, theirs in zip(optimizer.param_groups, opt.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    optimizer.zero_grad(set_to_none=True)
    return steps
