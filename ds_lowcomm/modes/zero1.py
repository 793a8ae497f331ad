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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List

import torch

from ds_lowcomm.checkpoint import gather_full, shard_of
from ds_lowcomm.modes import Mode, register
from ds_lowcomm.round import Round
from ds_lowcomm.shard_adamw import ShardAdamW

if TYPE_CHECKING:
    from ds_lowcomm.optimizer import LowCommOptimizer

HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")


class ShardedStepRound(Round):
    """Reduce-scatter a gradient buffer, clip, step the shard's AdamW, all-gather into ``target``.

    ``grads`` is a padded fp32 flat gradient sum; the shard gradient is multiplied by ``scale``
    (1/W for a mean over ranks, since DeepSpeed already divided the loss by the accumulation steps).
    """

    def __init__(self, opt: "LowCommOptimizer", adamw: ShardAdamW, grads: torch.Tensor, scale: float,
                 target: torch.Tensor) -> None:
        self.opt, self.adamw, self.grads, self.scale, self.target = opt, adamw, grads, scale, target
        self.grad_norm: float = float("nan")

    def pack(self) -> None:
        self.hyper: List[dict] = [{k: g[k] for k in HYPERPARAMS} for g in self.opt.param_groups]
        self.send = self.grads if self.opt.comm_dtype == torch.float32 else self.grads.to(self.opt.comm_dtype)

    def run(self) -> None:
        comm, layout = self.opt.topology.shard, self.opt.flat.layout
        recv = self.send.new_empty(layout.shard_size)
        comm.reduce_scatter(recv, self.send)
        grad = recv.float() if recv.dtype != torch.float32 else recv
        grad.mul_(self.scale)
        norm_sq = grad.double().square().sum().float().reshape(1)
        comm.all_reduce(norm_sq)
        self.grad_norm = math.sqrt(norm_sq.item())
        clip = self.opt.gradient_clipping
        if clip > 0:
            # DeepSpeed's ZeRO rule (stage_1_and_2.py unscale_and_clip_grads), so runs match stock.
            factor = (self.grad_norm + 1e-6) / clip
            if factor > 1:
                grad.mul_(1.0 / factor)
        self.adamw.step(grad, self.hyper)
        out = self.adamw.master.to(self.target.dtype)
        comm.all_gather(self.target, out)

    def install(self) -> None:
        self.opt._global_grad_norm = self.grad_norm


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
        self.adamw = ShardAdamW(opt.flat.layout, opt.flat.buffer)

    def step(self) -> None:
        opt = self.opt
        rnd = ShardedStepRound(opt, self.adamw, opt.grads.buffer, 1.0 / opt.topology.shard.world,
                               opt.flat.buffer)
        rnd.pack()
        opt.worker.submit(rnd)
        opt.worker.wait(rnd)
        rnd.install()
        opt.grads.zero_()

    def master_weights(self) -> torch.Tensor:
        return gather_full(self.opt.checkpoint_comm, self.opt.flat.layout, self.adamw.master)

    def state_dict(self) -> dict:
        layout, comm = self.opt.flat.layout, self.opt.checkpoint_comm
        return {"step": self.adamw.step_count,
                **{k: gather_full(comm, layout, getattr(self.adamw, k))
                   for k in ("master", "exp_avg", "exp_avg_sq")}}

    def load_state_dict(self, state: dict) -> None:
        """Restore; a state holding only ``"master"`` restarts the moments and the step count."""
        layout, like = self.opt.flat.layout, self.adamw.master
        self.adamw.master = shard_of(state["master"], layout, like)
        for k in ("exp_avg", "exp_avg_sq"):
            setattr(self.adamw, k, shard_of(state[k], layout, like) if k in state else torch.zeros_like(like))
        self.adamw.step_count = int(state.get("step", 0))
        self.opt.set_params(state["master"])
