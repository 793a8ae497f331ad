"""Bucketed overlap for ``zero1``: the gradient reduce-scatter during the step's last backward
pass (:class:`GradBuckets`), the parameter all-gather during the next forward (:class:`ParamBuckets`).

Megatron's ``overlap_grad_reduce`` for ZeRO-1, on ds_lowcomm's flat layout. The padded flat
gradient buffer is cut into contiguous buckets, numbered from its end (backward produces the last
layers' gradients first). During the backward pass that ends an accumulation, each parameter's
post-accumulate hook (:class:`~ds_lowcomm.shard.flat.GradAccumulator`) marks it final; a bucket whose
parameters are all final is handed to the comm worker, which reduce-scatters that range
(:meth:`~ds_lowcomm.comm.collectives.Collectives.reduce_scatter_range`) while autograd computes the rest.

Buckets are launched strictly in number order, a bucket only when it and every bucket before it
are final, as DDP's reducer does: every rank issues the same collectives in the same order
whatever its own hook order. After the backward :meth:`finish` launches what is left (the buckets
of parameters that got no gradient). Over all buckets this is one reduce-scatter of the buffer:
the same bytes, and on gloo the same fp32 sums bit for bit.

Megatron's ``overlap_param_gather``: after the sharded AdamW, the new parameters are all-gathered
bucket by bucket from the start of the buffer (the order the forward pass uses them) on the comm
worker while the training thread returns to the loop; a forward pre-hook on each module waits for
the buckets holding its own parameters. The same bytes as one all-gather, the same values.
"""
from __future__ import annotations

import functools

from typing import Dict, List, Optional, Tuple

import torch

from ds_lowcomm.memory import temporary
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.shard.flat import ALIGN
from ds_lowcomm.comm.round import Round
from ds_lowcomm.shard.step import nonfinite
from ds_lowcomm.comm.worker import Ticket

#: the largest bucket, in bytes of fp32 gradient (DDP's default bucket_cap_mb)
BUCKET_BYTES = 25 << 20
#: a smaller model still gets this many buckets, so that something overlaps
MIN_BUCKETS = 8


