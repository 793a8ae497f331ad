"""Pace: the fastest rank sets the pace when the loop hands every rank the same micro-batches.

A loop that gives every rank the same micro-batches per step (the Hugging Face Trainer,
accelerate, TRL, a plain DeepSpeed loop) cannot let a fast rank compute more, so a slower rank
would set every step's length. Instead a slower rank computes only the first ``quota``
micro-batches of each block (a step, or an acco round) fully and runs the rest *forward only*
(``torch.no_grad``: the loop still gets valid outputs, logits and loss, and about a third of the
compute, backward costing about twice the forward's FLOPs), with ``quota`` chosen so that its block
takes about as long as the fastest rank's. The round then weights the reduced gradient by what was
really computed: every micro-batch carries a weight, 1 or, when the loop normalises the loss by
transformers' ``num_items_in_batch``, its label tokens, and with ``C`` the computed and ``O`` the
offered weight summed over the ranks the reduced sum is multiplied by ``O / (C · W)`` instead of
``1 / W`` (the same on every rank: the sums ride on the round's count all-reduce). With even
ranks nothing is dropped, ``O = C``, and the scale is ``1 / W`` bit for bit.

Paces are each rank's seconds per micro-batch, fully computed and forward only (the least of its
latest 8, after its first 2: what else runs on the host only ever slows a micro-batch down; waits
for communication excluded), measured from the start of its forward pass to the
end of its backward pass (or of the forward, for one run forward only), on the device's clock
(CUDA events, read once they have completed, never waited for) or the host's on CPU: what the
loop does between micro-batches (logging, checkpoints) is the same on every rank and left out.
They travel in the round's count all-reduce, so a rank plans the next block with every rank's paces from the last one. A rank plans to compute everything until
paces are known, and while its micro-batches take at most ``TRIGGER`` times the fastest rank's
(a smaller difference costs little, and on a CPU host noise could pass for it).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Deque, List, Optional, Sequence

import torch

#: a rank paces only when its micro-batches take more than this many times the fastest rank's
#: (below it, the cost is small and host noise, on CPU, could pass for a slower device)
TRIGGER = 1.5
#: a pacing rank plans its block to take at most this much longer than the fastest rank's
SLACK = 0.25
#: forward time / (forward + backward) assumed until a rank has measured a forward-only micro-batch
FORWARD_SHARE = 1.0 / 3.0
#: latest paces kept per kind (their least is shared, once there are this many)
WINDOW = 8
#: a rank's first micro-batches, which are slower than the rest (allocations, first kernels), not timed
WARMUP = 2


def pace_quota(n: int, full: float, forward: float, fastest: float) -> int:
    """Micro-batches of a block of ``n`` this rank computes fully, the rest forward only.

    ``full`` and ``forward``: this rank's seconds per micro-batch computed fully and forward only
    (0: not measured; ``forward`` is then taken as ``FORWARD_SHARE · full``); ``fastest``: the
    fastest rank's ``full``. ``n`` while a pace is unknown or this rank is at most ``TRIGGER``
    times slower than the fastest; else the largest count whose block takes at most
    ``(1 + SLACK)`` times the fastest rank's block of ``n`` (0: all of it forward only).
    """
    if full <= 0 or fastest <= 0 or full <= TRIGGER * fastest:
        return n
    budget = n * fastest * (1.0 + SLACK)
    if n * full <= budget:
        return n
    fwd = min(forward if forward > 0 else FORWARD_SHARE * full, full)
    if fwd >= full:  # forward only saves nothing here
        return n
    m = math.floor((budget - n * fwd) / (full - fwd))
    return max(0, min(n, m))


def token_weight(kwargs: dict, encoder_decoder: bool) -> Optional[torch.Tensor]:
    """The label tokens a transformers model normalises its loss by when the loop passes
    ``num_items_in_batch`` (``Trainer._get_num_items_in_batch``, transformers 5: ``shift_labels``
    when given, else ``labels[..., 1:]`` for a causal LM, else ``labels``, counting those not
    -100), as a float64 tensor on the labels' device (no host sync); None when the loss is a mean
    per micro-batch (no ``num_items_in_batch``), where every micro-batch weighs 1."""
    if kwargs.get("num_items_in_batch") is None:
        return None
    labels = kwargs.get("shift_labels")
    if labels is None:
        labels = kwargs.get("labels")
        if labels is None:
            return None
        if not encoder_decoder:
            labels = labels[..., 1:]
    return labels.ne(-100).sum().to(torch.float64)


class _HostClock:
    """Seconds between marks on the host's clock (CPU: the device's clock)."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end) -> Optional[float]:
        return end - start


