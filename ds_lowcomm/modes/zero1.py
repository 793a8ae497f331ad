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
from typing import TYPE_CHECKING

import torch

from ds_lowcomm.checkpoint import gather_full
from ds_lowcomm.modes import Mode, register, require_one_shard_group
from ds_lowcomm.shard_adamw import ShardAdamW
from ds_lowcomm.sharded_step import ShardedStepRound

if TYPE_CHECKING:
    from ds_lowcomm.optimizer import LowCommOptimizer

@dataclass(frozen=True)
class Zero1Options:
    """zero1 has no options of its own."""


@register
class Zero1(Mode):
    """Synchronous: reduce-scatter, step and all-gather at every boundary, on the training thread."""

    name = "zero1"
    Options = Zero1Options

    def __init__(self, opt: "LowCommOptimizer", options: Zero1Options) -> None:
        super().__init__(opt, options)
        require_one_shard_group(opt, self.name)
        self.adamw = ShardAdamW(opt.flat.layout, opt.flat.buffer)

    def step(self) -> None:
        opt = self.opt
        rnd = ShardedStepRound(opt, self.adamw, opt.grads.buffer, opt.flat.buffer,
                               scale=1.0 / opt.topology.shard.world)
        rnd.pack()
        opt.worker.wait(opt.worker.submit(rnd))
        rnd.install()
        opt.grads.zero_()
        opt.step_taken()

    def master_weights(self) -> torch.Tensor:
        return gather_full(self.opt.checkpoint_comm, self.opt.flat.layout, self.adamw.master)

    def state_dict(self) -> dict:
        return {"step": self.adamw.step_count}

    def sharded_state(self) -> dict:
        return self.adamw.sharded_state()

    def load_state_dict(self, state: dict, shards) -> None:
        """The model's weights come from DeepSpeed's file: the master's last all-gather."""
        self.adamw.load_shards(shards, state["step"])

    def load_weights(self, shards) -> None:
        self.adamw.load_shards(shards, None)
        self.opt.set_params(shards.full("master", self.adamw.master))
