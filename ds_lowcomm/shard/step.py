"""ShardedStepRound: reduce-scatter gradients, clip, AdamW on the shard, all-gather parameters.

The round of every mode that keeps ZeRO-1's sharded AdamW (``zero1``, both rounds of ``acco``).
Communication, over the shard group of W ranks, for P padded elements::

    all-reduce      micro-batch count per rank (only when they can differ)  2(W-1)/W · 8W bytes
                    (+8W per value of ``local_paces``; 24W with ``weights``, +8W per pace)
    reduce-scatter  gradient sums in comm_dtype                       (W-1)/W · P · comm bytes
    all-reduce      squared norm of the gradient shards                2(W-1)/W · 4 bytes
    all-gather      updated parameters, into ``target``              (W-1)/W · P · param bytes
                    (or their change from the model's, into ``delta``: its dtype's bytes)

The reduce-scatter travels in ``wire_dtype`` (default comm_dtype). 2-byte gradient sums (a
bf16/fp16 model's, DeepSpeed's default ``grad_accum_dtype``) are reduced into this rank's own part
of them, and AdamW reads them from there chunk by chunk: no fp32 gradient shard.

The non-finite guard rides on the norm all-reduce: a NaN or inf anywhere in the reduced gradient
makes the global norm non-finite on every rank at once, so every rank reaches the same verdict and
skips the update, leaving master, moments and step count as they were (stock DeepSpeed's fp16
overflow rule, applied to every dtype). Only then does one more W-element all-reduce find out
which ranks' own sums were non-finite, for the log.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch

from ds_lowcomm.memory import CHUNK_BYTES, temporary
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.shard.adamw import ShardAdamW

HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")


def global_norm(comm, grad: torch.Tensor, factor: float = 1.0) -> float:
    """The global L2 norm of ``factor`` times the gradient shards ``grad`` over ``comm`` (one
    4-byte all-reduce); ``grad`` is left as it is."""
    # float64 chunk by chunk: grad.double().square() held two float64 copies of the shard at once
    # (16 bytes per shard element).
    norm_sq = torch.zeros((), dtype=torch.float64, device=grad.device)
    scratch = temporary(min(grad.numel(), CHUNK_BYTES // 8), torch.float64, grad.device)
    for part in grad.split(CHUNK_BYTES // 8):
        x = scratch[:part.numel()].copy_(part)
        if factor != 1.0:
            x.mul_(factor)
        norm_sq += x.square_().sum()
    norm_sq = norm_sq.float().reshape(1)
    comm.all_reduce(norm_sq)
    return math.sqrt(norm_sq.item())


def clip_by_global_norm(comm, grad: torch.Tensor, clip: float) -> float:
    """The global L2 norm of the gradient shards ``grad`` over ``comm`` (one 4-byte all-reduce),
    clipping ``grad`` in place to ``clip`` when positive; returns the norm before clipping."""
    norm = global_norm(comm, grad)
    scale = clip_scale(norm, clip)
    if scale != 1.0:
        grad.mul_(scale)
    return norm


def nonfinite_ranks(comm, finite: bool, device: torch.device) -> List[int]:
    """The global ranks of ``comm`` whose own gradient sums were not all ``finite`` (one W-element
    all-reduce of a tensor on ``device``; collective: call it on every rank of ``comm``, e.g.
    after a non-finite norm)."""
    flags = torch.zeros(comm.world, dtype=torch.float32, device=device)
    flags[comm.rank] = 0.0 if finite else 1.0
    comm.all_reduce(flags)
    return [comm.ranks[i] for i, bad in enumerate(flags.tolist()) if bad]


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no NaN or inf, as a device bool (read it only when it matters: a
    read stalls the host on a GPU). Same test as :func:`all_finite`."""
    return torch.isfinite(t.sum(dtype=torch.float64))


