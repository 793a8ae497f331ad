"""LowCommEngine: DeepSpeed's engine with ds_lowcomm's optimizer owning data-parallel communication.

DeepSpeed is built at ZeRO stage 0 (the user's JSON says 1; :mod:`ds_lowcomm.integration.initialize` rewrites
a copy) so it creates no ZeRO optimizer, and the engine's all-reduce is switched off. The overrides
below are the engine hooks that have been stable since DeepSpeed 0.10:
``_configure_optimizer``, ``clip_fp32_gradients``, ``enable_backward_allreduce``, ``backward``,
``zero_grad``, ``save_checkpoint``, ``load_checkpoint``, ``destroy``.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import logging
import sys
import weakref
from typing import Dict, List

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from ds_lowcomm.checkpoint import Checkpointer
from ds_lowcomm.config import (GRAD_ACCUM_DTYPES, LowCommConfig, LowCommConfigError,
                               check_adamw_hyperparameters)
from ds_lowcomm.optimizer import LowCommOptimizer
from ds_lowcomm.shard.pace import token_weight

logger = logging.getLogger("ds_lowcomm")

# comm_stats() entries written to DeepSpeed's monitor (TensorBoard / CSV / W&B) after each step.
MONITORED = ("bytes_sent_per_step", "bytes_received_per_step", "exposed_comm_s_per_step",
             "round_s_per_step", "micro_batches_per_round", "skipped_steps")
_DROPPED_JSON_PARAMS = ("torch_adam", "adam_w_mode", "fused", "foreach")
_ADAM_CLASSES = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "LowCommOptimizer")
#: engines not yet destroyed, by creation number, destroyed at the process's exit (:func:`_destroy_at_exit`)
_ALIVE: "weakref.WeakValueDictionary[int, LowCommEngine]" = weakref.WeakValueDictionary()
_CREATED = itertools.count()


@atexit.register
def _destroy_at_exit() -> None:
    """Destroy the engines the script left alive, oldest first (the same order on every rank),
    while the interpreter still runs: most scripts (the Trainer's, accelerate's) end without
    ``engine.destroy()``, and a comm thread still inside a collective when the interpreter
    finalizes aborts the process (SIGABRT, "terminate called without an active exception") after
    training succeeded. Atexit handlers run once the main thread is done on every rank, so the
    rounds still queued complete. After an uncaught exception nothing is destroyed, so none of
    its rounds is waited for: a peer may be gone, and they would hold this rank for up to
    ``collective_timeout_s``. (``sys.last_value`` is what tells: the interpreter's report of an
    uncaught exception sets it, and so do pytest for a failed test and interactive sessions.)"""
    if getattr(sys, "last_value", None) is not None:  # set by the interpreter's report of the exception
        return
    for _, engine in sorted(_ALIVE.items()):
        try:
            engine.destroy()
        except Exception as err:  # one engine's failure (a background save's) leaves the others to do
            logger.warning(f"ds_lowcomm: destroying an engine at exit failed: {type(err).__name__}: {err}")


def _comm_dtype(engine: DeepSpeedEngine, cfg: LowCommConfig) -> torch.dtype:
    name = cfg.comm_dtype
    if name == "auto":
        ds = engine._config._param_dict.get("communication_data_type")
        name = {"bfp16": "bf16"}.get(ds, ds) or ("bf16" if engine.bfloat16_enabled() else "fp32")
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _grad_accum_dtype(engine: DeepSpeedEngine) -> torch.dtype:
    """DeepSpeed's ``data_types.grad_accum_dtype``; by default the model's dtype, as in stock
    DeepSpeed (``engine.get_data_types``, 0.19.8)."""
    name = (engine._config._param_dict.get("data_types") or {}).get("grad_accum_dtype")
    if name is None:
        return torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[GRAD_ACCUM_DTYPES[name]]


def _loss_scaler(engine: DeepSpeedEngine):
    """fp16: DeepSpeed's own loss scaler, built from the ``fp16`` section as its ZeRO-1 builds it
    (``CreateLossScaler``, 0.19.8), except that an overflow at ``min_loss_scale`` does not raise:
    our guard skips the step and ``lowcomm.max_consecutive_skips`` decides when the run has
    diverged. None without fp16."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    if not engine.fp16_enabled():
        return None
    if engine.dynamic_loss_scale():
        return DynamicLossScaler(**engine.dynamic_loss_scale_args(), raise_error_at_min_scale=False,
                                 dtype=torch.float16)
    return LossScaler(scale=engine.loss_scale())