def _bucket_size(padded: int, copies: int = 1) -> int:
    """Elements per bucket of a ``padded`` buffer: at least MIN_BUCKETS buckets, and ``copies``
    copies of a bucket within BUCKET_BYTES of fp32."""
    size = min(BUCKET_BYTES // (4 * copies), -(-padded // MIN_BUCKETS))
    return -(-size // ALIGN) * ALIGN


class BucketRound(Round):
    """The reduce-scatter of one bucket ``[start, end)`` of the gradient sums into ``buckets.out``."""

    def __init__(self, buckets: "GradBuckets", start: int, end: int) -> None:
        self.buckets, self.ctx, self.start, self.end = buckets, buckets.ctx, start, end

    def pack(self) -> None:
        """Nothing to capture: the range's sums are final and nobody writes them before the step."""

    def run(self) -> None:
        """On the comm worker: the bucket's reduce-scatter (each rank sends the part of the
        range outside its own shard, in the wire dtype; over all buckets (W−1)/W · P)."""
        sums = self.ctx.grads.buffer
        # First note whether this rank's own sums in the range were finite, for the log of a
        # skip (a device flag: the step's verdict carries it; 2-byte sums are reduced in place).
        self.buckets.own_nonfinite.logical_or_(nonfinite(sums[self.start:self.end].sum(dtype=torch.float64)))
        self.ctx.topology.shard.reduce_scatter_range(self.buckets.out, sums, self.start, self.end,
                                                     wire_dtype=self.ctx.comm_dtype)

    def install(self) -> None:
        """Nothing to install: the step's round reads ``out``."""


class GradBuckets:
    """Reduce-scatters the gradient sums into :attr:`out` bucket by bucket, from the hooks of the
    backward pass between :meth:`arm` and :meth:`finish`: this rank's fp32 shard, allocated at
    :meth:`arm`, or with 2-byte sums this rank's own part of them, reduced in place as the step's
    round would (:class:`~ds_lowcomm.shard.step.ShardedStepRound`). Needs an asynchronous
    :class:`~ds_lowcomm.comm.worker.CommWorker` (rounds in submission order). The buckets together
    send what the step's reduce-scatter would, (W−1)/W · P · wire bytes per rank."""

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self.out: Optional[torch.Tensor] = None
        #: whether any of this rank's own sums was NaN or inf before they were reduced (a device bool)
        self.own_nonfinite: Optional[torch.Tensor] = None
        flat = ctx.flat
        padded = flat.layout.padded
        size = _bucket_size(padded)
        #: ``(start, end)`` of each bucket, bucket 0 at the end of the buffer
        self.ranges: List[Tuple[int, int]] = [(max(0, end - size), end) for end in range(padded, 0, -size)]
        self._buckets_of: Dict[int, List[int]] = {}
        self._params_in = [0] * len(self.ranges)
        for p in flat.params:
            lo, hi = flat.offsets[id(p)], flat.offsets[id(p)] + p.numel()
            first, last = (padded - hi) // size, (padded - 1 - lo) // size
            self._buckets_of[id(p)] = list(range(first, last + 1))
            for b in self._buckets_of[id(p)]:
                self._params_in[b] += 1
        self._names = {id(p): f"#{i} (shape {list(p.shape)})" for i, p in enumerate(flat.params)}
        self._armed = False
        self._pending: List[int] = []
        self._final: set = set()
        self._next = 0
        self.tickets: List[Ticket] = []
        #: buckets launched from the hooks, before the backward pass ended (summed over steps)
        self.launched_in_backward = 0
        self.launched = 0

    def arm(self) -> None:
        """Before the backward pass that ends an accumulation: watch its hooks."""
        sums = self.ctx.grads.buffer
        if sums.dtype == torch.float32:
            self.out = temporary(self.ctx.flat.layout.shard_size, sums.dtype, sums.device)
        else:
            self.out = self.ctx.flat.layout.shard(sums)
        self.own_nonfinite = torch.zeros((), dtype=torch.bool, device=sums.device)
        self._pending = list(self._params_in)
        self._final = set()
        self._next = 0
        self.tickets = []
        self._armed = True
        self.ctx.grads.on_final = self._param_final

    def finish(self) -> List[Ticket]:
        """After that backward pass: launch the buckets still waiting; returns every bucket's
        ticket (:meth:`take` waits for them)."""
        self.ctx.grads.on_final = None
        self._armed = False
        self.launched_in_backward += self._next
        self._launch()
        return self.tickets

    def take(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """At the step: wait for every bucket (a failed one raises here), then hand over
        :attr:`out` and :attr:`own_nonfinite` (the step's round starts from them)."""
        if self.out is None:
            raise RuntimeError("ds_lowcomm: zero1 with overlap stepped without a boundary backward "
                               "pass (call engine.backward before engine.step)")
        for ticket in self.tickets:
            self.ctx.worker.wait(ticket)
        out, self.out = self.out, None
        return out, self.own_nonfinite

    def _param_final(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._final:
            raise RuntimeError(
                f"ds_lowcomm: lowcomm.zero1.overlap: parameter {self._names[key]} got its gradient twice "
                f"in one backward pass (reentrant activation checkpointing calls backward once per "
                f"segment), after its bucket may already have been sent; use non-reentrant "
                f"checkpointing (use_reentrant=False) or set lowcomm.zero1.overlap to false")
        self._final.add(key)
        for b in self._buckets_of[key]:
            self._pending[b] -= 1
        self._launch()

    def _launch(self) -> None:
        """Submit, in number order, the buckets whose sums are final (all of them once disarmed)."""
        while self._next < len(self.ranges) and (not self._armed or self._pending[self._next] == 0):
            start, end = self.ranges[self._next]
            rnd = BucketRound(self, start, end)
            rnd.pack()
            self.tickets.append(self.ctx.worker.submit(rnd))
            self._next += 1
            self.launched += 1


class GatherRound(Round):
    """The all-gather of one bucket ``[start, end)`` of the new parameters into the model's."""

    def __init__(self, ctx: ModeContext, shard: torch.Tensor, start: int, end: int) -> None:
        self.ctx, self.shard, self.start, self.end = ctx, shard, start, end

    def pack(self) -> None:
        """Nothing to capture: ``shard`` is the step's result, written before this round runs."""

    def run(self) -> None:
        """On the comm worker: the bucket's all-gather (each rank sends its own part of the
        range to the W − 1 others; over all buckets (W−1)/W · P · param bytes)."""
        self.ctx.topology.shard.all_gather_range(self.ctx.flat.buffer, self.shard, self.start, self.end)

    def install(self) -> None:
        """Nothing to install: the range lands in the model's parameters."""


class ParamBuckets:
    """All-gathers a step's new parameters into the model bucket by bucket (:meth:`start`) and
    makes each module's forward wait for the buckets holding its own parameters.

    Contract: between :meth:`start` and :meth:`wait_all` the model's parameters are being
    written; a module's parameters are complete when its forward begins. Code that reads
    parameters another way first calls :meth:`wait_all` (the mode's ``settle``/``flush`` do).
    Needs an asynchronous :class:`~ds_lowcomm.comm.worker.CommWorker` (rounds in submission order).
    """

    def __init__(self, ctx: ModeContext) -> None:
        if not ctx.modules:
            raise ValueError("ParamBuckets needs the model's modules (ModeContext.modules) to hook")
        self.ctx = ctx
        flat = ctx.flat
        padded = flat.layout.padded
        # A bucket's owner sends W copies of its part in one all-to-all.
        size = _bucket_size(padded, copies=ctx.topology.shard.world)
        #: ``(start, end)`` of each bucket, bucket 0 at the start of the buffer
        self.ranges: List[Tuple[int, int]] = [(s, min(s + size, padded)) for s in range(0, padded, size)]
        self.tickets: List[Ticket] = []
        self._waited = 0
        #: buckets first waited for by a module's forward, not by :meth:`wait_all` (summed over steps)
        self.waited_in_forward = 0
        self.gathered = 0
        for module in ctx.modules:
            ends = [flat.offsets[id(p)] + p.numel() for p in module.parameters(recurse=False)
                    if id(p) in flat.offsets]
            if ends:
                need = (max(ends) - 1) // size
                module.register_forward_pre_hook(functools.partial(self._before_forward, need))

    def start(self, shard: torch.Tensor) -> None:
        """Submit the all-gather of every bucket from this rank's ``shard`` of the new parameters
        (the fp32 master, converted to the model's dtype bucket by bucket; nothing writes it
        before the next step's round, which comes after :meth:`wait_all`). Cost: one all-gather
        of the padded buffer in all."""
        self.wait_all()
        for lo, hi in self.ranges:
            rnd = GatherRound(self.ctx, shard, lo, hi)
            rnd.pack()
            self.tickets.append(self.ctx.worker.submit(rnd))
        self._waited = 0
        self.gathered += len(self.ranges)

    def _before_forward(self, need: int, module, args) -> None:
        if self.tickets:
            before = self._waited
            self._wait_through(need)
            self.waited_in_forward += self._waited - before
            if self._waited == len(self.tickets):
                self.tickets = []

    def _wait_through(self, last: int) -> None:
        while self._waited <= min(last, len(self.tickets) - 1):
            self.ctx.worker.wait(self.tickets[self._waited])  # a failed bucket raises here
            self._waited += 1

    def wait_all(self) -> None:
        """Wait until the model's parameters are complete (no communication of its own)."""
        if self.tickets:
            self._wait_through(len(self.tickets) - 1)
            self.tickets = []
