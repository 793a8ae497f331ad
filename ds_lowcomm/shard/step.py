"""The sharded AdamW step of ZeRO-1 as phases, and the round that runs them in order.

Megatron's distributed optimizer in five phases, each a function of its data. Over the shard group
of W ranks, for P padded elements::

    share_counts     all-reduce      a row per rank: micro-batch count[, computed and offered
                                     weights][, paces] (only when ranks' sums can differ)
                                                                      2(W-1)/W · 8W·(1 [+2] [+paces]) bytes
    reduce_gradient  reduce-scatter  gradient sums in the wire dtype   (W-1)/W · P · wire bytes
    judge            all-reduce      squared norm of the gradient shards       2(W-1)/W · 4 bytes
                     (after a non-finite norm only, the round adds a W-element all-reduce
                     naming the ranks whose own sums were not finite)
    update           local           AdamW on the fp32 shard (:class:`ShardAdamW`)
    gather           all-gather      the updated parameters            (W-1)/W · P · param bytes

:class:`ShardedStepRound` runs them in that order and each mode composes its round from it:
zero1's with overlap takes a shard reduced bucket by bucket and leaves the gather to the parameter
buckets, desloc's averages the replicas between update and gather, acco's weighs the sums by
counts, can be an estimate and gathers a change. :func:`step_now` is how a mode takes a step
with its round at the boundary, written once.

2-byte gradient sums (a bf16/fp16 model's, DeepSpeed's default ``grad_accum_dtype``) are reduced
into this rank's own part of them, and AdamW reads them from there chunk by chunk: no fp32
gradient shard.

The non-finite guard rides on the norm all-reduce: a NaN or inf anywhere in the reduced gradient
makes the global norm non-finite on every rank at once, so every rank reaches the same verdict and
skips the update, leaving master, moments and step count as they were (stock DeepSpeed's fp16
overflow rule, applied to every dtype). Only then does one more W-element all-reduce find out
which ranks' own sums were non-finite, for the log.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

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




# -- the phases ----------------------------------------------------------------------------------

@dataclass
class Counts:
    """What this rank brings to :func:`share_counts` when the ranks' sums may differ (acco's
    rounds, a paced zero1 step), and, after it, every rank's.

    Args:
        local_count: micro-batches summed on this rank.
        weights: this rank's ``[computed, offered]`` weight (:attr:`GradAccumulator.weights`,
            copied at pack): some micro-batches the loop handed a rank ran forward only
            (:mod:`ds_lowcomm.shard.pace`); the computed ones then stand for all it handed out.
        block: with ``weights``, the micro-batches a rank is handed for these sums when nothing
            is dropped (GAS for a step; GAS/2 for an acco estimate round; None = GAS).
        paces: numbers about this rank's pace (seconds per micro-batch, 0 when unknown) shared in
            the same all-reduce (acco's ``balance``, the :class:`~ds_lowcomm.shard.pace.Pacer`).
    """

    local_count: int
    weights: Optional[torch.Tensor] = None
    block: Optional[int] = None
    paces: Sequence[float] = ()
    #: after :func:`share_counts`: every rank's count, paces (with ``paces``) and weights (with
    #: ``weights``), in group rank order
    rank_counts: Optional[List[int]] = field(default=None, init=False)
    rank_paces: Optional[List[List[float]]] = field(default=None, init=False)
    rank_weights: Optional[List[List[float]]] = field(default=None, init=False)


def share_counts(comm, counts: Counts, gas: int, device: torch.device) -> float:
    """Phase 1: every rank's ``counts`` in one all-reduce of a row per rank (8W bytes per
    number: the count, the two weights, the paces), written into ``counts.rank_*``. Returns the
    scale of the reduced sums: ``GAS / global count``, so every micro-batch weighs the same
    whoever computed it; with weights, ``GAS · O / (block · W · C)`` over the sums C and O of the
    computed and offered weights, exactly zero1's ``1/W`` (``block`` = GAS) or an acco estimate's
    ``2/W`` when everything was computed."""
    weighted = counts.weights is not None
    first = 3 if weighted else 1  # count[, computed, offered], paces...
    # A row per rank, not the sums: every rank learns every rank's numbers at no extra call.
    rows = torch.zeros(comm.world, first + len(counts.paces), dtype=torch.float64, device=device)
    mine = rows[comm.rank]
    # Host numbers by fill_ (a kernel argument): ``mine[0] = n`` or a host tensor copied in would
    # be a blocking host-to-device copy on CUDA, one more host wait per round.
    mine[0].fill_(counts.local_count)
    if weighted:
        mine[1:3] = counts.weights  # a device copy: no host sync for token weights
    for i, pace in enumerate(counts.paces):
        mine[first + i].fill_(pace)
    comm.all_reduce(rows)
    values = rows.tolist()
    counts.rank_counts = [int(r[0]) for r in values]
    if counts.paces:
        counts.rank_paces = [r[first:] for r in values]
    if not weighted:
        return gas / sum(counts.rank_counts)
    counts.rank_weights = [r[1:3] for r in values]
    computed, offered = math.fsum(r[1] for r in values), math.fsum(r[2] for r in values)
    # One division of exact integers: with everything computed the same value as zero1's 1/W.
    return (gas * offered) / ((counts.block or gas) * comm.world * computed)


def reduce_gradient(ctx: ModeContext, grads: torch.Tensor,
                    wire_dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Phase 2: this rank's shard of the sums ``grads`` reduce-scattered over the shard group in
    ``wire_dtype``, and, when reduced in place, whether this rank's own part of them was finite
    before (a device bool, read only for the log of a skip). fp32 sums land in an fp32 shard;
    2-byte sums are reduced into this rank's own part of them, as stock DeepSpeed reduces its
    bf16/fp16 gradients (each chunk is copied out before its sum lands there): no fp32 shard
    beside the sums (4/W bytes per parameter), the sum rounded once to 2 bytes. Sends
    (W−1)/W · P · wire bytes per rank."""
    layout = ctx.flat.layout
    if grads.dtype == torch.float32:
        grad, own_finite = temporary(layout.shard_size, torch.float32, grads.device), None
    else:
        grad = layout.shard(grads)
        own_finite = finite_flag(grad)
    ctx.topology.shard.reduce_scatter(grad, grads, wire_dtype=wire_dtype)
    return grad, own_finite


