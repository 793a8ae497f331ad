"""demo: DeMo — Decoupled Momentum Optimization (Peng, Quesnelle, Kingma; arXiv 2411.19870).

Ranks exchange only the top-k DCT coefficients of their momentum. Sharded: inside a shard group
(``shard_group_size`` ranks, a node) gradients are reduce-scattered and parameters all-gathered as
in ZeRO-1, each rank keeping the fp32 master and the momentum δ of its shard only; across the
replica group (the ranks holding the same shard in the other nodes: the slow links) only the
packed payload travels. Per optimizer step, on each rank's shard::

    g  = mean over the shard group of the gradient shard (clipped by its global norm)
    δ ← β·δ + lr·g                              lr folded into the momentum
    C  = top-k DCT coefficients of δ per tile    (ds_lowcomm.dct, as they will be sent)
    δ ← δ − IDCT(C)                             error feedback
    Q  = IDCT(mean over the replica group of the gathered coefficients, per index)
    θ ← θ·(1 − lr·wd) − lr·sign(Q)

Tiles cover the flat shard (as torchtitan-lowcomms does), whatever the parameter boundaries, so any
parameter shape works and the shard split is free. Bytes across replica groups per rank and step:
(R−1)·payload sent and received, payload = ``DctTopK.payload_bytes`` (about 1/256 of fp32 ZeRO-1's
bytes with chunk 64, top 32, bf16 values). δ differs per rank: it is saved in per-rank files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_lowcomm.checkpoint import check_rank_layout, gather_full, rank_layout, shard_of
from ds_lowcomm.config import LowCommConfigError, option
from ds_lowcomm.dct import VALUE_FORMATS, DctTopK
from ds_lowcomm.modes import Mode, register, require_shard_group_size

if TYPE_CHECKING:
    from ds_lowcomm.config import LowCommConfig
    from ds_lowcomm.optimizer import LowCommOptimizer


@dataclass(frozen=True)
class DemoOptions:
    beta: float = option(0.999, "momentum decay (the reference's compression_decay)", minimum=0, below=1)
    chunk: int = option(64, "DCT tile edge: tiles of chunk × chunk elements", minimum=2)
    topk: int = option(32, "coefficients kept per tile", minimum=1)
    values: str = option("bf16", "wire format of the kept coefficients: 'bf16', or 'sign' (1 bit "
                         "plus one bf16 scale per tile)", choices=VALUE_FORMATS)


@register
class Demo(Mode):
    """Sharded DeMo: ZeRO-1 inside a shard group, compressed momentum across replica groups."""

    name = "demo"
    Options = DemoOptions
    has_rank_state = True

    @classmethod
    def check_config(cls, ds: dict, cfg: "LowCommConfig") -> None:
        o = cfg.mode_options
        if o.topk > o.chunk * o.chunk:
            raise LowCommConfigError(f"lowcomm.demo.topk: got {o.topk}; must be <= chunk² = {o.chunk ** 2}")
        require_shard_group_size(cfg, cls.name, "exchanges compressed momentum between shard groups "
                                                "(1 = DeMo as in its paper)")

    def __init__(self, opt: "LowCommOptimizer", options: DemoOptions) -> None:
        super().__init__(opt, options)
        layout = opt.flat.layout
        self.master = layout.shard(opt.flat.buffer).to(torch.float32, copy=True)
        self.delta = torch.zeros_like(self.master)
        self.codec = DctTopK(layout.shard_size, options.chunk, options.topk, options.values)
        self.segments = layout.segments()
        self.step_count = 0

    @torch.no_grad()
    def step(self) -> None:
        opt, o = self.opt, self.options
        shard, replica = opt.topology.shard, opt.topology.replica
        hyper = [{k: g[k] for k in ("lr", "weight_decay")} for g in opt.param_groups]

        send = opt.grads.buffer.to(opt.comm_dtype)
        grad = send.new_empty(opt.flat.layout.shard_size)
        shard.reduce_scatter(grad, send)
        grad = grad.float().mul_(1.0 / shard.world)
        norm_sq = grad.double().square().sum().float().reshape(1)
        shard.all_reduce(norm_sq)
        opt._global_grad_norm = math.sqrt(norm_sq.item())
        if opt.gradient_clipping > 0:
            factor = (opt._global_grad_norm + 1e-6) / opt.gradient_clipping
            if factor > 1:
                grad.mul_(1.0 / factor)

        for seg in self.segments:
            sl = slice(seg.start, seg.end)
            self.delta[sl].mul_(o.beta).add_(grad[sl], alpha=hyper[seg.group]["lr"])
        idx, vals = self.codec.encode(self.delta)
        self.delta.sub_(self.codec.dense(idx, vals))
        payload = self.codec.pack(idx, vals)
        if replica is None:
            payloads = [payload]
        else:
            gathered = payload.new_empty(replica.world * payload.numel())
            replica.all_gather(gathered, payload)
            payloads = list(gathered.chunk(replica.world))
        update = self.codec.decode_mean(payloads).sign_()

        for seg in self.segments:
            sl, hp = slice(seg.start, seg.end), hyper[seg.group]
            self.master[sl].mul_(1 - hp["lr"] * hp["weight_decay"]).add_(update[sl], alpha=-hp["lr"])
        shard.all_gather(opt.flat.buffer, self.master.to(opt.flat.dtype, copy=True))
        self.step_count += 1
        opt.grads.zero_()
        opt.step_completed()

    # -- state --------------------------------------------------------------------------------

    def master_weights(self) -> torch.Tensor:
        return gather_full(self.opt.checkpoint_comm, self.opt.flat.layout, self.master)

    def metrics(self) -> dict:
        r = self.opt.topology.num_replicas
        return {"payload_bytes": self.codec.payload_bytes,
                "replica_bytes_sent_per_step": (r - 1) * self.codec.payload_bytes}

    def state_dict(self) -> dict:
        return {"master": self.master_weights(), "step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.master = shard_of(state["master"], self.opt.flat.layout, self.master)
        self.step_count = int(state.get("step", 0))
        if "step" not in state:  # weights only: momentum restarts
            self.delta.zero_()
        self.opt.set_params(state["master"])

    def rank_state_dict(self) -> dict:
        return {**rank_layout(self.opt.topology), "delta": self.delta.clone()}

    def load_rank_state_dict(self, state: dict) -> None:
        check_rank_layout(state, self.opt.topology, "each rank's momentum")
        self.delta.copy_(state["delta"])
