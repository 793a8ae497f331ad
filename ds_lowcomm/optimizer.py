"""LowCommOptimizer: the torch optimizer DeepSpeed drives, owning all data-parallel communication.

DeepSpeed runs at ZeRO stage 0 with its gradient all-reduce switched off
(``engine.enable_backward_allreduce = False``, the hook DeepSpeed's 1-bit Adam used), so this object
is the only thing that moves gradients or parameters between ranks. It owns:

- :class:`~ds_lowcomm.shard.flat.FlatParams`: the parameters as views of one padded flat buffer;
- :class:`~ds_lowcomm.shard.flat.GradAccumulator`: the gradient sums (``p.grad`` views of them, or
  filled by post-accumulate hooks);
- :class:`~ds_lowcomm.comm.topology.Topology`: private shard / replica process groups;
- :class:`~ds_lowcomm.comm.worker.CommWorker` (asynchronous modes) and
  :class:`~ds_lowcomm.comm.collectives.CommStats`;
- the :class:`~ds_lowcomm.modes.Mode`, which owns the optimizer state and schedules rounds.

``param_groups`` are the caller's dicts (a client optimizer's, or built from the JSON), so learning
rate schedulers written against them keep working.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ds_lowcomm.checkpoint import FORMAT, CheckpointError, shard_meta
from ds_lowcomm.checkpoint.migrate import upgrade_meta
from ds_lowcomm.comm.collectives import CommStats
from ds_lowcomm.config import LowCommConfig
from ds_lowcomm.memory import release_freed_heap
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.shard.flat import FlatParams, GradAccumulator
from ds_lowcomm.modes import MODES
from ds_lowcomm.shard.pace import Pacer
from ds_lowcomm.comm.topology import Topology
from ds_lowcomm.comm.worker import CommWorker

ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
logger = logging.getLogger("ds_lowcomm")


class DivergedError(RuntimeError):
    """Too many consecutive steps had a non-finite gradient: the run has diverged. The weights
    and optimizer state are those before the first of them (every one was skipped)."""


class LowCommOptimizer(torch.optim.Optimizer):
    """AdamW whose state is sharded and whose communication is decided by a mode.

    Args:
        param_groups: dicts with ``"params"`` and AdamW hyperparameters (missing ones default to
            torch's AdamW defaults). Parameters must already be on their device and dtype.
        config: the validated ``"lowcomm"`` section.
        gradient_clipping: global-norm clip applied after the reduction (0 = off).
        comm_dtype: dtype gradients are reduced in.
        grad_accum_dtype: dtype micro-batch gradients are summed in (DeepSpeed's
            ``data_types.grad_accum_dtype``): the parameters' (default) or fp32.
        gradient_accumulation_steps: micro-batches per optimizer step and rank (DeepSpeed divides
            each micro-batch's loss by it).
        param_names: for each parameter (by ``id``), every name it has in the module's state_dict.
        loss_scaler: fp16: DeepSpeed's own loss scaler (``DynamicLossScaler`` or a static
            ``LossScaler``), whose ``cur_scale`` the engine multiplies each loss by; None otherwise.
        modules: the model's modules (the engine passes ``module.modules()``); ``zero1`` with
            ``overlap`` hooks their forward to wait for their parameters' all-gather.

    Every mode's round checks the reduced gradient for NaN/inf and skips the update when it is
    non-finite (:meth:`record_step` receives the verdict). ``overflow`` and ``skipped_steps``
    then follow DeepSpeed's meaning, so DeepSpeed counts the step as skipped and does not step
    the learning-rate schedule, and accelerate's ``step_was_skipped`` is true.

    Building it is collective (it creates process groups): every rank must construct it.
    """

    def __init__(self, param_groups: Sequence[dict], config: LowCommConfig, *, gradient_clipping: float,
                 comm_dtype: torch.dtype, param_names: Dict[int, List[str]],
                 grad_accum_dtype: Optional[torch.dtype] = None, gradient_accumulation_steps: int = 1, loss_scaler=None,
                 modules: Sequence[torch.nn.Module] = ()) -> None:
        super().__init__(list(param_groups), dict(ADAMW_DEFAULTS))
        self.config = config
        self.gradient_clipping = float(gradient_clipping or 0.0)
        self.comm_dtype = comm_dtype
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.stats = CommStats()
        self.checkpoint_stats = CommStats()
        self.topology = Topology.build(config.shard_group_size, config.collective_timeout_s, self.stats)
        self.checkpoint_comm = self.topology.shard.counted_in(self.checkpoint_stats)
        self.flat = FlatParams(self.param_groups, self.topology.shard.world, self.topology.shard.rank)
        self.param_names = [param_names.get(id(p), [f"param{i}"]) for i, p in enumerate(self.flat.params)]
        self.grads = GradAccumulator(self.flat, grad_accum_dtype)
        mode_cls = MODES[config.mode]
        # On CPU the per-parameter gradients freed after each backward (fp32 sums of a bf16/fp16
        # model) would stay resident (see release_freed_heap). In-place ones are never freed.
        self._trim_heap = self.flat.device.type == "cpu" and not self.grads.in_place
        self.worker = (CommWorker(self.stats, self.flat.device) if mode_cls.is_asynchronous(config.mode_options)
                       else None)
        self.micro_batches = 0
        self.steps = 0
        # lowcomm.pace: by default the fastest rank sets the pace where the mode's rounds can
        # carry the paces ("slowest", or a mode that cannot: every micro-batch computed).
        self.pacer: Optional[Pacer] = None
        if mode_cls.paces and config.pace != "slowest":
            self.pacer = Pacer(mode_cls.pace_block(config.mode_options, self.gradient_accumulation_steps),
                               self.topology.shard.rank, device=self.flat.device,
                               host_wait_seconds=lambda: self.stats.host_wait_seconds)
        #: ``steps`` when this process started counting bytes (a resume restores ``steps``)
        self.steps_at_start = 0
        #: called after each optimizer step is taken (the engine's hook)
        self.on_step_taken: Optional[Callable[[], None]] = None
        self.loss_scaler = loss_scaler
        #: steps whose update was skipped for a non-finite gradient, and how many in a row
        self.skipped_steps = 0
        self.consecutive_skips = 0
        # Read by DeepSpeed's engine after step() (engine.get_global_grad_norm, HF logging, the
        # skipped-step count) and by accelerate (``step_was_skipped``): the latest verdict.
        self._global_grad_norm: Optional[float] = None
        self.overflow = False
        self.mode = mode_cls(ModeContext(
            flat=self.flat, grads=self.grads, topology=self.topology, worker=self.worker, stats=self.stats,
            param_groups=self.param_groups, comm_dtype=comm_dtype, gradient_clipping=self.gradient_clipping,
            gradient_accumulation_steps=self.gradient_accumulation_steps, checkpoint_comm=self.checkpoint_comm,
            _loss_scale=lambda: self.loss_scale, _steps=lambda: self.steps, step_taken=self.step_taken,
            record_step=self.record_step, modules=tuple(modules), pacer=self.pacer), config.mode_options)
        #: set by LowCommEngine.load_checkpoint while DeepSpeed loads: where the flat state is read
        self.checkpoint_shards = None

    # -- training -------------------------------------------------------------------------------

    def bind_loop(self, marks_boundaries: bool) -> None:
        """Called by the engine before the first backward pass: whether the loop marks its own
        accumulation boundaries (see :meth:`Mode.bind_loop`). No communication."""
        self.mode.bind_loop(marks_boundaries)
        if self.pacer is not None:
            # By default only where the loop hands every rank the same micro-batches per step it
            # counts (the Trainer, accelerate, TRL); elsewhere "pace": "fastest" asks for it.
            self.pacer.active = self.mode.paces_in_loop() and (self.config.pace == "fastest" or marks_boundaries)

    def begin_micro_batch(self) -> bool:
        """Called by the engine as a training forward pass starts: whether it runs with
        gradients (False: forward only, this rank being slower than the fastest; see
        :mod:`ds_lowcomm.shard.pace`). No communication, no host sync."""
        return True if self.pacer is None else self.pacer.begin_micro_batch()

    def on_backward_start(self, boundary: bool) -> None:
        """Called by the engine before every backward pass (no communication)."""
        self.mode.on_backward_start(boundary)

    def on_micro_batch_end(self, boundary: bool, computed: bool = True, weight=1.0) -> None:
        """Called by the engine after every micro-batch's backward pass, or in its place for one
        run forward only (``computed`` False); ``weight``: 1, or its label tokens (a 0-d tensor)
        when the loop normalises the loss by ``num_items_in_batch``. No communication."""
        if self.pacer is not None:
            self.pacer.end_micro_batch()  # before the mode's switch and its waits
        self.grads.count(computed, weight)
        self.micro_batches += computed  # the backward passes: what was trained on
        self.mode.on_micro_batch_end(boundary)
        if self._trim_heap:
            release_freed_heap()

    @torch.no_grad()
    def step(self, closure=None):
        """At an accumulation boundary: the mode's communication and update. ``closure`` unsupported."""
        if closure is not None:
            raise ValueError("LowCommOptimizer.step does not take a closure")
        self.mode.step()
        if self._trim_heap:
            release_freed_heap()

    def step_taken(self) -> None:
        """Called by the mode when an optimizer step is taken: its gradient is final and its
        update committed, applied to the model now or, for a round in flight (acco, demo
        overlap), at the next switch. Counting steps here, not when the update lands, is what
        makes a loop's step count, DeepSpeed's ``global_steps``, the LR schedule and checkpoint
        tags agree."""
        self.steps += 1
        if self.on_step_taken is not None:
            self.on_step_taken()

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale the engine multiplies losses by (1.0 without fp16)."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.cur_scale)

    cur_scale = loss_scale  # the name DeepSpeed's engine reads (engine._get_optimizer_loss_scale)

    def record_step(self, step: int, grad_norm: float, skipped: bool, nonfinite_ranks: Sequence[int] = ()) -> None:
        """The verdict of optimizer step ``step`` (1-based), when its round's result is installed
        (training thread; for acco and demo overlap one step after it was taken).

        Sets what DeepSpeed and accelerate read (``overflow``, ``_global_grad_norm``: inf after a
        skip, as DeepSpeed's ZeRO sets it), updates the fp16 loss scale (DeepSpeed's scaler rule),
        rescales the gradients accumulated since to the new scale (a power of two: exact), and
        counts skips. Raises :class:`DivergedError` after ``max_consecutive_skips`` skips in a row
        that the loss scale could not answer. No communication.
        """
        self.overflow = skipped
        self._global_grad_norm = float("inf") if skipped else grad_norm
        scale_answered = False  # an fp16 overflow the dynamic loss scale reacts to
        scaler = self.loss_scaler
        if scaler is not None:
            before = (scaler.cur_scale, getattr(scaler, "cur_hysteresis", None))
            min_scale = getattr(scaler, "min_scale", None)
            scale_answered = skipped and getattr(scaler, "dynamic", False) and scaler.cur_scale > min_scale
            scaler.update_scale(skipped)
            if scaler.cur_scale != before[0]:
                self.grads.buffer.mul_(scaler.cur_scale / before[0])
        if not skipped:
            self.consecutive_skips = 0
            return
        self.skipped_steps += 1
        if not scale_answered:
            self.consecutive_skips += 1
        if nonfinite_ranks:
            source = f"norm {grad_norm}, from rank {', '.join(map(str, nonfinite_ranks))}"
        elif math.isfinite(grad_norm):  # demo: the verdict came with another replica's payload
            source = "from another replica"
        else:
            source = f"norm {grad_norm}"
        topo = self.topology
        if topo.shard.rank == 0:
            replica = f" on replica {topo.rank // topo.shard_group_size}" if topo.num_replicas > 1 else ""
            scale = f", loss scale now {self.loss_scale:g}" if scaler is not None else ""
            logger.warning(f"ds_lowcomm: step {step} skipped{replica}: non-finite gradient ({source}); "
                           f"weights and optimizer state unchanged{scale}")
        limit = self.config.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise DivergedError(
                f"ds_lowcomm: the run diverged: {self.consecutive_skips} consecutive steps up to step "
                f"{step} had a non-finite gradient (last: {source}); all were skipped, so the weights "
                f"and optimizer state are those before them (engine.save_checkpoint keeps them). "
                f"Lower the learning rate, check the data, or raise lowcomm.max_consecutive_skips "
                f"(now {limit})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Leaves the gradient sums alone: they live in the accumulator, which the mode clears when
        it takes a step. ``p.grad`` is the parameter's slice of it (sums in the parameters' dtype)
        or None, and
        ``set_to_none`` is ignored."""
        self.grads.attach()

    def flush(self) -> None:
        """Install any update still in flight (call before exporting the final model)."""
        self.mode.flush()

    def settle(self) -> None:
        """Every rank at the same step, no round running (collective; see :meth:`Mode.settle`)."""
        self.mode.settle()

    def destroy(self) -> None:
        """Stop the comm worker and remove the gradient hooks (``engine.destroy()`` calls it)."""
        if self.worker is not None:
            self.worker.close()
        self.grads.remove_hooks()

    def master_weights(self) -> torch.Tensor:
        """Full unpadded fp32 master weights (collective)."""
        return self.mode.master_weights()

    def comm_stats(self) -> dict:
        """Bytes and times since the start: per collective, per round, and averages per step.
        ``exposed_comm_s_per_step``: communication training waited for, on the host and (CUDA)
        on the device, the latter as far as its timing events have completed. No communication."""
        if self.worker is not None:
            self.worker.count_device_waits()
        out = self.stats.as_dict()
        steps = max(self.steps - self.steps_at_start, 1)  # the counters start with this process
        out.update(steps=self.steps, micro_batches=self.micro_batches, skipped_steps=self.skipped_steps,
                   loss_scale=self.loss_scale,
                   bytes_sent_per_step=out["bytes_sent"] / steps,
                   bytes_received_per_step=out["bytes_received"] / steps,
                   exposed_comm_s_per_step=out["exposed_comm_seconds"] / steps,
                   round_s_per_step=out["round_seconds"] / steps, **self.mode.metrics())
        if self.pacer is not None and self.pacer.active:
            out["computed_share_by_rank"] = self.pacer.computed_shares()
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def rank_state_dict(self) -> dict:
        """What this rank writes to its own file: its shards of the flat state (any world size
        reads them back), its mode's per-rank state (same layout only), and its loss scaler and
        skip counts (DES-LOC replicas skip on their own verdicts). No communication."""
        state = self.mode.state()
        return {"shards": state.sharded, "mode": state.rank,
                "guard": {"loss_scaler": self._loss_scaler_state(), "skipped_steps": self.skipped_steps,
                          "consecutive_skips": self.consecutive_skips}}

    def state_dict(self) -> dict:
        """The optimizer's metadata (DeepSpeed writes rank 0's into its model file): names,
        shapes, hyperparameters, counters and how the flat state is cut into the rank files.
        No communication; the state itself is in :meth:`rank_state_dict`."""
        return {"format": FORMAT, "mode": self.mode.name,
                "param_names": self.param_names,
                "param_shapes": [list(p.shape) for p in self.flat.params],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "steps": self.steps, "micro_batches": self.micro_batches,
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                "loss_scaler": self._loss_scaler_state(),
                "shards": shard_meta(self.flat.layout, self.topology),
                **self.mode.state().meta}

    _SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def _loss_scaler_state(self) -> Optional[dict]:
        if self.loss_scaler is None:
            return None
        return {k: getattr(self.loss_scaler, k) for k in self._SCALER_FIELDS if hasattr(self.loss_scaler, k)}

    def _load_loss_scaler_state(self, state: Optional[dict]) -> None:
        if self.loss_scaler is not None and state:
            for k, v in state.items():
                if hasattr(self.loss_scaler, k):
                    setattr(self.loss_scaler, k, v)

    def load_state_dict(self, state_dict: dict, load_optimizer_states: bool = True, **_) -> None:
        """Restore a :meth:`state_dict`, and the flat state it describes, written at any world size.

        The flat state is read from the checkpoint's rank files through ``checkpoint_shards`` (a
        :class:`~ds_lowcomm.checkpoint.ShardReader`), which :meth:`LowCommEngine.load_checkpoint`
        sets around DeepSpeed's call of this method. With ``load_optimizer_states=False`` only the
        fp32 master is taken (the moments and step restart). Raises
        :class:`~ds_lowcomm.checkpoint.CheckpointError` for a checkpoint of another model or mode.
        """
        shards = self.checkpoint_shards
        state_dict = upgrade_meta(state_dict)
        if shards is None:
            raise CheckpointError("ds_lowcomm's optimizer state lives in the checkpoint's rank files: "
                                  "load it with engine.load_checkpoint")
        # (the Checkpointer has checked the model, before DeepSpeed touched anything)
        if not load_optimizer_states:
            self.mode.restore(None, shards, None)
            return
        if state_dict["mode"] != self.mode.name:
            raise CheckpointError(f"checkpoint was written in mode {state_dict['mode']!r}, this run "
                                  f"uses {self.mode.name!r}; set lowcomm.mode to "
                                  f"{state_dict['mode']!r} or load with load_optimizer_states=False")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.steps = self.steps_at_start = state_dict["steps"]
        self.micro_batches = state_dict["micro_batches"]
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        self.consecutive_skips = state_dict.get("consecutive_skips", 0)
        self._load_loss_scaler_state(state_dict.get("loss_scaler"))
        # Saved with this layout: this rank's own file, read as it was written; else None.
        mine = shards.rank_file(self.topology.rank) if shards.same_layout(self.topology) else None
        guard = None if mine is None else mine.get("guard")
        if guard is not None:  # this rank's own verdicts (DES-LOC replicas skip on their own)
            self._load_loss_scaler_state(guard["loss_scaler"])
            self.skipped_steps = guard["skipped_steps"]
            self.consecutive_skips = guard["consecutive_skips"]
        # ``rank`` None means "saved at another layout", for every mode: a same-layout part the mode
        # left empty (None) still comes as {}.
        self.mode.restore(state_dict, shards, None if mine is None else (mine["mode"] or {}))