def judge(comm, grad: torch.Tensor, factor: float, clip: float) -> Tuple[float, float]:
    """Phase 3: the global norm of ``factor`` times the reduced gradient shards (one 4-byte
    all-reduce), clipped to ``clip`` when positive. Returns the norm (non-finite: skip the step,
    the same verdict on every rank) and the factor the update still applies: an fp32 ``grad`` is
    scaled and clipped in place (1.0 left), a 2-byte one chunk by chunk as AdamW reads it."""
    if grad.dtype == torch.float32:
        grad.mul_(factor)
        return clip_by_global_norm(comm, grad, clip), 1.0
    norm = global_norm(comm, grad, factor)
    return norm, factor * clip_scale(norm, clip)


# -- the round -----------------------------------------------------------------------------------

class ShardedStepRound(StepRound):
    """One sharded AdamW step from flat gradient sums: the five phases in order.

    Args:
        ctx: what the mode was handed; the shard group is ``ctx.topology.shard``.
        adamw: the state the step updates.
        grads: padded flat gradient sums (fp32 or ``comm_dtype``), read by :meth:`run`.
        target: padded flat buffer (model dtype) the all-gather writes the new parameters into.
        scale: multiplies the reduced sums. DeepSpeed has divided each micro-batch's loss by
            ``gradient_accumulation_steps`` (GAS), so with GAS micro-batches on each of W ranks
            the mean is ``sum / W``.
        counts: instead of ``scale``, when the ranks' sums may differ: :func:`share_counts`
            computes the scale (and shares the weights and paces) first.

    A mode changes a phase by overriding :meth:`reduce`, :meth:`update` or :meth:`gather`. A
    non-finite reduced gradient skips the update (``skipped``): ``target`` gets the unchanged
    master, and :meth:`install` reports the verdict to the optimizer (loss scale, skip count).
    After :meth:`run`, :attr:`out` is this rank's shard of the new parameters (what
    :meth:`update` returned: acco's gathered change, where it gathers one).
    """

    def __init__(self, ctx: ModeContext, adamw: ShardAdamW, grads: torch.Tensor, target: torch.Tensor, *,
                 scale: Optional[float] = None, counts: Optional[Counts] = None) -> None:
        if (scale is None) == (counts is None):
            raise ValueError("give exactly one of scale and counts")
        super().__init__()
        self.ctx, self.adamw, self.grads, self.target = ctx, adamw, grads, target
        self.scale, self.counts = scale, counts
        self.out: Optional[torch.Tensor] = None

    def pack(self) -> None:
        # Hyperparameters in force now (a scheduler may change them while the round runs).
        self.hyper: List[dict] = [{k: g[k] for k in HYPERPARAMS} for g in self.ctx.param_groups]
        # fp16: the loss scale the gradients were computed with (the optimizer rescales what is
        # accumulated when the scale changes, so one value holds for the whole sum).
        self.capture_step(self.ctx.loss_scale, self.ctx.steps)
        if self.counts is not None and self.counts.weights is not None:
            self.counts.weights = self.counts.weights.clone()  # the accumulator zeroes its own

    def run(self) -> None:
        """The five phases in order; their bytes are the module's table."""
        comm = self.ctx.topology.shard
        scale = self.scale
        if self.counts is not None:
            scale = share_counts(comm, self.counts, self.ctx.gradient_accumulation_steps, self.grads.device)
        grad, own_finite = self.reduce()
        self.grad_norm, factor = judge(comm, grad, scale / self.loss_scale, self.ctx.gradient_clipping)
        self.skipped = not math.isfinite(self.grad_norm)
        if self.skipped:
            self.nonfinite_ranks = nonfinite_ranks(comm, self._own_sums_finite(own_finite), self.grads.device)
        self.out = self.update(grad, factor)
        self.gather(self.out)

    def reduce(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Phase 2 (:func:`reduce_gradient` in ``comm_dtype``): the gradient shard, and whether
        this rank's own sums were finite when they were reduced in place."""
        return reduce_gradient(self.ctx, self.grads, self.ctx.comm_dtype)

    def update(self, grad: torch.Tensor, factor: float) -> torch.Tensor:
        """Phase 4: AdamW on the shard from ``factor · grad``, unless skipped. Returns this rank's
        shard of the new parameters: the master itself (the all-gather converts it chunk by
        chunk: no shard-sized copy in the model's dtype)."""
        if not self.skipped:
            self.adamw.step(grad, self.hyper, factor)
        return self.adamw.master

    def gather(self, out: torch.Tensor) -> None:
        """Phase 5: all-gather every rank's ``out`` into ``target``."""
        self.ctx.topology.shard.all_gather(self.target, out)

    def _own_sums_finite(self, own_finite: Optional[torch.Tensor]) -> bool:
        """After a skip: whether this rank's own gradient sums were finite."""
        if own_finite is None:
            return all_finite(self.grads)
        # This rank's own part now holds the reduced sums: the rest, and what it held.
        layout = self.ctx.flat.layout
        lo, hi = layout.shard_start, layout.shard_start + layout.shard_size
        return bool(own_finite) and all_finite(self.grads[:lo], self.grads[hi:])

    def install(self) -> None:
        self.ctx.record_step(self.step_number, self.grad_norm, self.skipped, self.nonfinite_ranks)


def step_now(ctx: ModeContext, rnd: StepRound,
             after_install: Optional[Callable[[StepRound], None]] = None) -> None:
    """An optimizer step taken with its round at the boundary: pack it, run it (on the training
    thread, all of its time exposed: counted as waited for; or, where the mode has a comm worker,
    zero1 with overlap, on its thread, after the buckets queued before it: no host read of the
    device on the training thread, though waiting for the round waits until the GPU has reached
    the round's norm verdict), install it, clear the gradient sums,
    ``after_install(rnd)`` if given, and count the step. Communication: the round's own."""
    rnd.pack()
    if ctx.worker is not None:
        ctx.worker.wait(ctx.worker.submit(rnd))
    else:
        t0 = time.perf_counter()
        rnd.run()
        seconds = time.perf_counter() - t0
        ctx.stats.rounds += 1
        ctx.stats.round_seconds += seconds
        ctx.stats.host_wait_seconds += seconds
    rnd.install()
    ctx.grads.zero_()
    if after_install is not None:
        after_install(rnd)
    ctx.step_taken()
