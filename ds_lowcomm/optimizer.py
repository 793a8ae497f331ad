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

import dataclasses
import logging
import math
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint import FORMAT, CheckpointError, shard_meta
from ds_lowcomm.checkpoint.migrate import upgrade_meta
from ds_lowcomm.comm.collectives import CommStats
from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.auto import Choice, Measured, agree, choose, describe, desloc_delay, predict_sync_s, ranks_per_node
from ds_lowcomm.config import AUTO, LowCommConfig, LowCommConfigError
from ds_lowcomm.memory import release_freed_heap
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.shard.flat import FlatParams, GradAccumulator
from ds_lowcomm.modes import MODES, Mode
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
        self.modules = tuple(modules)
        self.stats = CommStats()
        self.checkpoint_stats = CommStats()
        # "mode": "automatic" starts on the whole world's layout (zero1's) and chooses at the end of the
        # first micro-batch (_choose): a smaller shard group then takes a prefix of the same buffers
        auto = config.mode == AUTO
        self.topology = Topology.build(None if auto else config.shard_group_size, config.collective_timeout_s,
                                       self.stats)
        self.checkpoint_comm = self.topology.shard.counted_in(self.checkpoint_stats)
        self.flat = FlatParams(self.param_groups, self.topology.shard.world, self.topology.shard.rank)
        self.param_names = [param_names.get(id(p), [f"param{i}"]) for i, p in enumerate(self.flat.params)]
        self.grads = GradAccumulator(self.flat, grad_accum_dtype)
        # On CPU the per-parameter gradients freed after each backward (fp32 sums of a bf16/fp16
        # model) would stay resident (see release_freed_heap). In-place ones are never freed.
        self._trim_heap = self.flat.device.type == "cpu" and not self.grads.in_place
        self.micro_batches = 0
        self.steps = 0
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
        #: set by LowCommEngine.load_checkpoint while DeepSpeed loads: where the flat state is read
        self.checkpoint_shards = None
        #: what "mode": "automatic" chose (None: a fixed mode, or not chosen yet) and the timings it reads
        self.choice: Optional[Choice] = None
        self.measured: Optional[Measured] = None
        self._first_forward: Optional[float] = None  # host clock as the first micro-batch started
        self._first_backward: Optional[float] = None
        self._marks_boundaries: Optional[bool] = None
        self._recheck_from: Optional[tuple] = None  # (clock, steps, exposed comm seconds)
        self.mode: Optional[Mode] = None
        self.worker: Optional[CommWorker] = None
        # lowcomm.pace: by default the fastest rank sets the pace where the mode's rounds can
        # carry the paces ("slowest", or a mode that cannot: every micro-batch computed).
        self.pacer: Optional[Pacer] = None
        #: installed rounds whose verdicts have not reached the host yet, oldest first
        self._unread: Deque[StepRound] = deque()
        if not auto:
            self._start_mode()

    def _start_mode(self) -> None:
        """Build the comm worker, the pacer and the mode of ``self.config`` (a concrete mode) on
        the topology and buffers already here. No communication."""
        config = self.config
        mode_cls = MODES[config.mode]
        # On CUDA with NCCL its rounds are issued from the training thread onto a side stream (one
        # issuing thread per device); where collectives block (gloo), on a thread of their own.
        inline = self.flat.device.type == "cuda" and not self.topology.blocking_collectives
        self.worker = (CommWorker(self.stats, self.flat.device, inline=inline)
                       if mode_cls.is_asynchronous(config.mode_options) else None)
        if mode_cls.paces and config.pace != "slowest":
            self.pacer = Pacer(mode_cls.pace_block(config.mode_options, self.gradient_accumulation_steps),
                               self.topology.shard.rank, device=self.flat.device,
                               host_wait_seconds=lambda: self.stats.host_wait_seconds)
        self.mode = mode_cls(ModeContext(
            flat=self.flat, grads=self.grads, topology=self.topology, worker=self.worker, stats=self.stats,
            param_groups=self.param_groups, comm_dtype=self.comm_dtype, gradient_clipping=self.gradient_clipping,
            gradient_accumulation_steps=self.gradient_accumulation_steps, checkpoint_comm=self.checkpoint_comm,
            _loss_scale=lambda: self.loss_scale, _steps=lambda: self.steps, step_taken=self.step_taken,
            record_step=self.record_step, land_verdict=self.land_verdict, modules=self.modules,
            pacer=self.pacer), config.mode_options)
        if self._marks_boundaries is not None:  # the loop was bound while "automatic" was choosing
            self.bind_loop(self._marks_boundaries)

    @property
    def mode_name(self) -> str:
        """The running mode's name; ``"automatic"`` until "mode": "automatic" has chosen."""
        return AUTO if self.mode is None else self.mode.name

    # -- "mode": "automatic" ---------------------------------------------------------------------------

    def _clock(self) -> float:
        """Host seconds, the device's queued work done first (only while "automatic" times the first
        micro-batch: once per run)."""
        if self.flat.device.type == "cuda":
            torch.cuda.synchronize(self.flat.device)
        return time.perf_counter()

    def _choose(self) -> None:
        """"mode": "automatic" at the end of the first micro-batch: time it, probe the links, choose
        (:func:`ds_lowcomm.auto.choose`), set up the chosen mode's layout and start it; one log
        line says what and why. Collective (every rank, the same verdict): a few small agreements
        on the control group and the probe all-reduces (:func:`~ds_lowcomm.auto.predict_sync_s`)."""
        now = self._clock()
        if self._first_forward is not None:
            step_s = (now - self._first_forward) * self.gradient_accumulation_steps
        else:  # the loop ran its forward pass outside engine.forward: backward ~ 2/3 of a micro-batch
            step_s = 1.5 * (now - (self._first_backward or now)) * self.gradient_accumulation_steps
        topo, control = self.topology, self.topology.control.group
        world, rank = topo.world_size, topo.rank
        per_rank = agree([step_s if r == rank else 0.0 for r in range(world)], control)
        local = ranks_per_node(world, control)

        def probe(topology: Topology) -> float:  # the mean over the ranks of their predictions
            mine = predict_sync_s(topology.shard.group, self.flat.layout.numel, self.flat.device, control)
            return agree([mine], control)[0] / world

        free = None
        if self.flat.device.type == "cuda":  # the least free on any rank
            # free on the device plus what torch's caching allocator holds unused
            mine = torch.cuda.mem_get_info(self.flat.device)[0] + torch.cuda.memory_reserved(self.flat.device) \
                - torch.cuda.memory_allocated(self.flat.device)
            free = min(agree([mine if r == rank else math.inf for r in range(world)], control, op=dist.ReduceOp.MIN))
        measured = Measured(world, local, per_rank, probe(topo) if world > 1 else 0.0,
                            shard_group_size=self.config.shard_group_size, numel=self.flat.layout.numel,
                            free_bytes=free, muon=self.config.options_by_mode["desloc"].inner_optimizer == "muon",
                            state_bytes=self._state_bytes)
        node_topology = None
        if measured.needs_node_probe():
            node_topology = Topology.build(local, self.config.collective_timeout_s, self.stats, control=topo.control)
            measured = dataclasses.replace(measured, node_sync_s=probe(node_topology))
        self.measured = measured
        choice, config, refused = self._pick(measured)
        self._start_chosen(choice, config, node_topology)
        if rank == 0:
            skipped = f" ({'; '.join(refused)})" if refused else ""
            logger.warning(f"ds_lowcomm: mode automatic chose {describe(choice)}: {choice.reason}{skipped}; set "
                           f"lowcomm.mode to override")

    def _start_chosen(self, choice: Choice, config: LowCommConfig, node_topology: Optional[Topology] = None) -> None:
        """Cut the buffers for the chosen layout and start the chosen mode. Collective when the
        shard group size changes (new process groups; ``node_topology``: one already built)."""
        topo = self.topology
        size = topo.world_size if choice.shard_group_size is None else choice.shard_group_size
        if size != topo.shard_group_size:
            self.topology = (node_topology if node_topology is not None and node_topology.shard_group_size == size
                             else Topology.build(size, self.config.collective_timeout_s, self.stats, control=topo.control))
            topo.close()
            self.flat.reshard(self.topology.shard.world, self.topology.shard.rank)
            self.grads.follow_layout()
            self.checkpoint_comm = self.topology.shard.counted_in(self.checkpoint_stats)
        if node_topology is not None and node_topology is not self.topology:
            node_topology.close()
        self.choice, self.config = choice, config
        self._start_mode()
        self._recheck_from = (time.perf_counter(), self.steps, self.stats.exposed_comm_seconds)

    def adopt(self, saved: dict) -> None:
        """"mode": "automatic" loading a checkpoint before it has chosen: take the mode, picks and
        layout the checkpoint was written with (what "automatic" chose then, or a fixed mode's, with
        this config's options for it), so that its state carries over; a shard group size that
        does not divide this world becomes their greatest common divisor. ``saved``: the model
        file's optimizer metadata. Collective when the layout changes (new process groups)."""
        world = self.topology.world_size
        chosen = saved.get(AUTO)
        if chosen is not None:
            choice = Choice(chosen["mode"], chosen["shard_group_size"], dict(chosen["options"]),
                            "as the checkpoint was written")
        elif saved["mode"] in ("zero1", "acco"):  # sharded over the whole world
            choice = Choice(saved["mode"], None, {}, "the mode the checkpoint was written in")
        else:  # demo, desloc: the layout is recorded (their first-format checkpoints are refused before)
            layout = saved["shards"]
            size = layout["shard_group_size"]
            choice = Choice(saved["mode"], None if size == layout["world_size"] else size, {},
                            "the mode the checkpoint was written in")
        if choice.shard_group_size is not None and world % choice.shard_group_size:
            choice = dataclasses.replace(choice, shard_group_size=math.gcd(choice.shard_group_size, world))
        # the recorded picks as they ran (a streaming delay too: it is not fitted again), under
        # this config's own keys; the options reported are the ones that run
        config = self._config_for(choice)
        choice = dataclasses.replace(choice, options={k: getattr(config.mode_options, k) for k in choice.options})
        error = self.config.check_mode(choice.mode, config.mode_options, choice.shard_group_size or world)
        if error is not None:
            raise CheckpointError(f"this checkpoint was written in mode {choice.mode!r}, which \"mode\": \"automatic\" "
                                  f"resumes in, but it cannot run here: {error}")
        self._start_chosen(choice, config)
        if self.topology.rank == 0:
            logger.warning(f"ds_lowcomm: mode automatic resumes in {describe(choice)}, {choice.reason} (its state "
                           f"carries over; automatic chooses only at a fresh start)")

    def _state_bytes(self, mode: str, shard_group_size: int, streamed: bool) -> float:
        """``mode``'s optimizer state per parameter on a rank, with the user's options for it (and
        desloc's syncs streamed as :meth:`_pick` would stream them). No communication."""
        options = self.config.options_by_mode[mode]
        return MODES[mode].state_bytes(self._streaming(options, streamed) if mode == "desloc" else options,
                                       shard_group_size)

    def _streaming(self, options, streamed: bool):
        """desloc's ``options`` with "automatic"'s streaming delay: where ``streamed``, behind a
        quarter of the period that runs (:func:`~ds_lowcomm.auto.desloc_delay`: the user's own Kx
        may be shorter; their compressed moment syncs cannot stream), else none; the user's own
        ``param_sync_delay`` wins. Used for a fresh choice only: a resume runs what was recorded."""
        if "param_sync_delay" in self.config.given_by_mode["desloc"]:
            return options
        delay = desloc_delay(options.param_sync_every, options.moment_sync_topk) if streamed else 0
        return dataclasses.replace(options, param_sync_delay=delay)

    def _pick(self, measured: Measured):
        """(choice, its concrete config, the candidates refused and why): :func:`choose` over the
        modes whose ``check_config`` accepts the settings it picks for them."""
        usable, refused = list(MODES), []
        while True:
            choice = choose(measured, usable)
            config = self._config_for(choice)
            if choice.mode == "desloc":
                streamed = "param_sync_delay" in choice.options
                config = dataclasses.replace(config, mode_options=self._streaming(config.mode_options, streamed))
            # what runs: auto's picks as the user's own keys left them
            choice = dataclasses.replace(choice, options={k: getattr(config.mode_options, k) for k in choice.options})
            error = self.config.check_mode(choice.mode, config.mode_options,
                                           choice.shard_group_size or self.topology.world_size)
            if error is None and self._marks_boundaries is not None:
                try:
                    MODES[choice.mode].check_loop(config.mode_options, self._marks_boundaries)
                except LowCommConfigError as err:
                    error = str(err)
            if error is None or choice.mode == "zero1":
                return choice, config, refused
            usable.remove(choice.mode)
            refused.append(f"{choice.mode} refused: {error}")

    def _config_for(self, choice: Choice) -> LowCommConfig:
        """The config of the chosen mode: auto's picks under the user's own keys in its sub-object."""
        mine = self.config.options_by_mode[choice.mode]
        given = self.config.given_by_mode[choice.mode]
        options = dataclasses.replace(mine, **{k: v for k, v in choice.options.items() if k not in given})
        return dataclasses.replace(self.config, mode=choice.mode, mode_options=options,
                                   shard_group_size=choice.shard_group_size)

    def _recheck(self) -> None:
        """Every ``automatic.recheck_every`` steps after the choice: the table again with the compute
        per step measured since (wall time less exposed communication, this rank's), the links as
        probed; a different verdict is logged on rank 0. No communication."""
        start, steps, exposed = self._recheck_from
        now = time.perf_counter()
        taken = self.steps - steps
        self._recheck_from = (now, self.steps, self.stats.exposed_comm_seconds)
        if taken <= 0 or self.topology.rank != 0:
            return
        compute = max(now - start - (self.stats.exposed_comm_seconds - exposed), 1e-9) / taken
        base = self.measured
        scale = compute / base.compute_s  # every rank's first-step time, rescaled to this rank's now
        measured = dataclasses.replace(base, step_s=[s * scale for s in base.step_s])
        try:
            choice, _, _ = self._pick(measured)
        except LowCommConfigError as err:  # only rank 0 re-checks: it must not stop the run alone
            logger.warning(f"ds_lowcomm: mode automatic: the re-check at step {self.steps} found no mode ({err}); "
                           f"re-checks are off for the rest of the run")
            self.measured = None
            return
        if (choice.mode, choice.shard_group_size) != (self.choice.mode, self.choice.shard_group_size):
            logger.warning(f"ds_lowcomm: mode automatic: at step {self.steps} a step computes in {compute:.3g} s, "
                           f"not the {base.compute_s:.3g} s of the first micro-batch; it would now choose "
                           f"{describe(choice)} ({choice.reason}). The running {describe(self.choice)} "
                           f"keeps going (its optimizer state does not carry over); set lowcomm.mode to "
                           f"{choice.mode!r} for the next start")

    # -- training -------------------------------------------------------------------------------

    def bind_loop(self, marks_boundaries: bool) -> None:
        """Called by the engine before the first backward pass: whether the loop marks its own
        accumulation boundaries (see :meth:`Mode.bind_loop`). No communication."""
        if self.mode is None:  # "automatic": kept for the mode it chooses
            self._marks_boundaries = marks_boundaries
            return
        self.mode.bind_loop(marks_boundaries)
        if self.pacer is not None:
            # By default only where the loop hands every rank the same micro-batches per step it
            # counts (the Trainer, accelerate, TRL); elsewhere "pace": "fastest" asks for it.
            self.pacer.active = self.mode.paces_in_loop() and (self.config.pace == "fastest" or marks_boundaries)

    def begin_micro_batch(self) -> bool:
        """Called by the engine as a training forward pass starts: whether it runs with
        gradients (False: forward only, this rank being slower than the fastest; see
        :mod:`ds_lowcomm.shard.pace`). No communication, no host sync (but while "mode": "automatic"
        times the first micro-batch)."""
        if self.mode is None:
            if self._first_forward is None:
                self._first_forward = self._clock()
            return True
        return True if self.pacer is None else self.pacer.begin_micro_batch()

    def on_backward_start(self, boundary: bool) -> None:
        """Called by the engine before every backward pass (no communication)."""
        if self.mode is None:
            if self._first_backward is None:
                self._first_backward = time.perf_counter()
            return
        self.mode.on_backward_start(boundary)

    def on_micro_batch_end(self, boundary: bool, computed: bool = True, weight=1.0) -> None:
        """Called by the engine after every micro-batch's backward pass, or in its place for one
        run forward only (``computed`` False); ``weight``: 1, or its label tokens (a 0-d tensor)
        when the loop normalises the loss by ``num_items_in_batch``. Communication: the mode's
        (:meth:`Mode.on_micro_batch_end`: at a boundary zero1 ``overlap`` launches its last
        gradient buckets' reduce-scatters; acco, at each switch (its quota of micro-batches since the
        last, or a step the loop cut short), installs one round and launches the next), and
        at the end of the first micro-batch under "mode": "automatic" the probes that choose the
        mode (:mod:`ds_lowcomm.auto`)."""
        if self.mode is None:
            self._choose()
            if self.mode.drives_steps and not self._marks_boundaries:
                boundary = False  # the engine's rule for such a mode: only a loop's own mark counts
            # this micro-batch began before the mode and its pacer existed (zero1 overlap arms its
            # buckets here: with none launched during the backward, finishing launches them all)
            self.mode.on_backward_start(boundary)
            if self.pacer is not None:
                self.pacer.begin_micro_batch()
        if self.pacer is not None:
            self.pacer.end_micro_batch()  # before the mode's switch and its waits
        self.read_verdicts()
        self.grads.count(computed, weight)
        self.micro_batches += computed  # the backward passes: what was trained on
        self.mode.on_micro_batch_end(boundary)
        if self._trim_heap:
            release_freed_heap()

    @torch.no_grad()
    def step(self, closure=None):
        """At an accumulation boundary: the mode's communication and update (:meth:`Mode.step`;
        its bytes per step: each mode's module docstring and docs/modes/). ``closure``
        unsupported."""
        if closure is not None:
            raise ValueError("LowCommOptimizer.step does not take a closure")
        if self.mode is None:
            raise RuntimeError("ds_lowcomm: optimizer.step() before any backward pass; with \"mode\": \"automatic\" "
                               "the mode is chosen during the first one (call engine.backward(loss) first)")
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
        auto = (self.config.options_by_mode or {}).get(AUTO)
        if self.measured is not None and auto.recheck_every and \
                self.steps - self._recheck_from[1] >= auto.recheck_every:
            self._recheck()
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
        """Install any update still in flight (call before exporting the final model); collective,
        its cost the mode's :meth:`Mode.flush`. Every installed round's verdict is then read."""
        if self.mode is not None:
            self.mode.flush()
        self.read_verdicts(wait=True)

    def settle(self) -> None:
        """Every rank at the same step, no round running (collective; see :meth:`Mode.settle`),
        and every installed round's verdict read (a host wait for those still on the device)."""
        if self.mode is not None:
            self.mode.settle()
        self.read_verdicts(wait=True)

    def land_verdict(self, rnd: StepRound) -> None:
        """Called when ``rnd``'s result is installed: its verdict is recorded (:meth:`record_step`)
        now if it has reached the host (always on the CPU), else at a later micro-batch, or
        :meth:`settle`, in order. Never waits for the device. No communication."""
        self._unread.append(rnd)
        self.read_verdicts()

    def read_verdicts(self, wait: bool = False) -> None:
        """Record the verdicts of installed rounds, oldest first: those whose copy has reached the
        host, or with ``wait`` all of them (on a GPU, a host wait for each still on its way:
        counted in ``verdict_waits``). No communication."""
        while self._unread and (wait or self._unread[0].verdict_ready()):
            rnd = self._unread.popleft()
            waits = not rnd.verdict_ready()
            rnd.read_verdict(wait=waits)
            self.stats.verdict_waits += waits
            if rnd.records_step:
                self.record_step(rnd.step_number, rnd.grad_norm, rnd.skipped, rnd.nonfinite_ranks)
            if rnd.on_verdict is not None:
                rnd.on_verdict(rnd)

    def destroy(self) -> None:
        """Stop the comm worker (rounds already queued run first), remove the gradient hooks and
        destroy this optimizer's process groups (``engine.destroy()`` calls it, and so does the
        process's exit for an engine still alive then). Idempotent. No communication of its own:
        the last rounds' collectives, which every rank started, complete."""
        if self.worker is not None:
            self.worker.close()
        self._unread.clear()
        self.grads.remove_hooks()
        if self.flat.device.type == "cuda":
            # Collectives the training stream issued (synchronous rounds) finish before their
            # NCCL communicators are shut down.
            torch.cuda.current_stream(self.flat.device).synchronize()
        self.topology.close(control=True)

    def master_weights(self) -> torch.Tensor:
        """Full unpadded fp32 master weights: an all-gather over the shard group, (S−1)/S · P · 4
        bytes sent per rank (before "automatic" has chosen: the parameters, no communication)."""
        if self.mode is None:
            return self.flat.unpadded(self.flat.buffer).float().clone()
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
                   round_s_per_step=out["round_seconds"] / steps,
                   **(self.mode.metrics() if self.mode is not None else {}))
        if self.choice is not None:
            out[AUTO] = self.choice.as_dict()
        if self.pacer is not None and self.pacer.active:
            out["computed_share_by_rank"] = self.pacer.computed_shares()
        return out

    def require_mode(self, what: str) -> None:
        """Raise (before anything is written) when "mode": "automatic" has not chosen yet."""
        if self.mode is None:
            raise RuntimeError(f"ds_lowcomm: cannot {what} before the first training micro-batch: \"mode\": "
                               f"\"automatic\" chooses the mode then (train one step first, or set lowcomm.mode)")

    # -- checkpoints ----------------------------------------------------------------------------

    def rank_state_dict(self) -> dict:
        """What this rank writes to its own file: its shards of the flat state (any world size
        reads them back), its mode's per-rank state (same layout only), and its loss scaler and
        skip counts (DES-LOC replicas skip on their own verdicts). No communication."""
        self.require_mode("save a checkpoint")
        state = self.mode.state()
        return {"shards": state.sharded, "mode": state.rank,
                "guard": {"loss_scaler": self._loss_scaler_state(), "skipped_steps": self.skipped_steps,
                          "consecutive_skips": self.consecutive_skips}}

    def state_dict(self) -> dict:
        """The optimizer's metadata (DeepSpeed writes rank 0's into its model file): names,
        shapes, hyperparameters, counters and how the flat state is cut into the rank files.
        No communication; the state itself is in :meth:`rank_state_dict`. ``"automatic"``: what
        "mode": "automatic" chose, which a run of "automatic" resumes with."""
        self.require_mode("save a checkpoint")
        auto = {} if self.choice is None else {AUTO: self.choice.as_dict()}
        return {"format": FORMAT, "mode": self.mode.name, **auto,
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

    def check_saved(self, saved: dict) -> None:
        """Raise :class:`~ds_lowcomm.checkpoint.CheckpointError` where this run cannot continue the
        optimizer state of the checkpoint whose metadata is ``saved`` (another mode, or what the
        mode's :meth:`~ds_lowcomm.modes.base.Mode.check_saved` refuses). No communication."""
        if saved["mode"] != self.mode.name:
            raise CheckpointError(f"checkpoint was written in mode {saved['mode']!r}, this run "
                                  f"uses {self.mode.name!r}; set lowcomm.mode to "
                                  f"{saved['mode']!r} or load with load_optimizer_states=False")
        self.mode.check_saved(saved)

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
            if self.mode is not None:  # else "automatic" starts its chosen mode from the loaded weights
                self.mode.restore(None, shards, None)
            return
        self.check_saved(state_dict)
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
