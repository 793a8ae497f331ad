"""AdamW on one rank's fp32 shard of the flat parameters (the ZeRO-1 optimizer state).

The shard holds pieces of one or more param groups (:class:`ds_lowcomm.flat.Segment`); each piece
is stepped with its group's current hyperparameters, read at step time so learning-rate schedulers
that edit ``param_groups`` (DeepSpeed's, Hugging Face's) drive it. The update is torch's own AdamW
kernel (fused where the device has one) so results match ``torch.optim.AdamW`` on the same data.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch.optim.adam import adam as _adam_kernel

from ds_lowcomm.flat import Segment, ShardLayout


class ShardAdamW:
    """fp32 master weights and AdamW moments for this rank's shard.

    State: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, ``layout.shard_size`` each) and ``step``
    (number of updates applied). 16 bytes per shard element with the gradient shard.
    """

    def __init__(self, layout: ShardLayout, initial_params: torch.Tensor) -> None:
        self.layout = layout
        self.segments: List[Segment] = layout.segments()
        self.master = layout.shard(initial_params).detach().to(torch.float32, copy=True)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        self._fused = self.master.device.type in ("cuda", "cpu")

    def step(self, grad: torch.Tensor, param_groups: Sequence[dict]) -> None:
        """One AdamW update of the shard in place, from the fp32 shard gradient ``grad``."""
        step = self.step_count
        for seg in self.segments:
            hp = param_groups[seg.group]
            beta1, beta2 = hp["betas"]
            sl = slice(seg.start, seg.end)
            # The kernel increments the step tensor before bias correction, as torch.optim does.
            _adam_kernel([self.master[sl]], [grad[sl]], [self.exp_avg[sl]], [self.exp_avg_sq[sl]], [],
                         [torch.tensor(float(step), device=self.master.device)],
                         fused=self._fused, decoupled_weight_decay=True, amsgrad=False,
                         beta1=beta1, beta2=beta2, lr=hp["lr"], weight_decay=hp["weight_decay"],
                         eps=hp["eps"], maximize=False)
        self.step_count = step + 1
