"""AdamW on one rank's fp32 shard of the flat parameters (the ZeRO-1 optimizer state).

The shard holds pieces of one or more param groups (:class:`ds_lowcomm.shard.flat.Segment`); each piece
is stepped with its group's current hyperparameters, read at step time so learning-rate schedulers
that edit ``param_groups`` (DeepSpeed's, Hugging Face's) drive it. The update is torch's own AdamW
kernel (fused where the device has one) so results match ``torch.optim.AdamW`` on the same data.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch.optim.adam import adam as _adam_kernel

from ds_lowcomm.memory import CHUNK_BYTES, temporary
from ds_lowcomm.shard.flat import Segment, ShardLayout


class ShardAdamW:
    """fp32 master weights and AdamW moments for this rank's shard.

    State: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, ``layout.shard_size`` each) and ``step``
    (number of updates applied): 12 bytes per shard element, 16 with an fp32 gradient shard (a
    2-byte gradient is read in place, chunk by chunk).
    """

    def __init__(self, layout: ShardLayout, initial_params: torch.Tensor) -> None:
        self.layout = layout
        self.segments: List[Segment] = layout.segments()
        self.master = layout.shard(initial_params).detach().to(torch.float32, copy=True)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        #: ``(group, start, end)`` of the shard elements AdamW updates: all of them here (Muon's:
        #: those outside its matrices)
        self.adamw_segments: List[Tuple[int, int, int]] = [(s.group, s.start, s.end) for s in self.segments]
        self._fused = self.master.device.type in ("cuda", "cpu")

    def step(self, grad: torch.Tensor, param_groups: Sequence[dict], factor: float = 1.0,
             chunk: int = CHUNK_BYTES // 4) -> None:
        """One AdamW update of the shard in place, from the shard gradient ``factor · grad``.

        An fp32 ``grad`` (``factor`` 1) is read as it is; a 2-byte one (the reduced sums kept in
        place) is converted to fp32 and scaled ``chunk`` elements at a time, so the update never
        holds an fp32 copy of the whole shard. AdamW is elementwise: the result is the same.
        """
        self.step_segments(grad, param_groups, factor, self.adamw_segments, chunk)
        self.step_count += 1

    def step_segments(self, grad: torch.Tensor, param_groups: Sequence[dict], factor: float, segments,
                      chunk: int = CHUNK_BYTES // 4) -> None:
        """The AdamW update of :meth:`step` on the shard elements of ``segments`` (``(group, start,
        end)`` each) alone, at the current step count, which it leaves as it is."""
        if grad.dtype == torch.float32 and factor != 1.0:
            raise ValueError("scale an fp32 gradient in place before the step")
        step = self.step_count
        lowp = grad.dtype != torch.float32
        scratch = temporary(min(chunk, grad.numel()), torch.float32, grad.device) if lowp else None
        for group, start, end in segments:
            hp = param_groups[group]
            beta1, beta2 = hp["betas"]
            size = chunk if lowp else end - start
            for a in range(start, end, size):
                sl = slice(a, min(a + size, end))
                g = scratch[:sl.stop - a].copy_(grad[sl]).mul_(factor) if lowp else grad[sl]
                # The kernel increments the step tensor before bias correction, as torch.optim
                # does, so each call gets a fresh one: filled on the device (torch.tensor(step,
                # device=...) would be a blocking host-to-device copy per chunk on CUDA).
                _adam_kernel([self.master[sl]], [g], [self.exp_avg[sl]], [self.exp_avg_sq[sl]], [],
                             [torch.full((), float(step), device=self.master.device)],
                             fused=self._fused, decoupled_weight_decay=True, amsgrad=False,
                             beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"],
                             eps=hp["eps"], maximize=False)

    @torch.no_grad()
    def estimate(self, grad: torch.Tensor, param_groups: Sequence[dict], out: torch.Tensor,
                 factor: float = 1.0, chunk: int = 1 << 20) -> None:
        """Write the parameters one AdamW step from ``factor · grad`` would give into ``out``,
        touching nothing: master, moments and step count are left bit-for-bit as they were.

        ACCO's estimate round (arXiv 2406.02613): same lr, step index, moments and weight decay as
        the real step that follows, only the gradient differs. Computed chunk by chunk, so it needs
        a few chunk-sized temporaries instead of a 12-bytes-per-element snapshot of the state.
        """
        step = self.step_count + 1
        lowp = grad.dtype != torch.float32 or factor != 1.0
        scratch = temporary(min(chunk, grad.numel()), torch.float32, grad.device) if lowp else None
        for seg in self.segments:
            hp = param_groups[seg.group]
            beta1, beta2 = hp["betas"]
            lr, wd, eps = hp["lr"], hp["weight_decay"], hp["eps"]
            bc1, bc2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
            for a in range(seg.start, seg.end, chunk):
                sl = slice(a, min(a + chunk, seg.end))
                g = scratch[:sl.stop - a].copy_(grad[sl]).mul_(factor) if lowp else grad[sl]
                m = self.exp_avg[sl].mul(beta1).add_(g, alpha=1 - beta1)
                v = self.exp_avg_sq[sl].mul(beta2).addcmul_(g, g, value=1 - beta2)
                denom = v.sqrt_().div_(bc2_sqrt).add_(eps)
                theta = self.master[sl].mul(1 - lr * wd).addcdiv_(m, denom, value=-lr / bc1)
                out[sl].copy_(theta)

    def informative_ranges(self, key: str) -> Optional[List[Tuple[int, int]]]:
        """The ``(start, end)`` shard ranges where state ``key`` can differ from zero, which an
        average across replicas must carry; None: all of it (every state of AdamW)."""
        return None

    def decay(self, key: str, values: torch.Tensor, updates: int, param_groups: Sequence[dict]) -> None:
        """Scale ``values`` (shard-shaped) in place by what ``updates`` updates leave of state
        ``key``'s earlier value: β1^n for ``exp_avg``, β2^n for ``exp_avg_sq``, each segment by its
        param group's betas (an EMA's m_{t+n} = β^n·m_t + the n gradients' terms)."""
        which = ("exp_avg", "exp_avg_sq").index(key)
        for group, start, end in self.adamw_segments:
            values[start:end].mul_(param_groups[group]["betas"][which] ** updates)

    def sharded_state(self) -> dict:
        """This rank's shards, as a checkpoint keeps them (no copy, no communication)."""
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_shards(self, shards, step: Optional[int]) -> None:
        """Take this rank's shards from a :class:`~ds_lowcomm.checkpoint.ShardReader` (any saved
        layout). ``step`` None: the master only, the moments and step count restart."""
        like = self.master
        self.master = shards.shard("master", self.layout, like)
        for k in ("exp_avg", "exp_avg_sq"):
            setattr(self, k, torch.zeros_like(like) if step is None else shards.shard(k, self.layout, like))
        self.step_count = 0 if step is None else int(step)
