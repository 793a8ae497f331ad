"""The sharded AdamW step of ZeRO-1 as phases, and the round that runs them in order.

Megatron's distributed optimizer in five phases, each a function of its data. Over the shard group
of W ranks, for P padded elements::

    share_counts     all-reduce      a row per rank: micro-batch count[, computed and offered
                                     weights][, paces] (only when ranks' sums can differ)
                                                                      2(W-1)/W · 8W·(1 [+2] [+paces]) bytes
    reduce_gradient  reduce-scatter  gradient sums in the wire dtype   (W-1)/W · P · wire bytes
    judge            all-reduce      squared norm of the gradient shards and each rank's
                                     finite flag of its own sums            2(W-1)/W · 4(W+1) bytes
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
overflow rule, applied to every dtype); the same all-reduce carries which ranks' own sums were
non-finite, for the log.

Every verdict stays on the device: the counts' scale, the clip factor, the skip (``found_inf``
into the fused AdamW kernel). The host learns them from a copy the round stages at its end
(:meth:`~ds_lowcomm.comm.round.StepRound.stage`) and reads once it has landed: no host read
inside a round on the comm worker. A round on the training thread (a synchronous mode) reads its
verdict before the update, the one host wait of its step, as DeepSpeed's own step does. On a GPU
the phases' loops take 64 MiB chunks (:func:`~ds_lowcomm.memory.step_chunk_bytes`), eight times
the CPU's: a handful of launches per chunk, launched from Python.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ds_lowcomm.memory import step_chunk_bytes, temporary
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.shard.adamw import ShardAdamW

HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``grad`` as a float64 device scalar, with no host read: one
    reduction per :func:`~ds_lowcomm.memory.step_chunk_bytes` of float64 (one per 64 MiB on a GPU,
    per 8 MiB on the CPU, where a float64 copy of a whole shard would sit in the heap)."""
    parts = [torch.linalg.vector_norm(part, dtype=torch.float64) for part in grad.split(step_chunk_bytes(grad.device) // 8)]
    if len(parts) == 1:
        return parts[0].square()
    return torch.stack(parts).square().sum()


def nonfinite(value: torch.Tensor) -> torch.Tensor:
    """Whether the device scalar ``value`` is NaN or ±inf, as a device bool, in two kernels
    (``value − value`` is 0 exactly when it is finite; ``isfinite`` takes four)."""
    return (value - value).ne(0)


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no NaN or inf, as a device bool: its float64 sum is finite (a sum of
    finite fp32/bf16/fp16 values cannot overflow float64, and a reduction allocates nothing)."""
    return nonfinite(t.sum(dtype=torch.float64)).logical_not()


def clip_scale_tensor(norm: torch.Tensor, clip: float):
    """What clipping to ``clip`` (when positive) multiplies a gradient of L2 norm ``norm`` (a
    device scalar) by, as a device scalar (no host read); 1.0 without clipping."""
    if clip <= 0:
        return 1.0
    # DeepSpeed's ZeRO rule (stage_1_and_2.py unscale_and_clip_grads), so runs match stock:
    # 1/factor where factor = (norm + 1e-6)/clip exceeds 1 (a NaN norm: NaN, and the step skips).
    return ((norm + 1e-6) / clip).reciprocal().clamp(max=1.0)


# -- the phases ----------------------------------------------------------------------------------

@dataclass
class Counts:
    """What this rank brings to :func:`share_counts` when the ranks' sums may differ (acco's
    rounds, a paced zero1 step), and, once the round's verdict is read, every rank's.

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
    #: after :func:`share_counts`: every rank's row, on the device
    rows: Optional[torch.Tensor] = field(default=None, init=False)
    #: after the verdict is read (:meth:`read`): every rank's count, paces (with ``paces``) and
    #: weights (with ``weights``), in group rank order
    rank_counts: Optional[List[int]] = field(default=None, init=False)
    rank_paces: Optional[List[List[float]]] = field(default=None, init=False)
    rank_weights: Optional[List[List[float]]] = field(default=None, init=False)

    @property
    def width(self) -> int:
        """Numbers in a rank's row: the count[, computed and offered weights], the paces."""
        return (3 if self.weights is not None else 1) + len(self.paces)

    def read(self, values: Sequence[float], world: int) -> None:
        """Fill ``rank_*`` from the host copy of :attr:`rows` (``world`` rows of :attr:`width`)."""
        width, first = self.width, (3 if self.weights is not None else 1)
        rows = [list(values[r * width:(r + 1) * width]) for r in range(world)]
        self.rank_counts = [int(r[0]) for r in rows]
        if self.paces:
            self.rank_paces = [r[first:] for r in rows]
        if self.weights is not None:
            self.rank_weights = [r[1:3] for r in rows]


def share_counts(comm, counts: Counts, gas: int, device: torch.device) -> torch.Tensor:
    """Phase 1: every rank's ``counts`` in one all-reduce of a row per rank (8W bytes per
    number: the count, the two weights, the paces), kept on the device in ``counts.rows`` (the
    round's verdict carries them to the host). Returns the scale of the reduced sums as a
    float64 device scalar, with no host read: ``GAS / global count``, so every micro-batch weighs
    the same whoever computed it; with weights, ``GAS · O / (block · W · C)`` over the sums C and
    O of the computed and offered weights, exactly zero1's ``1/W`` (``block`` = GAS) or an acco
    estimate's ``2/W`` when everything was computed."""
    weighted = counts.weights is not None
    first = 3 if weighted else 1  # count[, computed, offered], paces...
    # A row per rank, not the sums: every rank learns every rank's numbers at no extra call.
    rows = torch.zeros(comm.world, counts.width, dtype=torch.float64, device=device)
    mine = rows[comm.rank]
    # Host numbers by fill_ (a kernel argument): ``mine[0] = n`` or a host tensor copied in would
    # be a blocking host-to-device copy on CUDA, one more host wait per round.
    mine[0].fill_(counts.local_count)
    if weighted:
        mine[1:3] = counts.weights  # a device copy: no host sync for token weights
    for i, pace in enumerate(counts.paces):
        mine[first + i].fill_(pace)
    comm.all_reduce(rows)
    counts.rows = rows
    if not weighted:
        return gas / rows[:, 0].sum()
    computed, offered = rows[:, 1].sum(), rows[:, 2].sum()
    # One division of exact integers: with everything computed the same value as zero1's 1/W.
    return (offered * gas) / (computed * ((counts.block or gas) * comm.world))


def reduce_gradient(ctx: ModeContext, grads: torch.Tensor,
                    wire_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: this rank's shard of the sums ``grads`` reduce-scattered over the shard group in
    ``wire_dtype``, and whether any of this rank's own sums was NaN or inf before (a device bool,
    for the log of a skip). fp32 sums land in an fp32 shard; 2-byte sums are reduced into this
    rank's own part of them, as stock DeepSpeed reduces its bf16/fp16 gradients (each chunk is
    copied out before its sum lands there): no fp32 shard beside the sums (4/W bytes per
    parameter), the sum rounded once to 2 bytes. Sends (W−1)/W · P · wire bytes per rank."""
    layout = ctx.flat.layout
    own_nonfinite = nonfinite(grads.sum(dtype=torch.float64))
    if grads.dtype == torch.float32:
        grad = temporary(layout.shard_size, torch.float32, grads.device)
    else:
        grad = layout.shard(grads)
    ctx.topology.shard.reduce_scatter(grad, grads, wire_dtype=wire_dtype)
    return grad, own_nonfinite


def judge(comm, grad: torch.Tensor, factor, clip: float,
          own_nonfinite: torch.Tensor) -> Tuple[torch.Tensor, object, torch.Tensor]:
    """Phase 3, on the device: the global norm of ``factor`` times the reduced gradient shards
    (``factor`` a positive number or device scalar) and which ranks' own sums were not finite
    (``own_nonfinite``: this rank's), in one
    all-reduce of W + 1 fp32 numbers (this rank's squared norm, and a 1 at its own place when its
    sums were not finite). Returns the norm (a float64 device scalar; non-finite: skip the
    step, the same verdict on every rank), the factor the update still applies (an fp32
    ``grad`` is scaled and clipped to ``clip`` in place: 1.0 is left; a 2-byte one chunk by
    chunk as AdamW reads it) and the W flags."""
    row = torch.zeros(comm.world + 1, dtype=torch.float32, device=grad.device)
    row[0] = squared_norm(grad)  # device copies into the row: no host read
    row[1 + comm.rank] = own_nonfinite
    comm.all_reduce(row)
    norm = row[0].double().sqrt() * factor
    factor = factor * clip_scale_tensor(norm, clip)
    if grad.dtype == torch.float32:
        grad.mul_(factor)
        factor = 1.0
    return norm, factor, row[1:]


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
    non-finite reduced gradient skips the update: ``target`` gets the unchanged master, and the
    verdict reaches the optimizer (loss scale, skip count) when the round is installed.

    The verdict stays on the device (:attr:`found_inf` skips the fused AdamW kernel) and reaches
    the host through :meth:`~ds_lowcomm.comm.round.StepRound.stage`: a round on the comm worker
    never makes the host wait for the device. A round on the training thread (``host_verdict``,
    a synchronous mode: the host decides whether to update, as DeepSpeed's own step does) reads
    it once, before the update. After :meth:`run`, :attr:`out` is this rank's shard of the new
    parameters (what :meth:`update` returned: acco's gathered change, where it gathers one).
    """

    def __init__(self, ctx: ModeContext, adamw: ShardAdamW, grads: torch.Tensor, target: torch.Tensor, *,
                 scale: Optional[float] = None, counts: Optional[Counts] = None) -> None:
        if (scale is None) == (counts is None):
            raise ValueError("give exactly one of scale and counts")
        super().__init__()
        self.ctx, self.adamw, self.grads, self.target = ctx, adamw, grads, target
        self.scale, self.counts = scale, counts
        self.out: Optional[torch.Tensor] = None
        #: the host reads the verdict before the update: a round on the training thread
        self.host_verdict = ctx.worker is None
        self.found_inf: Optional[torch.Tensor] = None
        self._counted_on_read = False

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
        grad, own_nonfinite = self.reduce()
        factor = scale if self.loss_scale == 1.0 else scale / self.loss_scale
        norm, factor, flags = judge(comm, grad, factor, self.ctx.gradient_clipping, own_nonfinite)
        self.found_inf = nonfinite(norm).float()
        parts = [norm.reshape(1), flags.double()]
        if self.counts is not None:
            parts.append(self.counts.rows.reshape(-1))
        verdict = torch.cat(parts)
        if self.host_verdict:  # the step's one host wait: the host decides whether to update
            self.stage(verdict)
            self.read_verdict(wait=True)
            self.ctx.stats.verdict_waits += 1
        self.out = self.update(grad, factor)
        self.gather(self.out)
        if not self.host_verdict:
            self.stage(verdict)

    def apply_verdict(self, values: List[float]) -> None:
        """The host copy of :meth:`run`'s verdict: the norm, the W flags, the counts' rows."""
        comm = self.ctx.topology.shard
        self.grad_norm = values[0]
        self.skipped = not math.isfinite(self.grad_norm)
        flags = values[1:1 + comm.world]
        self.nonfinite_ranks = [comm.ranks[i] for i, bad in enumerate(flags) if bad] if self.skipped else []
        if self.counts is not None:
            self.counts.read(values[1 + comm.world:], comm.world)
        if self._counted_on_read:
            self.adamw.count_step(self.skipped)

    def reduce(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Phase 2 (:func:`reduce_gradient` in ``comm_dtype``): the gradient shard, and whether
        any of this rank's own sums was NaN or inf before they were reduced."""
        return reduce_gradient(self.ctx, self.grads, self.ctx.comm_dtype)

    def update(self, grad: torch.Tensor, factor) -> torch.Tensor:
        """Phase 4: AdamW on the shard from ``factor · grad``, unless skipped (on the host's
        verdict, or on the device's, :attr:`found_inf`). Returns this rank's shard of the new
        parameters: the master itself (the all-gather converts it chunk by chunk: no
        shard-sized copy in the model's dtype)."""
        if self.host_verdict:
            if not self.skipped:
                self.adamw.step(grad, self.hyper, factor)
        else:
            self.adamw.step(grad, self.hyper, factor, found_inf=self.found_inf)
            self._counted_on_read = True
        return self.adamw.master

    def gather(self, out: torch.Tensor) -> None:
        """Phase 5: all-gather every rank's ``out`` into ``target``."""
        self.ctx.topology.shard.all_gather(self.target, out)

    def install(self) -> None:
        self.ctx.land_verdict(self)


def step_now(ctx: ModeContext, rnd: StepRound,
             after_install: Optional[Callable[[StepRound], None]] = None) -> None:
    """An optimizer step taken with its round at the boundary: pack it, run it (on the training
    thread, all of its time exposed: counted as waited for; or, where the mode has a comm worker,
    zero1 with overlap, on its thread, after the buckets queued before it: waiting for it waits
    only until it is queued on the device, its verdict reaching the host later), install it,
    clear the gradient sums, ``after_install(rnd)`` if given, and count the step.
    Communication: the round's own."""
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
