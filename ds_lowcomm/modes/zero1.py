"""zero1: synchronous sharded ZeRO-1 with a true reduce-scatter, the reference every mode is held to.

Per optimizer step, over the shard group (the whole world)::

    reduce-scatter  fp32 (or comm_dtype) gradient sums         (W-1)/W · P · comm bytes
    all-reduce      squared norm of the gradient shards           2(W-1)/W · 4 bytes
    local           clip, AdamW on the fp32 shard
    all-gather      updated parameters                          (W-1)/W · P · param bytes

P is the padded parameter count. DeepSpeed's own stage-1 optimizer (0.19.8) all-reduces the full
gradient instead (``stage_1_and_2.py`` ``average_tensor``), twice the gradient bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from ds_lowcomm.flat import gather_full
from ds_lowcomm.context import ModeContext
from ds_lowcomm.modes.base import Mode, require_one_shard_group
from ds_lowcomm.shard_adamw import ShardAdamW
from ds_lowcomm.sharded_step import ShardedStepRound

@dataclass(frozen=True)
class Zero1Options:
    """zero1 has no options of its own."""


class Zero1(Mode):
    """Synchronous: reduce-scatter, step and all-gather at every boundary, on the training thread."""

    name = "zero1"
    Options = Zero1Options

    def __init__(self, ctx: ModeContext, options: Zero1Options) -> None:
        super().__init__(ctx, options)
        require_one_shard_group(ctx, self.name)
        self.adamw = ShardAdamW(ctx.flat.layout, ctx.flat.buffer)

    def step(self) -> None:
        ctx = self.ctx
        rnd = ShardedStepRound(ctx, self.adamw, ctx.grads.buffer, ctx.flat.buffer,
                               scale=1.0 / ctx.topology.shard.world)
        rnd.pack()
        ctx.worker.wait(ctx.worker.submit(rnd))
        rnd.install()
        ctx.grads.zero_()
        ctx.step_taken()

    def master_weights(self) -> torch.Tensor:
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.adamw.master)

    def state_dict(self) -> dict:
        return {"step": self.adamw.step_count}

    def sharded_state(self) -> dict:
        return self.adamw.sharded_state()

    def load_state_dict(self, state: dict, shards) -> None:
        """The model's weights come from DeepSpeed's file: the master's last all-gather."""
        self.adamw.load_shards(shards, state["step"])

    def load_weights(self, shards) -> None:
        self.adamw.load_shards(shards, None)
        self.ctx.set_params(shards.full("master", self.adamw.master))