def _param_groups(engine: DeepSpeedEngine, client_optimizer, model_parameters) -> List[dict]:
    """AdamW param groups from a client optimizer (its own dicts) or the JSON ``"optimizer"``."""
    if client_optimizer is not None:
        opt = client_optimizer
        if not isinstance(opt, torch.optim.Optimizer):  # a callable building one
            opt = client_optimizer(model_parameters)
        if type(opt).__name__ not in _ADAM_CLASSES:
            raise LowCommConfigError(f"optimizer: the client optimizer is {type(opt).__name__}; "
                                     "ds_lowcomm runs AdamW on the shard, pass an AdamW or use the "
                                     "JSON \"optimizer\" section")
        for g in opt.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise LowCommConfigError("optimizer: amsgrad/maximize are not supported")
            if (type(opt).__name__ == "Adam" and g.get("weight_decay", 0) and not g.get("decoupled_weight_decay")):
                raise LowCommConfigError("optimizer: torch.optim.Adam with weight_decay is L2-coupled; "
                                         "use torch.optim.AdamW")
        groups = opt.param_groups  # the same dicts: the caller's LR scheduler keeps driving them
    else:
        params = dict(engine.optimizer_params() or {})
        hyper = {k: v for k, v in params.items() if k not in _DROPPED_JSON_PARAMS}
        # DeepSpeed's default Adam is FusedAdam (weight_decay 0); with torch_adam it is
        # torch.optim.AdamW (weight_decay 0.01). Keep the user's run what it would be in stock.
        hyper.setdefault("weight_decay", 0.01 if params.get("torch_adam") else 0.0)
        if "betas" in hyper:
            hyper["betas"] = tuple(hyper["betas"])
        model_parameters = list(model_parameters)
        if model_parameters and isinstance(model_parameters[0], dict):
            groups = [{**hyper, **g} for g in model_parameters]
        else:
            groups = [{**hyper, "params": model_parameters}]
    for i, g in enumerate(groups):
        # A client optimizer's groups may have been edited after torch checked them.
        where = f"the client optimizer's param_groups[{i}]" if client_optimizer is not None else "optimizer.params"
        check_adamw_hyperparameters(g, where)
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


