"""Flat parameter and gradient buffers, and how they are cut into shards.

All trainable parameters live as views of one padded flat buffer, in param-group order, so a
reduce-scatter or all-gather of the whole model is one collective on one tensor and each rank's
shard is one contiguous range of it. Param group ``i`` occupies one contiguous range too, so the
intersection of a shard with a group (a :class:`Segment`) is at most one range: that is what the
shard optimizer steps with the group's hyperparameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# Shards start on 16-element boundaries (64 bytes of fp32) so vectorised kernels see aligned data.
ALIGN = 16


@dataclass(frozen=True)
class Segment:
    """The part of param group ``group`` that lies in a shard, as a range in shard coordinates."""
    group: int
    start: int
    end: int


@dataclass(frozen=True)
class ShardLayout:
    """``numel`` real elements padded to ``padded`` and cut into ``world`` equal contiguous shards."""
    numel: int
    world: int
    rank: int
    group_ranges: tuple  # ((start, end), ...) of each param group in the flat buffer

    @property
    def padded(self) -> int:
        """``numel`` rounded up to a multiple of ``world`` · ALIGN: every shard the same size and
        aligned."""
        unit = self.world * ALIGN
        return -(-self.numel // unit) * unit

    @property
    def shard_size(self) -> int:
        """Elements per shard (padding included)."""
        return self.padded // self.world

    @property
    def shard_start(self) -> int:
        """Where this rank's shard begins in the padded flat buffer."""
        return self.rank * self.shard_size

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded flat tensor (a view)."""
        return flat.narrow(0, self.shard_start, self.shard_size)

    def segments(self) -> List[Segment]:
        """The param groups present in this rank's shard, in shard coordinates."""
        lo, hi = self.shard_start, self.shard_start + self.shard_size
        out = []
        for g, (s, e) in enumerate(self.group_ranges):
            a, b = max(s, lo), min(e, hi)
            if a < b:
                out.append(Segment(g, a - lo, b - lo))
        return out


