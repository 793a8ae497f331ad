"""desloc: DES-LOC — Desynced Low-Communication Adam (Iacob et al., arXiv 2505.22549).

Each replica (a shard group: ZeRO-1 inside it as usual) runs AdamW on its own data; across replica
groups, each rank averages its own shard with the ranks of the same index in the other replicas:
the fp32 master every ``param_sync_every`` (Kx) steps, the first moment every
``momentum_sync_every`` (Ku, default 3·Kx), the second moment every ``variance_sync_every`` (Kv,
default 6·Kx). v is averaged (not √v) and the step count never is. Optionally the parameter
average feeds an outer Nesterov optimizer (DiLoCo-style: pseudo-gradient = parameters at the last
sync − average; ``outer_lr``, ``outer_momentum``). The averages due in the same
step travel one all-reduce per state, in place, after the local update and before the all-gather
inside the shard group. Local Adam is the special case Kx = Ku = Kv; Kx = Ku = Kv = 1 is *not* DDP (averaging Adam
updates is not Adam on the averaged gradient).

Bytes per rank per step across replica groups, R replicas, S shard elements in fp32:
2(R−1)/R · 4·S · (1/Kx + 1/Ku + 1/Kv) — with R = 2, one shard per period.
Replicas differ between syncs: each rank saves its replica's shards of θ, m and v, and a resume
with the same layout gives every replica its own; at another world size or ``shard_group_size``
every replica starts from the average of the saved replicas (a sync of all three).

Non-finite gradients are judged per replica (the norm all-reduce inside the shard group): a
replica whose gradient is non-finite skips its local update and keeps its state from before the
step, so what it brings to an average is always finite. The periods count rounds, which every
replica runs whatever its verdicts, so replicas always meet at the same steps; a replica that
skipped has made one Adam step fewer (its own bias correction and, as in stock DeepSpeed, its
learning-rate schedule wait one step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ds_lowcomm.checkpoint import CheckpointError, check_rank_layout, rank_layout
from ds_lowcomm.config import option
from ds_lowcomm.shard.flat import gather_full
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode, require_shard_group_size
from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.step import ShardedStepRound

NEVER = 0  # the internal value of "never"


@dataclass(frozen=True)
class DeslocOptions:
    param_sync_every: int = option(16, "Kx: steps between averages of the fp32 master", minimum=1)
    momentum_sync_every: Optional[int] = option(None, "Ku: steps between averages of the first moment; "
                                                "null = 3·Kx, 0 = never (explicit opt-in)", minimum=0)
    variance_sync_every: Optional[int] = option(None, "Kv: steps between averages of the second moment; "
                                                "null = 6·Kx, 0 = never (explicit opt-in)", minimum=0)
    outer_lr: float = option(1.0, "outer optimizer learning rate on the parameter average "
                             "(DiLoCo-style; 1 with outer_momentum 0 = plain averaging)", minimum=0,
                             exclusive_minimum=True)
    outer_momentum: float = option(0.0, "outer Nesterov momentum; 0 = off (plain averaging)", minimum=0,
                                   below=1)


class Desloc(Mode):
    """Local AdamW per replica, with independent averaging periods for θ, m and v."""

    name = "desloc"
    Options = DeslocOptions
    has_rank_state = True

    @classmethod
    def check_config(cls, ds: dict, cfg) -> None:
        require_shard_group_size(cfg, cls.name, "averages state between shard groups")

    def __init__(self, ctx: ModeContext, options: DeslocOptions) -> None:
        super().__init__(ctx, options)
        kx = options.param_sync_every
        ku = 3 * kx if options.momentum_sync_every is None else options.momentum_sync_every
        kv = 6 * kx if options.variance_sync_every is None else options.variance_sync_every
        self.periods = {"master": kx, "exp_avg": ku, "exp_avg_sq": kv}
        self.adamw = ShardAdamW(ctx.flat.layout, ctx.flat.buffer)
        self.rounds = 0  # rounds run, skipped or not: equal on every replica, it paces the syncs
        # DiLoCo-style outer Nesterov: the anchor is the parameters at the last sync, the
        # pseudo-gradient is anchor − average. Off (plain averaging) unless configured.
        self.outer = options.outer_lr != 1.0 or options.outer_momentum != 0.0
        if self.outer:
            self.anchor = self.adamw.master.clone()
            self.outer_buf = torch.zeros_like(self.anchor)

    def step(self) -> None:
        ctx = self.ctx
        rnd = ShardedStepRound(ctx, self.adamw, ctx.grads.buffer, ctx.flat.buffer,
                               scale=1.0 / ctx.topology.shard.world, after_update=self._average_due)
        rnd.pack()
        ctx.worker.wait(ctx.worker.submit(rnd))
        rnd.install()
        ctx.grads.zero_()
        ctx.step_taken()

    def _average_due(self) -> None:
        """After the local update (or its skip), before the all-gather: average the states due
        this round."""
        replica = self.ctx.topology.replica
        self.rounds += 1
        t = self.rounds
        due = [k for k, every in self.periods.items() if every != NEVER and t % every == 0]
        if replica is None or not due:
            return
        # Each state averaged in place, one all-reduce apiece: one concatenated call would hold a
        # copy of them all (up to 12/S bytes per parameter) for the same bytes on the wire.
        for k in due:
            state = getattr(self.adamw, k)
            replica.all_reduce(state)
            state.mul_(1.0 / replica.world)
        if self.outer and "master" in due:
            o = self.options
            delta = self.anchor - self.adamw.master  # identical on every replica: from averages
            self.outer_buf.mul_(o.outer_momentum).add_(delta)
            self.anchor.sub_(delta.add_(self.outer_buf, alpha=o.outer_momentum), alpha=o.outer_lr)
            self.adamw.master.copy_(self.anchor)

    def metrics(self) -> dict:
        return {"sync_periods": dict(self.periods)}

    # -- state: replicas differ between syncs; each rank saves its replica's shards ---------------

    _SHARDED = ("master", "exp_avg", "exp_avg_sq")
    _OUTER = ("anchor", "outer_buf")

    def master_weights(self) -> torch.Tensor:
        """This replica's full master (collective over the shard group)."""
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.adamw.master)

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def sharded_state(self) -> dict:
        """This replica's shards of the master and moments, and of the outer optimizer's anchor
        and momentum (the same on every replica); weights-only loads and the export take replica
        0's master."""
        a = self.adamw
        state = {"master": a.master, "exp_avg": a.exp_avg, "exp_avg_sq": a.exp_avg_sq}
        if self.outer:
            state.update(anchor=self.anchor, outer_buf=self.outer_buf)
        return state

    def load_state_dict(self, state: dict, shards) -> None:
        """Saved with this layout: each replica its own state (its Adam step count comes with
        its rank file). At another world size or ``shard_group_size``: every replica the average
        of the saved replicas' master and moments, what a sync of θ, m and v at the save step
        would have made (:meth:`reshard_rank_state` then sets the step count and the model)."""
        topo, layout = self.ctx.topology, self.ctx.flat.layout
        self.rounds = int(state.get("rounds", state.get("step", 0)))
        same = shards.same_layout(topo)
        if same:
            mine = shards.of_replica(topo.rank // topo.shard_group_size)
            read = lambda key, like: mine.shard(key, layout, like)  # noqa: E731
        else:
            read = lambda key, like: shards.replica_mean(key, layout.shard_start, layout.shard_size, like)  # noqa: E731
        saved = shards.keys()  # (moments and outer state were in the rank files before ds_lowcomm/2.1)
        a = self.adamw
        for key in self._SHARDED:
            if key in saved:
                setattr(a, key, read(key, a.master))
        if same and "master" in saved:
            # The model file holds replica 0's parameters: this replica's own, from its files.
            self.ctx.set_params(mine.full("master", a.master))
        if self.outer:
            if "anchor" not in saved and shards.same_layout(topo) and "anchor" in shards.rank_state(topo.rank):
                return  # in the rank file (older checkpoints)
            if "anchor" not in saved:
                raise CheckpointError("this desloc checkpoint has no outer-optimizer state (saved with "
                                      "outer_lr 1 and outer_momentum 0); resume with those settings")
            self.anchor, self.outer_buf = (read(key, a.master) for key in self._OUTER)

    def load_weights(self, shards) -> None:
        """Replica 0's master for every replica; moments, steps and the outer optimizer restart."""
        self.adamw.load_shards(shards, None)
        self.rounds = 0
        if self.outer:
            self.anchor = self.adamw.master.clone()
            self.outer_buf = torch.zeros_like(self.anchor)
        self.ctx.set_params(shards.full("master", self.adamw.master))

    def rank_state_dict(self) -> dict:
        """This replica's Adam step count (it lags where the replica skipped a step)."""
        return {**rank_layout(self.ctx.topology), "step": self.adamw.step_count}

    def load_rank_state_dict(self, state: dict) -> None:
        check_rank_layout(state, self.ctx.topology, "each replica's own AdamW state")
        # Checkpoints written before the moments were sharded keep them (and the master, before
        # sharded saves; the outer state too) in the rank file.
        for k in self._SHARDED:
            if k in state:
                getattr(self.adamw, k).copy_(state[k])
        self.adamw.step_count = int(state.get("step", self.adamw.step_count))  # this replica's own
        if self.outer and "anchor" in state:
            self.anchor.copy_(state["anchor"])
            self.outer_buf.copy_(state["outer_buf"])
        if "master" in state:
            # (A checkpoint from before sharded saves: the master only in the rank files.) The
            # model file holds replica 0's parameters: this replica's own (collective).
            ctx = self.ctx
            ctx.checkpoint_comm.all_gather(ctx.flat.buffer, self.adamw.master.to(ctx.flat.dtype, copy=True))

    def reshard_rank_state(self, shards) -> None:
        """Saved at another layout: the replicas were averaged (:meth:`load_state_dict`); the Adam
        step count is saved replica 0's, and the model gets the averaged master (read from the
        files, no communication)."""
        self.adamw.step_count = int(shards.rank_state(0)["step"])
        self.ctx.set_params(shards.replica_mean("master", 0, shards.meta["numel"], self.adamw.master))
