"""How the data-parallel replicas of a stage agree under a sync mode other than plain averaging.

Plain every-step averaging of fp32 gradients stays in :mod:`dmsc.runtime.compute.gradient_sync`
(with its late-gradient policies). Everything else goes through :class:`ReplicaSync`, one object
per replica and per task's :class:`~dmsc.runtime.transport.messages.SyncSettings`:

- **what is agreed on**: with ``every-step`` the step's gradient; with ``diloco``, ``fedavg`` and
  ``fedprox`` the *pseudo-gradient* of a round, ``anchor - params`` after ``inner_steps`` local
  optimizer steps (Douillard et al. 2023, "DiLoCo"). The outer step is SGD on the agreed
  pseudo-gradient, with Nesterov momentum for DiLoCo (outer rate 0.7, momentum 0.9 by default)
  and a plain average of the models for FedAvg/FedProx (rate 1, no momentum: McMahan et al.
  2017; FedProx, Li et al. 2020, adds ``mu/2 |params - anchor|^2`` to each local step). With one
  inner step, inner SGD and an outer rate of 1 without momentum, DiLoCo is plain data
  parallelism (tests/integration/test_sync_modes.py checks it);
- **how it travels**: a codec of :mod:`~dmsc.runtime.compute.compression` (bf16, int8 with
  per-block scales, top-k with error feedback; PowerSGD in two rounds), or masked for secure
  aggregation (:mod:`~dmsc.runtime.compute.secure_agg`, X25519 key agreement once per session);
- **how it is combined**: a plain mean of fp32 updates (no codec, robust aggregator, privacy
  or secure aggregation) by all-reduce among the replicas
  (:mod:`~dmsc.runtime.compute.dp_collective`: DiLoCo's and FedAvg's plain rounds), anything
  else at the leader: an aggregator of
  :mod:`~dmsc.runtime.compute.aggregators` (weighted mean, median, trimmed mean, Krum), after
  each replica clipped its update and with Gaussian noise added to the combination when
  differential privacy is on (:mod:`~dmsc.runtime.compute.privacy`; the ledger's accountant
  gives epsilon).

At tp > 1 each tensor-parallel rank runs its replica's mode on its own shard, with the same rank
of the other replicas; what a mode computes over the whole update (the clipping norm, Krum's
distances, the noise) is the whole replica's (:mod:`~dmsc.runtime.compute.tp_sync`).

The leader sends the combination back in the codec's downlink form and takes the same decoded
vector as every other replica, so the replicas stay bit-identical after every round. A round's
state that must survive a rollback (the anchor and the outer momentum) travels in the stage's
checkpoint (:meth:`ReplicaSync.state` / :meth:`ReplicaSync.restore`); a codec's error feedback
starts again at zero after a rollback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dmsc.runtime.compute.aggregators import aggregate, parse_aggregator, summed
from dmsc.runtime.compute.comm_meter import METER
from dmsc.runtime.compute.compression import (
    Codec,
    CodecError,
    PowerSGD,
    downlink_codec,
    make_codec,
)
from dmsc.runtime.compute.gradient_sync import GradientSync, assign_grads, flatten_grads
from dmsc.runtime.compute.privacy import PrivacyLedger, add_noise, clip_update
from dmsc.runtime.compute.secure_agg import (
    MaskingParty,
    keys_from_tensor,
    keys_to_tensor,
    ring_from_payload,
    ring_to_payload,
    unmask_sum,
)
from dmsc.runtime.compute.tp_sync import ShardLayout
from dmsc.runtime.transport.messages import LatePolicy, SyncSettings
from dmsc.runtime.transport.rpc import BadRequest

KEY_ROUND, MASK_ROUND = 0, 1  # secure aggregation: public keys, then masked updates
P_ROUND, Q_ROUND = 0, 1  # PowerSGD's two factors


def plain_mean(s: SyncSettings) -> bool:
    """Whether the replicas' updates are averaged as they are: no codec, robust aggregator,
    privacy or secure aggregation (each of which needs the leader's star). Such a mean goes by
    all-reduce where the replicas have a collective (:mod:`.dp_collective`)."""
    return (
        s.compress == "none" and s.aggregator == "mean" and s.privacy_clip is None and not s.secure
    )


def by_collective(s: SyncSettings) -> bool:
    """Whether the replicas agree on their updates by a collective among themselves, as the
    cost model prices it (:mod:`dmsc.netmodel.sync`), where they have one: with no robust
    aggregator, privacy or secure aggregation, whatever the codec. fp32 and bf16 updates are
    all-reduced (bf16 summed in bfloat16, as PyTorch's ``bf16_compress_hook``), int8 ones on a
    ring that re-quantises at each hop (:mod:`.int8_ring`), PowerSGD's fp32 factors all-reduced
    in both rounds (Vogels et al. 2019; PyTorch's ``powerSGD_hook``), top-k payloads
    all-gathered (the replicas keep different indices). The rest goes through the stage
    leader, which is its point."""
    return (
        s.compression.kind in ("none", "bf16", "int8", "topk", "powersgd")
        and s.aggregator == "mean"
        and s.privacy_clip is None
        and not s.secure
    )


def plain_sync(s: SyncSettings) -> bool:
    """Every-step averaging of fp32 gradients with nothing on top: the plain path of
    :class:`~dmsc.runtime.compute.gradient_sync.GradientSync`, with every late policy."""
    return s.mode == "every-step" and plain_mean(s)


FUSED_DEVICES = ("cpu", "cuda")  # where PyTorch's AdamW has its fused kernel


def make_optimizer(kind: str, module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """A stage's (inner) optimizer: AdamW, or plain SGD (the reference of DiLoCo's test).

    AdamW is PyTorch's fused kernel where every parameter is a floating tensor on a device that
    has it: one pass over each parameter, its gradient and its two moments, as the cost model
    prices the step (28 bytes a parameter, :mod:`dmsc.netmodel.memory`). PyTorch's default
    (``foreach``) makes about ten passes: gpt-mini's step took 3.08 ms on one core of this
    project's CPU against 0.60 fused, and priced 1.2 (2026-12-05). The same update up to
    rounding; single-process training (:mod:`.reference`) keeps the default, so the runtime is
    checked against PyTorch's own."""
    params = list(module.parameters())
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    fused = bool(params) and all(
        p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params
    )
    return torch.optim.AdamW(params, lr=lr, fused=fused or None)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    return "sgd" if isinstance(optimizer, torch.optim.SGD) else "adamw"


def flat_params(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters in one float32 vector on the host (the order of ``flatten_grads``)."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])


def assign_params(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype))
            offset += p.numel()


class ReplicaSync:
    """One replica's side of a task's sync mode: agrees on updates through the stage leader and
    keeps the round's anchor, outer momentum, codec state, key pair and privacy ledger. At
    tp > 1 (``layout``: this rank's place in the replica) it is one rank's side, on its shard
    with the same rank of the other replicas (:mod:`.tp_sync`)."""

    def __init__(
        self,
        settings: SyncSettings,
        module: torch.nn.Module,
        star: GradientSync,
        seed: int = 0,
        layout: ShardLayout | None = None,
    ) -> None:
        self.settings = settings
        self.star = star
        self.layout = layout if layout is not None and layout.tp > 1 else None
        self.params = list(module.parameters())
        self.n = sum(p.numel() for p in self.params)
        shapes = [p.shape for p in self.params]
        name, form = settings.compress, settings.compression
        self.power = (
            PowerSGD(shapes, rank=form.rank, seed=seed) if form.kind == "powersgd" else None
        )
        self.codec: Codec | None = None
        self.down: Codec | None = None
        if self.power is None:
            codec = make_codec(name, self.n, shapes=shapes, seed=seed)
            assert not isinstance(codec, PowerSGD)
            self.codec, self.down = codec, downlink_codec(name, self.n)
        self.aggregator, self.agg_options = parse_aggregator(settings.aggregator)
        self.ledger = (
            PrivacyLedger(noise_multiplier=settings.privacy_noise, max_norm=settings.privacy_clip)
            if settings.privacy_clip is not None
            else None
        )
        # the leader's noise: seeded per stage, so that a rerun of the task draws the same
        self.noise = torch.Generator().manual_seed(seed * 7919 + star.cfg.stage)
        self.anchor = flat_params(self.params) if settings.outer else None
        self.momentum = torch.zeros(self.n) if settings.outer else None
        self.party: MaskingParty | None = None
        self.party_epoch = -1
        self.rounds = 0
        # the replicas' own collective, where they have one and the settings allow
        # (by_collective): plain rounds, every codec
        self.collective = star.collective if by_collective(settings) else None

    @property
    def quorum_ahead(self) -> bool:
        """Whether every step's exchange runs by the replicas' collective, whole after the
        backward: its quorum is then agreed in the backward
        (:meth:`.dp_collective.DataParallel.agreed`)."""
        return self.collective is not None and not self.settings.outer

    # -- the agreed update ---------------------------------------------------------------------
    def agree(
        self, step: int, update: torch.Tensor, policy: LatePolicy, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        """The update every replica applies, from this replica's ``update`` (a flat fp32
        vector): clipped, encoded, combined at the leader, decoded. Also the replicas left
        out (policy ``skip``)."""
        s = self.settings
        if s.privacy_clip is not None:  # at tp > 1 by the norm of the replica's whole update
            norm = self.layout.norm(update) if self.layout is not None else None
            update, _ = clip_update(update, s.privacy_clip, norm)
        poison = self.star.cfg.faults.get("poison")  # rehearsal: a hostile replica's update
        if poison is not None:
            update = update * float(poison.get("scale", -100.0))
        if s.secure:
            out, late = self._secure(step, update, policy, wait_s)
        elif self.power is not None:
            out, late = self._power(step, update, policy, wait_s)
        else:
            out, late = self._coded(step, update, policy, wait_s)
        if self.layout is not None:  # the ranks hold one copy of the parameters they share
            out = self.layout.same_whole(out)
        self.rounds += 1
        if self.ledger is not None:
            self.ledger.rounds = self.rounds
        return out, late

    def _finish(self, total: torch.Tensor, count: int) -> torch.Tensor:
        """The mean of ``count`` clipped updates from their sum, with the privacy noise."""
        s = self.settings
        if s.privacy_clip is not None and s.privacy_noise > 0:
            if self.layout is None:
                total = add_noise(total, s.privacy_noise, s.privacy_clip, self.noise)
            else:  # drawn for the whole replica, as at tp = 1, and cut to this rank's shard
                zero = torch.zeros(self.layout.whole_n, dtype=total.dtype)
                noise = add_noise(zero, s.privacy_noise, s.privacy_clip, self.noise)
                total = total + self.layout.cut(noise).to(total.device)
        return total / count

    def _present(self, parts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """At tp > 1, the leader's parts of the replicas every rank's leader has (``skip``
        may have left one rank without a replica's update that another has in time)."""
        if self.layout is None:
            return parts
        keep = self.layout.agree_present(sorted(parts), self.star.cfg.replicas)
        return {r: parts[r] for r in keep}

    def _coded(
        self, step: int, update: torch.Tensor, policy: LatePolicy, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        assert self.codec is not None and self.down is not None
        if self.collective is not None:
            form = self.settings.compression
            if form.kind == "bf16":  # summed in bfloat16 on the way
                out, late = self.collective.mean(
                    step, 0, 0, update.to(torch.bfloat16), policy, wait_s
                )
                return out.float(), late
            if form.kind == "int8":  # re-quantised at each hop of the ring
                return self.collective.int8_mean(step, 0, update, form.block, policy, wait_s)
            if form.kind == "topk":  # gathered: different indices

                def decoded(payload: torch.Tensor) -> torch.Tensor:
                    try:
                        return codec.decode(payload, n)
                    except CodecError as exc:
                        raise BadRequest(f"a replica's update is refused: {exc}") from None

                codec, n = self.codec, self.n
                payload = codec.encode(update)
                return self.collective.gathered_mean(step, 0, payload, decoded, policy, wait_s)
            return self.collective.mean(step, 0, 0, update, policy, wait_s)
        codec, down, n = self.codec, self.down, self.n

        def combine(parts: dict[int, torch.Tensor]) -> torch.Tensor:
            parts = self._present(parts)
            try:
                vectors = [codec.decode(parts[r], n) for r in sorted(parts)]
            except CodecError as exc:
                raise BadRequest(f"a replica's update is refused: {exc}") from None
            if self.aggregator == "mean":
                agreed = self._finish(summed(vectors), len(vectors))
            else:
                distances = self.layout.sq_distances if self.layout is not None else None
                agreed = aggregate(
                    self.aggregator, vectors, **self.agg_options, distances=distances
                )
                if self.settings.privacy_clip is not None and self.settings.privacy_noise > 0:
                    agreed = self._finish(agreed * len(vectors), len(vectors))
            return down.encode(agreed)

        answer, late = self.star.exchange(step, 0, codec.encode(update), combine, policy, wait_s)
        return down.decode(answer, n), late

    def _power(
        self, step: int, update: torch.Tensor, policy: LatePolicy, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        assert self.power is not None
        if self.collective is not None:  # each factor summed by all-reduce, as priced
            dp = self.collective
            p_mean, late = dp.mean(step, P_ROUND, P_ROUND, self.power.start(update), policy, wait_s)
            middle = self.power.middle(p_mean)
            q_mean, late2 = dp.mean(step, Q_ROUND, Q_ROUND, middle, policy, wait_s)
            return self.power.finish(q_mean), sorted(set(late) | set(late2))

        def mean(parts: dict[int, torch.Tensor]) -> torch.Tensor:
            parts = self._present(parts)
            sizes = {t.numel() for t in parts.values()}
            if len(sizes) != 1 or any(t.dtype != torch.float32 for t in parts.values()):
                raise BadRequest("PowerSGD factors of different sizes or types")
            return self._finish(summed(list(parts.values())), len(parts))

        p_mean, late = self.star.exchange(
            step, P_ROUND, self.power.start(update), mean, policy, wait_s
        )
        q_mean, late2 = self.star.exchange(
            step, Q_ROUND, self.power.middle(p_mean), mean, policy, wait_s
        )
        return self.power.finish(q_mean), sorted(set(late) | set(late2))

    def _secure(
        self, step: int, update: torch.Tensor, policy: LatePolicy, wait_s: float
    ) -> tuple[torch.Tensor, list[int]]:
        """Masked updates; the leader sums them and learns nothing else. A replica missing in
        a round fails it (policy ``skip`` is not honoured: its masks would not cancel; the
        round is run again by the orchestrator's retry of the step)."""
        cfg = self.star.cfg
        epoch = self.star.peers.epoch
        if self.party is None or self.party_epoch != epoch:  # a replacement has new keys
            self.party, self.party_epoch = MaskingParty(cfg.replica, cfg.replicas), epoch
            mine = keys_to_tensor([self.party.public_bytes()])

            def gather_keys(parts: dict[int, torch.Tensor]) -> torch.Tensor:
                if len(parts) != cfg.replicas:
                    raise BadRequest("secure aggregation: a replica sent no key")
                return torch.cat([parts[r] for r in range(cfg.replicas)])

            keys, _ = self.star.exchange(step, KEY_ROUND, mine, gather_keys, "wait", wait_s)
            self.party.agree(keys_from_tensor(keys, cfg.replicas))
        # fresh masks for every attempt: a step run again after a recovery is in a new epoch
        masked = ring_to_payload(self.party.mask(update, f"{step}/{epoch}"))

        def unmask(parts: dict[int, torch.Tensor]) -> torch.Tensor:
            if len(parts) != cfg.replicas:
                raise BadRequest("secure aggregation: a replica's masked update is missing")
            try:
                total = unmask_sum([ring_from_payload(parts[r]) for r in range(cfg.replicas)])
            except ValueError as exc:
                raise BadRequest(f"a replica's masked update is refused: {exc}") from None
            return self._finish(total, cfg.replicas)

        agreed, _ = self.star.exchange(step, MASK_ROUND, masked, unmask, "wait", wait_s)
        del policy
        return agreed, []

    # -- every-step: the gradient -----------------------------------------------------------------
    def sync_gradients(self, step: int, policy: LatePolicy, wait_s: float) -> list[int]:
        """Replace every parameter's gradient with the agreed one (every-step mode)."""
        with METER.timed("dp"):  # the step's exposed data-parallel time (.comm_meter)
            agreed, late = self.agree(step, flatten_grads(self.params).cpu(), policy, wait_s)
            # by collective the answer is a vector of this replica's own (the update summed
            # in place, or a new one): the gradients become views of it, no pass over them
            assign_grads(self.params, agreed, copy=self.collective is None)
        return late

    # -- rounds: the outer step ---------------------------------------------------------------
    def add_proximal(self) -> None:
        """FedProx: the gradient of ``mu/2 |params - anchor|^2`` added to each local step's."""
        if self.settings.mode != "fedprox" or self.anchor is None:
            return
        mu, offset = self.settings.prox_mu, 0
        for p in self.params:
            a = self.anchor[offset : offset + p.numel()].view_as(p).to(p.device, p.dtype)
            offset += p.numel()
            if p.grad is not None:
                p.grad.add_(p.detach() - a, alpha=mu)

    def outer_step(self, step: int, policy: LatePolicy, wait_s: float) -> list[int]:
        """The end of a round: agree on the pseudo-gradient ``anchor - params``, then move the
        anchor by the outer optimizer and set the parameters to it."""
        assert self.anchor is not None and self.momentum is not None
        s = self.settings
        with METER.timed("dp"):  # the round's exchange, in the step that ends it (.comm_meter)
            delta, late = self.agree(step, self.anchor - flat_params(self.params), policy, wait_s)
        if s.mode == "diloco" and s.outer_momentum > 0:  # SGD with Nesterov momentum
            self.momentum.mul_(s.outer_momentum).add_(delta)
            delta = delta + s.outer_momentum * self.momentum
        self.anchor = self.anchor - s.round_rate * delta
        assign_params(self.params, self.anchor)
        return late

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the round (empty for every-step)."""
        if self.anchor is None or self.momentum is None:
            return {}
        return {
            "dmsc.sync.anchor": self.anchor.clone(),
            "dmsc.sync.momentum": self.momentum.clone(),
            "dmsc.sync.rounds": torch.tensor([self.rounds]),
        }

    def restore(self, held: dict[str, torch.Tensor]) -> None:
        """After a Load: the checkpoint's round state, else the loaded parameters start one."""
        anchor = held.get("dmsc.sync.anchor")
        if self.settings.outer:
            ok = anchor is not None and anchor.numel() == self.n
            self.anchor = anchor.float().clone() if ok else flat_params(self.params)  # type: ignore[union-attr]
            momentum = held.get("dmsc.sync.momentum")
            ok = ok and momentum is not None and momentum.numel() == self.n
            self.momentum = momentum.float().clone() if ok else torch.zeros(self.n)  # type: ignore[union-attr]
        rounds = held.get("dmsc.sync.rounds")
        self.rounds = int(rounds[0]) if rounds is not None and rounds.numel() == 1 else 0
        if self.ledger is not None:
            self.ledger.rounds = self.rounds
        self.party = None  # keys are agreed again