class FlatParams:
    """Makes the parameters of ``param_groups`` views of one padded flat buffer.

    Parameters must share one dtype and device (DeepSpeed has already cast and moved the model).
    ``buffer`` is what the all-gather writes; padding stays zero.
    """

    def __init__(self, param_groups: Sequence[dict], world: int, rank: int) -> None:
        self.params: List[torch.nn.Parameter] = [p for g in param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters to train")
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"ds_lowcomm needs every trainable parameter in one dtype on one device; "
                             f"got dtypes {sorted(map(str, dtypes))} on {sorted(map(str, devices))} "
                             f"(a module kept in fp32 under bf16/fp16? freeze it or cast it with the model)")
        ranges, offset = [], 0
        self.offsets: Dict[int, int] = {}
        for g in param_groups:
            start = offset
            for p in g["params"]:
                self.offsets[id(p)] = offset
                offset += p.numel()
            ranges.append((start, offset))
        self.layout = ShardLayout(offset, world, rank, tuple(ranges))
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.buffer = torch.zeros(self.layout.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p in self.params:
                view = self.view(self.buffer, p)
                view.copy_(p.data)
                p.data = view

    def reshard(self, world: int, rank: int) -> None:
        """Cut the same buffer into ``world`` shards (a divisor of the current shard count) and
        take shard ``rank``: the padded size can only shrink, so the buffer becomes a prefix of
        itself and nothing moves (the parameters stay views of it)."""
        layout = ShardLayout(self.layout.numel, world, rank, self.layout.group_ranges)
        if layout.padded > self.buffer.numel():
            raise ValueError(f"{world} shards need {layout.padded} elements; the buffer has {self.buffer.numel()}")
        self.layout, self.buffer = layout, self.buffer[: layout.padded]

    def view(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``p``'s slice of any flat tensor with this layout, shaped like ``p``."""
        return flat.narrow(0, self.offsets[id(p)], p.numel()).view_as(p)

    def unpadded(self, flat: torch.Tensor) -> torch.Tensor:
        """The real elements of a padded flat tensor (a view, padding dropped)."""
        return flat[: self.layout.numel]

    def matrix_rows_in_shard(self) -> List[Tuple[int, int, int]]:
        """``(start, rows, cols)`` in shard coordinates: the whole rows of each parameter of two
        or more dimensions (a row = its last dimension) that lie in this rank's shard."""
        lo, hi = self.layout.shard_start, self.layout.shard_start + self.layout.shard_size
        blocks = []
        for p in self.params:
            if p.dim() < 2:
                continue
            start, cols = self.offsets[id(p)], p.shape[-1]
            first = max(0, -(-(lo - start) // cols))
            last = min(p.numel() // cols, (hi - start) // cols)
            if last > first:
                blocks.append((start + first * cols - lo, last - first, cols))
        return blocks


class GradAccumulator:
    """Gradient sums in a flat buffer laid out like :class:`FlatParams`, in ``dtype``.

    ``dtype`` is DeepSpeed's ``data_types.grad_accum_dtype``: by default the parameters' dtype
    (what stock DeepSpeed accumulates in), or fp32 for sums that do not round at every micro-batch.
    When it is the parameters' dtype (``in_place``), each ``p.grad`` *is* the parameter's slice of
    the buffer, as with DDP's ``gradient_as_bucket_view``, so autograd adds every micro-batch's
    gradient into the sum in place and no per-parameter gradient is allocated, copied or freed (on
    CPU, freed ones leave heap pages that must be trimmed and then faulted in again). Otherwise
    (fp32 sums of a bf16/fp16 model) a post-accumulate-grad hook adds ``p.grad`` into the buffer
    and frees it.

    The same hook keeps the sum whole when someone has set ``p.grad`` to None or to another
    tensor (DeepSpeed's ``engine.zero_grad``, a module's ``zero_grad()``): it adds what autograd
    produced and points ``p.grad`` back at the slice. Zeroing ``p.grad`` *in place*
    (``zero_grad(set_to_none=False)``) zeroes that part of the sum, as it would in stock
    DeepSpeed. ``micro_batches`` counts the backward passes summed since the last :meth:`zero_`.
    ``on_final(p)``, when set, is called once ``p``'s gradient is in the sum (from autograd's
    thread, in the order backward produces them).
    """

    def __init__(self, flat: FlatParams, dtype: Optional[torch.dtype] = None) -> None:
        dtype = dtype or flat.dtype
        if dtype not in (torch.float32, flat.dtype):
            raise ValueError(f"gradients of {flat.dtype} parameters are summed in fp32 or in {flat.dtype}, "
                             f"not {dtype}")
        self.flat = flat
        self.buffer = torch.zeros(flat.layout.padded, dtype=dtype, device=flat.device)
        self.micro_batches = 0
        self.weights = torch.zeros(2, dtype=torch.float64, device=flat.device)
        #: ``p.grad`` is the parameter's slice of the buffer (sums in the parameters' dtype)
        self.in_place = dtype == flat.dtype
        self.on_final: Optional[Callable[[torch.Tensor], None]] = None
        self._slices = {id(p): flat.view(self.buffer, p) for p in flat.params}
        self.attach()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in flat.params]

    def follow_layout(self) -> None:
        """After :meth:`FlatParams.reshard`: the sums become the same prefix of their buffer."""
        self.buffer = self.buffer[: self.flat.layout.padded]

    def attach(self) -> None:
        """Point each parameter's ``p.grad`` at its slice of the sums (None unless ``in_place``)."""
        for p in self.flat.params:
            p.grad = self._slices[id(p)] if self.in_place else None

    def _hook(self, p: torch.Tensor) -> None:
        grad, own = p.grad, self._slices[id(p)]
        if grad is not own:  # else autograd has added into the sum in place
            own.add_(grad)
            p.grad = own if self.in_place else None
        if self.on_final is not None:
            self.on_final(p)

    def zero_(self) -> None:
        """Clear the sums, the micro-batch count and the weights (after a step took them)."""
        self.buffer.zero_()
        self.micro_batches = 0
        self.weights.zero_()

    def count(self, computed: bool, weight) -> None:
        """A micro-batch of ``weight`` (a number or a 0-d tensor on the device) was handed to this
        rank; ``computed``: its gradient was summed (a backward pass ran). No host sync."""
        if computed:
            self.micro_batches += 1
            self.weights.add_(weight)
        else:
            self.weights[1:].add_(weight)

    def remove_hooks(self) -> None:
        """Stop accumulating; ``p.grad`` no longer refers to the buffer."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for p in self.flat.params:
            p.grad = None


def gather_full(comm, layout: ShardLayout, shard: torch.Tensor) -> torch.Tensor:
    """Every rank's ``shard`` concatenated and unpadded (collective over ``comm``'s group, a
    :class:`~ds_lowcomm.comm.collectives.Collectives`): (W-1)/W · P · element bytes received."""
    full = shard.new_empty(layout.padded)
    comm.all_gather(full, shard.contiguous())
    return full[: layout.numel].clone()