def all_finite(*tensors: torch.Tensor) -> bool:
    """No NaN or inf in any of ``tensors``: their float64 sums are finite (a sum of finite
    fp32/bf16/fp16 values cannot overflow float64, and a reduction allocates nothing)."""
    return all(math.isfinite(float(t.sum(dtype=torch.float64))) for t in tensors if t.numel())


def clip_scale(norm: float, clip: float) -> float:
    """What clipping to ``clip`` (when positive) multiplies a gradient of L2 norm ``norm`` by."""
    if clip > 0:
        # DeepSpeed's ZeRO rule (stage_1_and_2.py unscale_and_clip_grads), so runs match stock.
        factor = (norm + 1e-6) / clip
        if factor > 1:
            return 1.0 / factor
    return 1.0


def clip_scale_tensor(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """:func:`clip_scale` of a device scalar ``norm``, as a device scalar (no host read)."""
    if clip <= 0:
        return torch.ones_like(norm)
    factor = (norm + 1e-6) / clip
    return torch.where(factor > 1, 1.0 / factor, torch.ones_like(factor))


class ShardedStepRound(StepRound):
    """One sharded AdamW step from a flat gradient sum.

    Args:
        grads: padded flat gradient sums (fp32 or ``comm_dtype``), read by :meth:`run`.
        target: padded flat buffer (model dtype) the all-gather writes the new parameters into.
        scale: multiplies the reduced gradient sum. DeepSpeed has divided each micro-batch's loss
            by ``gradient_accumulation_steps`` (GAS), so with GAS micro-batches on each of W ranks
            the mean is ``sum / W``.
        local_count: instead of ``scale``, the number of micro-batches summed on this rank when
            ranks may differ; the counts are all-reduced and ``scale = GAS / global count``, so
            every micro-batch weighs the same whoever computed it.
        weights: with ``local_count``, this rank's ``[computed, offered]`` weight
            (:attr:`GradAccumulator.weights`, read at :meth:`pack`): some micro-batches the loop
            handed a rank ran forward only (:mod:`ds_lowcomm.shard.pace`). The sums C and O over the
            ranks ride on the count all-reduce and ``scale = GAS · O / (block · W · C)``: the
            computed micro-batches stand for all the loop handed out, and with everything computed
            the scale is exactly zero1's ``1/W`` (``block`` = GAS) or an acco estimate's ``2/W``.
        block: with ``weights``, the micro-batches a rank is handed for this round's sums when
            nothing is dropped (GAS for a step; GAS/2 for an acco estimate round).
        local_paces: with ``local_count``, numbers about this rank's pace (seconds per
            micro-batch, 0 when unknown) shared in the same all-reduce: every rank learns every
            rank's (``rank_paces``; acco's ``balance`` and the :class:`~ds_lowcomm.shard.pace.Pacer`
            let the fastest rank set the pace with them).
        estimate: write the step's result into ``target`` without updating the optimizer state
            (:meth:`ShardAdamW.estimate`).
        wire_dtype: the dtype the gradient is reduce-scattered in (default ``comm_dtype``).
        delta: a padded flat buffer that gets the new parameters' *change* from the parameters
            the model holds (``ctx.flat.buffer``, which nothing writes while the round is in
            flight), all-gathered in ``delta``'s dtype, instead of ``target`` getting the
            parameters; :class:`~ds_lowcomm.comm.inflight.InFlight` adds it to them (acco's bf16
            ``estimate_dtype`` and ``real_gather_dtype``: half the all-gather's bytes, rounding
            only the small change, never the parameters; the model then differs from the
            result by that rounding, which the next round's change, taken from the model,
            corrects instead of accumulating).
        after_update: called in a real round after the update, or after its skip, and before the
            all-gather (DES-LOC averages the replicas' states there, so the all-gather spreads
            the average).
        reduced: this rank's shard of the reduced ``grads``, already reduce-scattered
            (loss-scaled, unscaled by ``scale``): the round starts at the norm (``zero1`` with
            overlap, :class:`~ds_lowcomm.shard.buckets.GradBuckets`). fp32 (modified in place), or, for
            2-byte ``grads``, this rank's own part of them, reduced in place.
        own_finite: with a ``reduced`` that is this rank's own part of ``grads`` reduced in
            place: whether that part was finite before, a device bool read only for the log of a
            skip (which ranks' sums were not).
        gather: all-gather the new parameters into ``target`` at the end of :meth:`run`; when
            False, this rank's shard of them is left in :attr:`out` for the caller to gather
            (``zero1`` with overlap, :class:`~ds_lowcomm.shard.buckets.ParamBuckets`).

    A non-finite reduced gradient skips the update (``skipped``): ``target`` gets the unchanged
    master (``delta`` the change back to it), and :meth:`install` reports the verdict to the optimizer (loss scale, skip count).
    """

    def __init__(self, ctx: ModeContext, adamw: ShardAdamW, grads: torch.Tensor,
                 target: torch.Tensor, *, scale: Optional[float] = None,
                 local_count: Optional[int] = None, weights: Optional[torch.Tensor] = None,
                 block: Optional[int] = None, local_paces: Sequence[float] = (),
                 estimate: bool = False, wire_dtype: Optional[torch.dtype] = None,
                 delta: Optional[torch.Tensor] = None,
                 after_update: Optional[Callable[[], None]] = None,
                 reduced: Optional[torch.Tensor] = None, own_finite: Optional[torch.Tensor] = None,
                 gather: bool = True) -> None:
        if (scale is None) == (local_count is None):
            raise ValueError("give exactly one of scale and local_count")
        if (weights is not None or local_paces) and local_count is None:
            raise ValueError("weights and local_paces ride on the local_count all-reduce: give local_count too")
        if delta is not None and target.dtype != torch.float32:
            raise ValueError(f"delta: a change is added to fp32 parameters only (these are {target.dtype}: "
                             "a change below half a ulp of a 2-byte weight would be lost); gather them whole")
        super().__init__()
        self.ctx, self.adamw, self.grads, self.target = ctx, adamw, grads, target
        self.wire_dtype = wire_dtype or ctx.comm_dtype
        self.delta = delta
        self.scale, self.local_count, self.estimate = scale, local_count, estimate
        self.weights = weights
        self.block = block or ctx.gradient_accumulation_steps
        self.local_paces = list(local_paces)
        self.after_update = after_update
        self.reduced = reduced
        self.own_finite = own_finite
        self.gather = gather
        #: after :meth:`run`: this rank's shard of the new parameters (the fp32 master; with
        #: ``delta``, their change in its dtype)
        self.out: Optional[torch.Tensor] = None
        #: with ``local_count``: the micro-batches each rank summed into this round
        self.rank_counts: Optional[List[int]] = None
        #: with ``local_paces``: each rank's ``local_paces``
        self.rank_paces: Optional[List[List[float]]] = None
        #: with ``weights``: each rank's computed and offered weight
        self.rank_weights: Optional[List[List[float]]] = None

    def pack(self) -> None:
        # Hyperparameters in force now (a scheduler may change them while the round runs).
        self.hyper: List[dict] = [{k: g[k] for k in HYPERPARAMS} for g in self.ctx.param_groups]
        # fp16: the loss scale the gradients were computed with (the optimizer rescales what is
        # accumulated when the scale changes, so one value holds for the whole sum).
        self.capture_step(self.ctx.loss_scale, self.ctx.steps)
        if self.weights is not None:  # the accumulator's, as of now (zeroed once the round is launched)
            self.weights = self.weights.clone()

    def run(self) -> None:
        comm, layout = self.ctx.topology.shard, self.ctx.flat.layout
        scale = self.scale
        if self.local_count is not None:
            # A row per rank, not the sums: every rank learns every rank's count, weights and
            # paces (metrics, pacing) at no extra call.
            weighted = self.weights is not None
            first = 3 if weighted else 1  # count[, computed, offered], paces...
            rows = torch.zeros(comm.world, first + len(self.local_paces), dtype=torch.float64,
                               device=self.grads.device)
            mine = rows[comm.rank]
            mine[0] = self.local_count
            if weighted:
                mine[1:3] = self.weights  # a device copy: no host sync for token weights
            if self.local_paces:
                mine[first:] = torch.tensor(self.local_paces, dtype=torch.float64)
            comm.all_reduce(rows)
            values = rows.tolist()
            self.rank_counts = [int(r[0]) for r in values]
            if self.local_paces:
                self.rank_paces = [r[first:] for r in values]
            gas = self.ctx.gradient_accumulation_steps
            if weighted:
                self.rank_weights = [r[1:3] for r in values]
                computed, offered = (math.fsum(r[1] for r in values), math.fsum(r[2] for r in values))
                # One division of exact integers: with everything computed the same value as
                # zero1's 1/W, bit for bit.
                scale = (gas * offered) / (self.block * comm.world * computed)
            else:
                scale = gas / sum(self.rank_counts)
        grad, own_finite = self.reduced, self.own_finite
        if grad is None:
            grad, own_finite = self._reduce_scatter()
        factor = scale / self.loss_scale
        if grad.dtype == torch.float32:  # scaled and clipped in place
            grad.mul_(factor)
            self.grad_norm = clip_by_global_norm(comm, grad, self.ctx.gradient_clipping)
            factor = 1.0
        else:  # 2-byte: scaled and clipped chunk by chunk as AdamW reads it
            self.grad_norm = global_norm(comm, grad, factor)
            factor *= clip_scale(self.grad_norm, self.ctx.gradient_clipping)
        self.skipped = not math.isfinite(self.grad_norm)  # the same verdict on every rank
        if self.skipped:
            if own_finite is None:
                finite = all_finite(self.grads)
            else:  # this rank's own part now holds the reduced sums: the rest, and what it held
                lo, hi = layout.shard_start, layout.shard_start + layout.shard_size
                finite = bool(own_finite) and all_finite(self.grads[:lo], self.grads[hi:])
            self.nonfinite_ranks = nonfinite_ranks(comm, finite, self.grads.device)
        if self.estimate:
            out = self.adamw.master.to(self.target.dtype, copy=True)
            if not self.skipped:
                self.adamw.estimate(grad, self.hyper, out, factor)
        else:
            if not self.skipped:
                self.adamw.step(grad, self.hyper, factor)
            if self.after_update is not None:
                self.after_update()
            # The master itself: the all-gather converts it chunk by chunk, a caller that gathers
            # it (zero1's overlap) bucket by bucket: no shard-sized copy in the model's dtype.
            out = self.adamw.master
        if self.delta is not None:
            # The change from what the model holds (not from the master: the two differ by the
            # previous change's rounding), computed in fp32 and rounded once.
            out = (out - layout.shard(self.ctx.flat.buffer)).to(self.delta.dtype)
        self.out = out
        if self.gather:
            comm.all_gather(self.target if self.delta is None else self.delta, out)

    def _reduce_scatter(self):
        """This rank's shard of the summed ``grads`` and, when reduced in place, whether this
        rank's own part of them was finite before. fp32 sums land in an fp32 shard; 2-byte sums
        are reduced into this rank's own part of them, as stock DeepSpeed reduces its bf16/fp16
        gradients (each chunk is copied out before its sum lands there): no fp32 shard beside
        the sums (4/W bytes per parameter), the sum rounded once to 2 bytes."""
        comm, layout = self.ctx.topology.shard, self.ctx.flat.layout
        if self.grads.dtype == torch.float32:
            grad, own_finite = temporary(layout.shard_size, torch.float32, self.grads.device), None
        else:
            grad = layout.shard(self.grads)
            own_finite = finite_flag(grad)  # read only if the step is skipped
        comm.reduce_scatter(grad, self.grads, wire_dtype=self.wire_dtype)
        return grad, own_finite

    def install(self) -> None:
        if not self.estimate:  # an estimate's norm is of half a step's gradient: not the step's
            self.ctx.record_step(self.step_number, self.grad_norm, self.skipped, self.nonfinite_ranks)
