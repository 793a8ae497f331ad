"""GradBuckets: the step's gradient reduce-scatter, bucket by bucket, during its last backward pass.

Megatron's ``overlap_grad_reduce`` for ZeRO-1, on ds_lowcomm's flat layout. The padded flat
gradient buffer is cut into contiguous buckets, numbered from its end (backward produces the last
layers' gradients first). During the backward pass that ends an accumulation, each parameter's
post-accumulate hook (:class:`~ds_lowcomm.flat.GradAccumulator`) marks it final; a bucket whose
parameters are all final is handed to the comm worker, which reduce-scatters that range
(:meth:`~ds_lowcomm.comm.Collectives.reduce_scatter_range`) while autograd computes the rest.

Buckets are launched strictly in number order, a bucket only when it and every bucket before it
are final, as DDP's reducer does: every rank issues the same collectives in the same order
whatever its own hook order. After the backward :meth:`finish` launches what is left (the buckets
of parameters that got no gradient). Over all buckets this is one reduce-scatter of the buffer:
the same bytes, and on gloo the same fp32 sums bit for bit.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ds_lowcomm.context import ModeContext
from ds_lowcomm.flat import ALIGN
from ds_lowcomm.round import Round
from ds_lowcomm.worker import Ticket

#: the largest bucket, in bytes of fp32 gradient (DDP's default bucket_cap_mb)
BUCKET_BYTES = 25 << 20
#: a smaller model still gets this many buckets, so that something overlaps
MIN_BUCKETS = 8


class BucketRound(Round):
    """The reduce-scatter of one bucket ``[start, end)`` of the gradient sums into ``out``."""

    def __init__(self, ctx: ModeContext, out: torch.Tensor, start: int, end: int) -> None:
        self.ctx, self.out, self.start, self.end = ctx, out, start, end

    def pack(self) -> None:
        """Nothing to capture: the range's sums are final and nobody writes them before the step."""

    def run(self) -> None:
        self.ctx.topology.shard.reduce_scatter_range(self.out, self.ctx.grads.buffer, self.start, self.end,
                                                     wire_dtype=self.ctx.comm_dtype)

    def install(self) -> None:
        """Nothing to install: the step's round reads ``out``."""


class GradBuckets:
    """Reduce-scatters the gradient sums into :attr:`out` (this rank's fp32 shard, allocated at
    :meth:`arm`) bucket by bucket, from the hooks of the backward pass between :meth:`arm` and
    :meth:`finish`. Needs an asynchronous :class:`~ds_lowcomm.worker.CommWorker` (rounds in
    submission order)."""

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self.out: Optional[torch.Tensor] = None
        flat = ctx.flat
        padded = flat.layout.padded
        size = min(BUCKET_BYTES // 4, -(-padded // MIN_BUCKETS))
        size = -(-size // ALIGN) * ALIGN
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
        self.out = self.ctx.grads.buffer.new_empty(self.ctx.flat.layout.shard_size, dtype=torch.float32)
        self._pending = list(self._params_in)
        self._final = set()
        self._next = 0
        self.tickets = []
        self._armed = True
        self.ctx.grads.on_final = self._param_final

    def finish(self) -> List[Ticket]:
        """After that backward pass: launch the buckets still waiting; returns every bucket's
        ticket (the step's round, submitted after them, runs after them)."""
        self.ctx.grads.on_final = None
        self._armed = False
        self.launched_in_backward += self._next
        self._launch()
        return self.tickets

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
            rnd = BucketRound(self.ctx, self.out, start, end)
            rnd.pack()
            self.tickets.append(self.ctx.worker.submit(rnd))
            self._next += 1
            self.launched += 1
