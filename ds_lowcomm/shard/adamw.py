"""AdamW on one rank's fp32 shard of the flat parameters (the ZeRO-1 optimizer state).

The shard holds pieces of one or more param groups (:class:`ds_lowcomm.shard.flat.Segment`); each piece
is stepped with its group's current hyperparameters, read at step time so learning-rate schedulers
that edit ``param_groups`` (DeepSpeed's, Hugging Face's) drive it. The update is torch's own AdamW
kernel (fused where the device has one) so results match ``torch.optim.AdamW`` on the same data.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.optim.adam import adam as _adam_kernel

from ds_lowcomm.memory import step_chunk_bytes, temporary
from ds_lowcomm.shard.flat import Segment, ShardLayout


class ShardAdamW:
    """fp32 master weights and AdamW moments for this rank's shard.

    State: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, ``layout.shard_size`` each) and the
    number of updates applied: on the device, which the kernels read (a step skipped on
    the device's verdict leaves it as it is, without the host knowing), and ``step_count`` on the
    host, which follows it as each verdict is read (:meth:`count_step`). The device keeps the
    index the next update takes, ``next_step`` (the count + 1, as the kernel reads it). 12 bytes per shard
    element, 16 with an fp32 gradient shard (a 2-byte gradient is read in place, chunk by chunk).
    """

    def __init__(self, layout: ShardLayout, initial_params: torch.Tensor) -> None:
        self.layout = layout
        self.segments: List[Segment] = layout.segments()
        self.master = layout.shard(initial_params).detach().to(torch.float32, copy=True)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.next_step = torch.ones((), dtype=torch.float32, device=self.master.device)
        self._step_count = 0
        #: ``(group, start, end)`` of the shard elements AdamW updates: all of them here (Muon's:
        #: those outside its matrices)
        self.adamw_segments: List[Tuple[int, int, int]] = [(s.group, s.start, s.end) for s in self.segments]
        self._fused = self.master.device.type in ("cuda", "cpu")

    @property
    def step_count(self) -> int:
        """Updates applied, as far as the host knows (the device may be ahead by steps whose
        verdicts it has not read yet)."""
        return self._step_count

    @step_count.setter
    def step_count(self, n: int) -> None:
        """Set both counts (a checkpoint's load)."""
        self._step_count = int(n)
        self.next_step.fill_(float(n + 1))

    def step(self, grad: torch.Tensor, param_groups: Sequence[dict], factor=1.0,
             found_inf: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> None:
        """One AdamW update of the shard in place, from the shard gradient ``factor · grad``
        (``factor`` a number or a device scalar).

        An fp32 ``grad`` (``factor`` 1) is read as it is; a 2-byte one (the reduced sums kept in
        place) is converted to fp32 and scaled ``chunk`` elements at a time (default: the
        device's :func:`~ds_lowcomm.memory.step_chunk_bytes` of fp32), so
        the update never holds an fp32 copy of the whole shard. AdamW is elementwise: the result
        is the same. ``found_inf`` (a device float, 1 or 0): where 1, the kernels leave master,
        moments and the step count as they were, and the caller tells :meth:`count_step` the verdict
        once it has read it; without it the step is taken and counted.
        """
        self.step_segments(grad, param_groups, factor, self.adamw_segments, found_inf, chunk)
        self.advance(found_inf)

    def advance(self, found_inf: Optional[torch.Tensor]) -> None:
        """After an update: one more step on the device, unless ``found_inf``; on the host too
        when there is no device verdict to wait for."""
        self.next_step.add_(1)
        if found_inf is None:
            self._step_count += 1
        else:
            self.next_step.sub_(found_inf)

    def count_step(self, skipped: bool) -> None:
        """The host's count of a step taken on a device verdict (``found_inf``), once read."""
        if not skipped:
            self._step_count += 1

    def step_segments(self, grad: torch.Tensor, param_groups: Sequence[dict], factor, segments,
                      found_inf: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> None:
        """The AdamW update of :meth:`step` on the shard elements of ``segments`` (``(group, start,
        end)`` each) alone, at the current step count, which it leaves as it is."""
        if grad.dtype == torch.float32 and not (isinstance(factor, float) and factor == 1.0):
            raise ValueError("scale an fp32 gradient in place before the step")
        lowp = grad.dtype != torch.float32
        chunk = chunk or step_chunk_bytes(grad.device) // 4
        scratch = temporary(min(chunk, grad.numel()), torch.float32, grad.device) if lowp else None
        # The kernel reads the step after its increment (torch.optim's fused path adds 1 first):
        # a device scalar (a host number would be a blocking copy on CUDA).
        step = self.next_step
        for group, start, end in segments:
            hp = param_groups[group]
            beta1, beta2 = hp["betas"]
            size = chunk if lowp else end - start
            for a in range(start, end, size):
                sl = slice(a, min(a + size, end))
                g = scratch[:sl.stop - a].copy_(grad[sl]).mul_(factor) if lowp else grad[sl]
                self._kernel(self.master[sl], g, self.exp_avg[sl], self.exp_avg_sq[sl], step, hp, found_inf)

    def _kernel(self, param, grad, exp_avg, exp_avg_sq, step, hp, found_inf) -> None:
        """torch's AdamW on one chunk: ``_fused_adamw_`` on CUDA and CPU (one launch, skipped
        on the device where ``found_inf`` is 1), else torch's functional AdamW."""
        beta1, beta2 = hp["betas"]
        if self._fused:
            torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=hp["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=hp["weight_decay"], eps=hp["eps"],
                                amsgrad=False, maximize=False, grad_scale=None, found_inf=found_inf)
            return
        if found_inf is not None:
            raise ValueError(f"a device verdict needs the fused AdamW kernel (CUDA or CPU), not {param.device}")
        _adam_kernel([param], [grad], [exp_avg], [exp_avg_sq], [], [step.clone() - 1], fused=False,
                     decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=hp["lr"],
                     weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=False)

    @torch.no_grad()
    def estimate(self, grad: torch.Tensor, param_groups: Sequence[dict], out: torch.Tensor,
                 factor=1.0, found_inf: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> None:
        """Write the parameters one AdamW step from ``factor · grad`` would give into ``out``,
        touching nothing: master, moments and step count are left bit-for-bit as they were;
        where ``found_inf`` is 1, ``out`` gets the master.

        ACCO's estimate round (arXiv 2406.02613): same lr, step index, moments and weight decay as
        the real step that follows, only the gradient differs: the same kernel as :meth:`step`,
        run a chunk at a time on copies of the master and moments (a few chunk-sized
        temporaries instead of a 12-bytes-per-element snapshot of the state).
        """
        chunk = chunk or step_chunk_bytes(grad.device) // 4
        n = min(chunk, grad.numel())
        lowp = grad.dtype != torch.float32 or not (isinstance(factor, float) and factor == 1.0)
        g_s = temporary(n, torch.float32, grad.device) if lowp else None
        m_s, v_s = temporary(n, torch.float32, grad.device), temporary(n, torch.float32, grad.device)
        p_s = None if out.dtype == torch.float32 else temporary(n, torch.float32, grad.device)
        step = self.next_step
        for seg in self.segments:
            hp = param_groups[seg.group]
            for a in range(seg.start, seg.end, chunk):
                sl = slice(a, min(a + chunk, seg.end))
                k = sl.stop - a
                g = g_s[:k].copy_(grad[sl]).mul_(factor) if lowp else grad[sl]
                p = (out[sl] if p_s is None else p_s[:k]).copy_(self.master[sl])
                self._kernel(p, g, m_s[:k].copy_(self.exp_avg[sl]), v_s[:k].copy_(self.exp_avg_sq[sl]),
                             step, hp, found_inf)
                if p_s is not None:
                    out[sl].copy_(p)

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
        self.next_step = torch.ones((), dtype=torch.float32, device=like.device)
        self.step_count = 0 if step is None else int(step)