class LowCommEngine(DeepSpeedEngine):
    """A :class:`DeepSpeedEngine` whose optimizer is a :class:`LowCommOptimizer`.

    Extra API: :meth:`comm_stats`, and ``engine.optimizer.flush()`` before exporting final weights.
    """

    #: the autoload hook's engine check lets this class, and no stock engine, take a "lowcomm" JSON
    accepts_lowcomm_config = True

    def __init__(self, *args, lowcomm_config: LowCommConfig, **kwargs) -> None:
        """DeepSpeedEngine's arguments, and the ``"lowcomm"`` section as
        :func:`~ds_lowcomm.integration.initialize.initialize` parsed it (the one parse)."""
        self.lowcomm_config = lowcomm_config
        #: (computed, weight) of the latest training forward pass, for its backward
        self._micro_batch = None
        self._loop_bound = False
        super().__init__(*args, **kwargs)
        self.enable_backward_allreduce = False
        self._created = next(_CREATED)
        _ALIVE[self._created] = self

    def _configure_optimizer(self, client_optimizer, model_parameters) -> None:
        cfg = self.lowcomm_config
        names: Dict[int, List[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        groups = _param_groups(self, client_optimizer, model_parameters)
        self.optimizer = self.basic_optimizer = LowCommOptimizer(
            groups, cfg, gradient_clipping=self.gradient_clipping(),
            comm_dtype=_comm_dtype(self, cfg), grad_accum_dtype=_grad_accum_dtype(self), param_names=names,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            loss_scaler=_loss_scaler(self), modules=list(self.module.modules()))
        self.optimizer.on_step_taken = self._after_lowcomm_step
        hf_config = getattr(self.module, "config", None)
        self.checkpointer = Checkpointer(self.optimizer, self.global_rank, self.device, async_save=cfg.async_save,
                                         timeout_s=cfg.collective_timeout_s,
                                         model_config=hf_config.to_json_string if hasattr(hf_config, "to_json_string") else None)
        # DeepSpeed's 1-bit Adam switch: no engine all-reduce after backward (engine.py
        # _backward_epilogue, 0.19.8); the optimizer reduces at the boundary itself.
        self.enable_backward_allreduce = False

    def zero_grad(self) -> None:
        """The optimizer's ``zero_grad``, which leaves the accumulated sums to the mode. DeepSpeed's
        (0.19.8; after every fp32 step at stage 0, and HF's Trainer calls it) sets each ``p.grad``
        to None, which would make the next backward allocate a fresh gradient per parameter."""
        if isinstance(getattr(self, "optimizer", None), LowCommOptimizer):
            self.optimizer.zero_grad()
        else:
            super().zero_grad()

    def clip_fp32_gradients(self) -> None:
        """No-op: local gradients are unreduced; the optimizer clips after the reduce-scatter."""

    def _drives_steps(self) -> bool:
        opt = getattr(self, "optimizer", None)
        # (before "mode": "automatic" has chosen: DeepSpeed's rule; the optimizer gives a mode that
        # drives steps, chosen at the end of the first micro-batch, that micro-batch's boundary by
        # this rule instead)
        return isinstance(opt, LowCommOptimizer) and opt.mode is not None and opt.mode.drives_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """DeepSpeed's boundary, except for modes that complete steps themselves (acco): those
        never present one, so ``engine.step()`` only counts micro-batches and the step's
        bookkeeping runs in :meth:`_after_lowcomm_step` when the mode takes a step."""
        if self._drives_steps():
            return False
        return super().is_gradient_accumulation_boundary()

    def get_global_grad_norm(self):
        """Norm of the latest reduced gradient whose round has finished (under acco and demo
        overlap, the step before the one just taken: its norm is known when its round lands)."""
        return self.optimizer._global_grad_norm

    def _after_lowcomm_step(self) -> None:
        """Called by the optimizer when a step is taken (:meth:`LowCommOptimizer.step_taken`)."""
        if self._drives_steps():
            # What DeepSpeed's _take_model_step does after optimizer.step() (engine.py, 0.19.8);
            # ``overflow`` is the verdict of the latest step whose round has landed.
            if self.optimizer.overflow:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        if self.monitor.enabled and self.global_rank == 0:
            s = self.optimizer.comm_stats()
            step = self.global_samples
            events = [(f"Train/lowcomm/{k}", float(s[k]), step) for k in MONITORED if k in s]
            events += [(f"Train/lowcomm/micro_batches_per_round/rank{r}", float(c), step)
                       for r, c in enumerate(s.get("micro_batches_per_round_by_rank", ()))]
            events += [(f"Train/lowcomm/computed_share/rank{r}", float(c), step)
                       for r, c in enumerate(s.get("computed_share_by_rank", ()))]
            self.monitor.write_events(events)

    def forward(self, *inputs, **kwargs):
        """DeepSpeed's ``forward``. A training micro-batch (module in training mode, gradients
        enabled) that this rank, slower than the fastest, leaves to the others runs under
        ``torch.no_grad`` (``lowcomm.pace``, :mod:`ds_lowcomm.shard.pace`): the loop still gets the
        model's real outputs, and its backward is skipped."""
        opt = getattr(self, "optimizer", None)
        paced = isinstance(opt, LowCommOptimizer) and (opt.mode is None or opt.pacer is not None and opt.pacer.active)
        if not (paced and self.module.training and torch.is_grad_enabled()):
            return super().forward(*inputs, **kwargs)
        computed = opt.begin_micro_batch()
        encoder_decoder = bool(getattr(getattr(self.module, "config", None), "is_encoder_decoder", False))
        weight = token_weight(kwargs, encoder_decoder)
        self._micro_batch = (computed, 1.0 if weight is None else weight)
        if computed:
            return super().forward(*inputs, **kwargs)
        with torch.no_grad():
            return super().forward(*inputs, **kwargs)

    def backward(self, loss, *args, **kwargs):
        """DeepSpeed's ``backward``; with fp16 the loss is multiplied by the loss scale first (at
        ZeRO stage 0 DeepSpeed 0.19.8 only scales for its own optimizers) and the returned loss
        is unscaled again. After a forward pass run forward only (see :meth:`forward`), no
        backward runs: the micro-batch is counted as handed out and not computed. Communication:
        the optimizer's :meth:`~ds_lowcomm.optimizer.LowCommOptimizer.on_micro_batch_end` (zero1
        ``overlap``'s gradient buckets and acco's rounds launch here; "automatic" probes the
        links after the first backward)."""
        computed, weight = self._micro_batch or (True, 1.0)
        self._micro_batch = None
        if not self._loop_bound:
            # The Trainer and accelerate set the boundary before every backward pass.
            self.optimizer.bind_loop(marks_boundaries=self._is_gradient_accumulation_boundary is not None)
            self._loop_bound = True
        if self._drives_steps():
            # Only a boundary the loop set itself (accelerate and the Trainer, through
            # set_gradient_accumulation_boundary, before every backward): DeepSpeed's own count
            # (micro_steps, not restored by load_checkpoint in 0.19.8) says nothing about acco's.
            boundary = self._is_gradient_accumulation_boundary is True
        else:
            boundary = self.is_gradient_accumulation_boundary()  # micro_steps moves in step()
        self.optimizer.on_backward_start(boundary)
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if not computed:  # what DeepSpeed's backward returns, without the pass
            scale_wrt_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
            out = (loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss).detach()
        elif scaler is not None:
            scale = self.optimizer.loss_scale
            out = super().backward(scaler.scale_loss(loss), *args, **kwargs) / scale
        else:
            out = super().backward(loss, *args, **kwargs)
        self.optimizer.on_micro_batch_end(boundary, computed, weight)
        return out

    def comm_stats(self) -> dict:
        """Bytes sent/received per collective and per step, rounds, time in flight and waited."""
        return self.optimizer.comm_stats()

    def destroy(self) -> None:
        """Wait for a background checkpoint save (``async_save``) to be published, then
        DeepSpeed's ``destroy``, which destroys the optimizer (its comm worker and process groups).
        Idempotent; the process's exit calls it for an engine still alive then."""
        _ALIVE.pop(getattr(self, "_created", None), None)
        try:
            checkpointer = getattr(self, "checkpointer", None)
            if checkpointer is not None:
                checkpointer.close()
        finally:
            super().destroy()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        """DeepSpeed's ``save_checkpoint`` (collective; its model file gets the weights and our
        optimizer's metadata), plus one file per rank with what that rank owns, a manifest, and
        ``latest`` written last (:class:`~ds_lowcomm.checkpoint.Checkpointer`): a save killed at
        any point leaves the previous checkpoint the one that resumes. Communication besides
        DeepSpeed's: the optimizer's ``settle`` first (acco: an all-reduce of W launch counts, and a
        round for a rank one behind), a barrier and each rank's file record; no optimizer state
        is gathered. With
        ``lowcomm.async_save`` it returns once this rank's state is copied, and the rest (this
        rank's file, the manifest, ``latest``) happens on a background thread."""
        self.optimizer.require_mode("save a checkpoint")  # before DeepSpeed writes anything
        # First, so every rank tags the same step: under acco a rank may be one launch behind.
        self.optimizer.settle()
        tag = str(f"global_step{self.global_steps}" if tag is None else tag)
        deepspeed_save = functools.partial(self._deepspeed_save, save_dir, client_state=client_state, **kwargs)
        return self.checkpointer.save(save_dir, tag, save_latest, deepspeed_save)

    def _deepspeed_save(self, save_dir, tag, client_state, **kwargs):
        """DeepSpeed's ``save_checkpoint`` of ``tag`` (its ``latest`` off), returning ``(its
        result, this rank's write error or None)``: a write its checkpoint engine fails (a full
        disk, a permission) is caught and the rest of the save writes nothing, so this rank still
        reaches DeepSpeed's barriers and the ranks can agree on the failure (DeepSpeed 0.19.8
        raises on the failing rank alone, leaving the others in its barrier until the timeout)."""
        engine, failure = self.checkpoint_engine, []
        own = {name: vars(engine)[name] for name in ("makedirs", "save") if name in vars(engine)}

        def guarded(name):
            write = getattr(engine, name)

            def call(*args, **kw):
                if failure:
                    return None
                try:
                    return write(*args, **kw)
                except Exception as err:  # noqa: BLE001  (reported on every rank by the Checkpointer)
                    # (state_dict, path) and (path, exist_ok): DeepSpeed passes either way
                    path = kw.get("path", args[-1] if name == "save" and args else args[0] if args else "?")
                    failure.append(f"rank {self.global_rank} could not write {str(path)!r}: "
                                   f"{type(err).__name__}: {err}")
            return call

        for name in ("makedirs", "save"):
            setattr(engine, name, guarded(name))
        try:
            out = super().save_checkpoint(save_dir, tag, client_state=client_state, save_latest=False, **kwargs)
        finally:
            for name in ("makedirs", "save"):
                if name in own:
                    setattr(engine, name, own[name])
                else:
                    delattr(engine, name)
        return out, (failure[0] if failure else None)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        **kwargs):
        """DeepSpeed's ``load_checkpoint``, after checking the files this rank reads against the
        manifest and reading them with ``weights_only=True`` (DeepSpeed's own model file too,
        before DeepSpeed unpickles it). A missing, foreign, changed, truncated or unsafe
        checkpoint raises :class:`~ds_lowcomm.checkpoint.CheckpointError` naming the file, on
        every rank (stock DeepSpeed only warns and returns ``(None, None)`` when ``latest`` is
        missing). Communication besides DeepSpeed's: the optimizer's ``settle``, a few bytes per
        rank for each verdict on the files
        (:meth:`~ds_lowcomm.checkpoint.Checkpointer.load`), and under "automatic" the saved
        choice's process groups; no optimizer state crosses ranks."""
        load_states = load_optimizer_states and not kwargs.get("load_module_only")
        # No round may write the parameters after DeepSpeed loads them (zero1.overlap's all-gather).
        self.optimizer.settle()
        deepspeed_load = functools.partial(super().load_checkpoint, load_dir, load_module_strict=load_module_strict,
                                           load_optimizer_states=load_optimizer_states, **kwargs)
        return self.checkpointer.load(load_dir, tag, load_states, deepspeed_load)