class _CudaClock:
    """Seconds between marks on the device's clock: CUDA events recorded on the current stream,
    read only once both have completed (``query``), so reading never stalls the host."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> Optional[float]:
        if not (start.query() and end.query()):
            return None
        return start.elapsed_time(end) / 1000.0


def device_clock(device: torch.device):
    """The clock a rank's compute is timed on: CUDA events on a GPU (the host runs ahead of the
    kernels it queues, so the host's clock would time the queueing), the host's elsewhere. Its
    ``mark()`` starts or ends an interval; ``seconds(start, end)`` is None until both are done."""
    return _CudaClock() if device.type == "cuda" else _HostClock()


class Pacer:
    """Which micro-batches this rank computes fully, and what it computed (no communication:
    paces and weights travel in the rounds' count all-reduce).

    The engine calls :meth:`begin_micro_batch` as each forward pass starts and learns whether to
    run it with gradients, and :meth:`end_micro_batch` after its backward pass; the mode calls
    :meth:`end_block` when a round takes the block's sums, and :meth:`after_round` with every
    rank's paces and weights when a round's result is installed.

    Args:
        block_size: micro-batches per block (GAS for a step; GAS/2 for an acco round).
        rank: this rank's index in the round's group.
        device: where the device clock runs (CUDA events on a GPU, the host's clock otherwise).
        host_wait_seconds: seconds this rank's host has waited for communication so far (excluded
            from paces; a wait the GPU does on its stream, such as for zero1 overlap's parameter
            buckets, falls inside the device clock's interval and counts as compute).
    """

    def __init__(self, block_size: int, rank: int, *, device: torch.device, host_wait_seconds) -> None:
        self.block_size = block_size
        self.rank = rank
        #: set by the optimizer once it knows the loop (``LowCommOptimizer.bind_loop``)
        self.active = True
        self._clock = device_clock(device)
        self._host_wait_seconds = host_wait_seconds
        self._samples = {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}  # by computed
        self._pending: Deque[tuple] = deque()  # (start, end, computed, waited) not yet read
        self._begun = None  # (mark, computed, host_wait_seconds) of the micro-batch in progress
        self._seen = 0  # micro-batches ended since the start
        self.position = 0  # micro-batches begun in this block
        self.quota = block_size
        #: every rank's ``[full, forward]`` seconds per micro-batch from the latest round
        self.rank_paces: Optional[List[List[float]]] = None
        #: every rank's computed / offered weight over its latest real rounds
        self._shares: Deque[List[float]] = deque(maxlen=16)

    def begin_micro_batch(self) -> bool:
        """A forward pass starts: whether it runs with gradients (False: forward only). Host only."""
        computed = not self.active or self.position < self.quota
        if self.active:
            self._begun = (self._clock.mark(), computed, self._host_wait_seconds())
            self._read()
        self.position += 1
        return computed

    def end_micro_batch(self) -> None:
        """The micro-batch's backward pass (or forward, run forward only) is done. Host only."""
        self._seen += 1
        if self._begun is not None and self._seen > WARMUP:
            start, computed, waited = self._begun
            self._pending.append((start, self._clock.mark(), computed, self._host_wait_seconds() - waited))
        self._begun = None

    def end_block(self) -> None:
        """A round has taken the block's sums: the next forward starts a new block."""
        self.position = 0

    def local_paces(self) -> List[float]:
        """This rank's ``[full, forward]`` seconds per micro-batch (0 where not measured)."""
        self._read()
        return [min(self._samples[k]) if len(self._samples[k]) == WINDOW else 0.0
                for k in (True, False)]

    def after_round(self, rank_paces: Sequence[Sequence[float]],
                    rank_weights: Optional[Sequence[Sequence[float]]] = None) -> None:
        """A round's result is installed with every rank's paces and (a step's round) every
        rank's ``[computed, offered]`` weights: plan the next blocks, record the shares."""
        self.update(rank_paces)
        if rank_weights is not None:
            self.record([w[0] for w in rank_weights], [w[1] for w in rank_weights])

    def update(self, rank_paces: Sequence[Sequence[float]]) -> None:
        """Every rank's paces from a round: plan this rank's next blocks."""
        self.rank_paces = [list(p) for p in rank_paces]
        fastest = [p[0] for p in self.rank_paces if p[0] > 0]
        if not self.active or len(fastest) < len(self.rank_paces):
            self.quota = self.block_size  # a rank's pace unknown: compute everything
            return
        full, forward = self.rank_paces[self.rank]
        self.quota = pace_quota(self.block_size, full, forward, min(fastest))

    def record(self, computed: Sequence[float], offered: Sequence[float]) -> None:
        """Every rank's computed and offered weight in a step (for :meth:`computed_shares`)."""
        self._shares.append([c / o if o > 0 else 1.0 for c, o in zip(computed, offered)])

    def computed_shares(self) -> List[float]:
        """Each rank's share of its micro-batches (by weight) computed fully, over recent steps."""
        return [sum(s) / len(s) for s in zip(*self._shares)]

    def _read(self) -> None:
        while self._pending:
            start, end, computed, waited = self._pending[0]
            seconds = self._clock.seconds(start, end)
            if seconds is None:
                return  # not completed yet: read at a later call
            self._pending.popleft()
            self._samples[computed].append(max(seconds - waited, 0.0))
