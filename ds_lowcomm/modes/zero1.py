"""zero1: synchronous sharded ZeRO-1 with a true reduce-scatter, the reference every mode is held to.

Per optimizer step, over the shard group (the whole world)::

    reduce-scatter  fp32 (or comm_dtype) gradient sums         (W-1)/W · P · comm bytes
    all-reduce      squared norm of the gradient shards           2(W-1)/W · 4 bytes
    local           clip, AdamW on the fp32 shard
    all-gather      updated parameters                          (W-1)/W · P · param bytes

P is the padded parameter count. DeepSpeed's own stage-1 optimizer (0.19.8) all-reduces the full
gradient instead (``stage_1_and_2.py`` ``average_tensor``), twice the gradient bytes.

With ``overlap`` the reduce-scatter runs bucket by bucket on the comm thread during the step's
last backward pass (:class:`~ds_lowcomm.shard.buckets.GradBuckets`, Megatron's ``overlap_grad_reduce``),
and the all-gather bucket by bucket during the next forward pass, each module waiting for its own
parameters (:class:`~ds_lowcomm.shard.buckets.ParamBuckets`, Megatron's ``overlap_param_gather``): the
same collectives' bytes, and on gloo the same sums, so the same training bit for bit. The step
returns before the model's parameters are complete: code that reads them outside a module's
forward calls ``engine.optimizer.settle()`` first (checkpoints and ``flush`` do).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ds_lowcomm.checkpoint import ShardReader
from ds_lowcomm.shard.buckets import GradBuckets, ParamBuckets
from ds_lowcomm.config import option
from ds_lowcomm.shard.flat import gather_full
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode, ModeState, require_one_shard_group
from ds_lowcomm.shard.adamw import ShardAdamW
from ds_lowcomm.shard.step import Counts, ShardedStepRound, step_now


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Zero1Options:
    """``lowcomm.zero1``: zero1's options (docs/configuration.md lists them)."""

    overlap: bool = option(False, "reduce-scatter the gradient bucket by bucket while the step's last "
                           "backward pass runs, and all-gather the parameters bucket by bucket while "
                           "the next forward pass runs (a comm thread); the same result")


class OverlappedRound(ShardedStepRound):
    """zero1 with ``overlap``: the gradient shard was reduce-scattered bucket by bucket during the
    backward pass (:meth:`GradBuckets.take`: the shard, and whether any of this rank's own sums
    was non-finite before they were reduced), and the parameters are all-gathered bucket by
    bucket during the next forward pass (:class:`ParamBuckets`, from :attr:`out`)."""

    def __init__(self, *args, reduced, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reduced = reduced

    def reduce(self):
        return self.reduced

    def gather(self, out: torch.Tensor) -> None:
        """Left to :class:`ParamBuckets`."""


class Zero1(Mode):
    """Synchronous: reduce-scatter, step and all-gather at every boundary, on the training thread."""

    name = "zero1"
    Options = Zero1Options
    paces = True

    def __init__(self, ctx: ModeContext, options: Zero1Options) -> None:
        super().__init__(ctx, options)
        require_one_shard_group(ctx, self.name)
        self.adamw = ShardAdamW(ctx.flat.layout, ctx.flat.buffer)
        # A shard group of one has nothing to hide: its reduce-scatter aliases the sums and its
        # all-gather is a copy, so overlap would add only hand-offs to the comm thread (about 29
        # per step at GPT-2's size). Synchronous there, the same result.
        overlap = options.overlap and ctx.topology.shard.world > 1
        if options.overlap and not overlap:
            self.ctx = dataclasses.replace(ctx, worker=None)
            logger.info("ds_lowcomm: lowcomm.zero1.overlap runs synchronously in a shard group of one rank "
                        "(nothing to overlap)")
        self.buckets = GradBuckets(ctx) if overlap else None
        self.gathers = ParamBuckets(ctx) if overlap else None

    @classmethod
    def is_asynchronous(cls, options: Zero1Options) -> bool:
        return options.overlap

    def on_backward_start(self, boundary: bool) -> None:
        """With overlap, before the step's last backward: arm the gradient hooks that launch each
        bucket's reduce-scatter as its gradients are complete (the step's reduce-scatter bytes)."""
        if boundary and self.buckets is not None:
            self.buckets.arm()

    def on_micro_batch_end(self, boundary: bool) -> None:
        """With overlap, after the step's last backward: launch the buckets not launched yet."""
        if boundary and self.buckets is not None:
            self.buckets.finish()

    def step(self) -> None:
        """One ZeRO-1 round, the table above: on the training thread, or with overlap on the
        comm worker (waited for), its reduce-scatter already launched during the backward and
        its all-gather left to the next forward."""
        ctx = self.ctx
        reduced = None if self.buckets is None else self.buckets.take()  # waits for every bucket
        pacer = ctx.pacer if ctx.pacer is not None and ctx.pacer.active else None
        # Paced: the step's weights and every rank's paces ride on one small all-reduce; the
        # sums are scaled by what was computed (1/W exactly when everything was).
        weighting = (dict(counts=Counts(ctx.grads.micro_batches, ctx.grads.weights, paces=pacer.local_paces()))
                     if pacer is not None else dict(scale=1.0 / ctx.topology.shard.world))
        if reduced is None:
            rnd = ShardedStepRound(ctx, self.adamw, ctx.grads.buffer, ctx.flat.buffer, **weighting)
        else:
            rnd = OverlappedRound(ctx, self.adamw, ctx.grads.buffer, ctx.flat.buffer, **weighting, reduced=reduced)
        if pacer is not None:  # every rank's paces, once the verdict carrying them is on the host
            rnd.on_verdict = lambda r: pacer.after_round(r.counts.rank_paces, r.counts.rank_weights)

        def after_install(rnd: ShardedStepRound) -> None:
            if self.gathers is not None:
                self.gathers.start(rnd.out)  # the next forward waits for them, module by module
            if pacer is not None:
                pacer.end_block()

        step_now(ctx, rnd, after_install)

    def settle(self) -> None:
        """With overlap: wait until the parameters' all-gather has landed (no communication)."""
        if self.gathers is not None:
            self.gathers.wait_all()

    def flush(self) -> None:
        self.settle()

    def metrics(self) -> dict:
        if self.buckets is None:
            return {}
        # The share of gradient buckets whose reduce-scatter started before the backward ended.
        # The share of parameter buckets the forward pass waited for itself (the rest: settle).
        return {"grad_buckets": len(self.buckets.ranges),
                "grad_buckets_overlapped": self.buckets.launched_in_backward / max(self.buckets.launched, 1),
                "param_buckets_overlapped": self.gathers.waited_in_forward / max(self.gathers.gathered, 1)}

    def master_weights(self) -> torch.Tensor:
        """An all-gather of the master, (W−1)/W · P · 4 bytes sent per rank."""
        self.settle()
        return gather_full(self.ctx.checkpoint_comm, self.ctx.flat.layout, self.adamw.master)

    def state(self) -> ModeState:
        return ModeState(meta={"step": self.adamw.step_count}, sharded=self.adamw.sharded_state())

    def restore(self, meta: Optional[dict], shards: ShardReader, rank: Optional[dict]) -> None:
        """The model's weights come from DeepSpeed's file (the master's last all-gather), or, for
        the weights alone, from the master."""
        self.adamw.load_shards(shards, None if meta is None else meta["step"])
        if meta is None:
            self.ctx.set_params(shards.full("master", self.adamw.master))
