"""ModeContext: what a mode and its rounds are handed by the optimizer (its buffers, groups and
worker, not the optimizer itself)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ds_lowcomm.comm.collectives import Collectives, CommStats
from ds_lowcomm.shard.flat import FlatParams, GradAccumulator
from ds_lowcomm.shard.pace import Pacer
from ds_lowcomm.comm.topology import Topology
from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.comm.worker import CommWorker


@dataclass
class ModeContext:
    """What a mode and its rounds work with, as :class:`ddp_comm_hooks` hand a hook its state and
    bucket rather than the DDP module.

    Data: the flat parameters and their gradient accumulator, the process groups, the comm worker
    an asynchronous mode's rounds run on, the counters a synchronous round's time goes to, the
    caller's ``param_groups`` (read at pack time: a scheduler may change them),
    and the optimizer's fixed settings. Calls back into the optimizer: :meth:`step_taken` when a
    step is taken, :meth:`land_verdict` with a round whose result is installed (its verdict
    reaches :meth:`record_step` once it is on the host), :meth:`record_step` with a verdict known
    on the host.
    """

    flat: FlatParams
    grads: GradAccumulator
    topology: Topology
    #: None for a synchronous mode (its rounds run on the training thread)
    worker: Optional[CommWorker]
    stats: CommStats
    param_groups: List[dict]
    comm_dtype: torch.dtype
    gradient_clipping: float
    gradient_accumulation_steps: int
    #: the shard group's collectives, counted apart from training's (flush, export, per-rank loads)
    checkpoint_comm: Collectives
    _loss_scale: Callable[[], float]
    _steps: Callable[[], int]
    step_taken: Callable[[], None]
    #: ``record_step(step, grad_norm, skipped, nonfinite_ranks)``: the verdict of step ``step``
    record_step: Callable[[int, float, bool, Sequence[int]], None]
    #: ``land_verdict(round)``: a :class:`~ds_lowcomm.comm.round.StepRound` was installed; its
    #: verdict is recorded once it has reached the host (never waits for the device)
    land_verdict: Callable[[StepRound], None]
    #: the model's modules, for forward hooks (``zero1`` with overlap); empty when the optimizer
    #: was built without the model
    modules: Sequence[torch.nn.Module] = ()
    #: which micro-batches this rank computes fully (``lowcomm.pace``), for modes that pace; None
    #: where every micro-batch is computed
    pacer: Optional[Pacer] = None

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the gradients are computed with now (1.0 without fp16)."""
        return self._loss_scale()

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far."""
        return self._steps()

    @torch.no_grad()
    def set_params(self, full: torch.Tensor) -> None:
        """Write an unpadded flat fp32 tensor into the model's parameters (no communication)."""
        self.flat.unpadded(self.flat.buffer).copy_(full.to(self.flat.buffer.dtype))
