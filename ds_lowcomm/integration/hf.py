"""Hugging Face Trainer: ds_lowcomm's numbers in the Trainer's logs.

The Trainer reaches ds_lowcomm through ``deepspeed.initialize`` (accelerate 1.15
``_prepare_deepspeed`` looks it up at call time), so training needs nothing from this module. What
the Trainer does not know is our metrics and our in-flight updates: when a
:class:`~ds_lowcomm.integration.engine.LowCommEngine` is built while ``transformers.trainer`` is loaded,
:func:`install_trainer_hooks` wraps three of its methods:

- ``Trainer.log``: every training log entry also carries :func:`trainer_metrics` (in
  ``state.log_history``, the console, TensorBoard, W&B, ... alike);
- ``Trainer.save_model``: the user's final save calls ``optimizer.flush()`` first, so the saved
  weights include the last update (collective: the Trainer calls it on every rank);
- ``Trainer._maybe_log_save_evaluate`` (once per optimizer step, on every rank): with
  ``lowcomm.save_on_preemption`` (the default), a SIGTERM or SIGUSR1 makes the Trainer save its
  ``checkpoint-N`` at the end of the step every rank has learnt of it by
  (:class:`~ds_lowcomm.integration.preemption.PreemptionGuard`), after which the process exits with
  128 + the signal's number; ``resume_from_checkpoint`` goes on from there;
  when training ends (``on_train_end``) the guard's last all-reduce is waited for and the signal
  handlers it replaced are back.

Trainers whose model is not a LowCommEngine are left untouched.
"""
from __future__ import annotations

import functools
import sys
import threading

PREFIX = "lowcomm/"


def trainer_metrics(engine) -> dict:
    """This rank's communication numbers since the start, as flat ``lowcomm/...`` floats (no
    communication: per-rank micro-batch counts travel inside acco's rounds)."""
    s = engine.comm_stats()
    out = {f"{PREFIX}bytes_sent_per_step": s["bytes_sent_per_step"],
           f"{PREFIX}bytes_received_per_step": s["bytes_received_per_step"],
           f"{PREFIX}exposed_comm_s_per_step": s["exposed_comm_s_per_step"],
           f"{PREFIX}round_s_per_step": s["round_s_per_step"],
           f"{PREFIX}skipped_steps": s["skipped_steps"]}
    if engine.fp16_enabled():
        out[f"{PREFIX}loss_scale"] = s["loss_scale"]
    for r, count in enumerate(s.get("micro_batches_per_round_by_rank", ())):
        out[f"{PREFIX}micro_batches_per_round/rank{r}"] = count
    for r, share in enumerate(s.get("computed_share_by_rank", ())):  # lowcomm.pace
        out[f"{PREFIX}computed_share/rank{r}"] = share
    return out


def _engine(trainer):
    from ds_lowcomm.integration.engine import LowCommEngine

    engine = getattr(trainer, "model_wrapped", None)
    return engine if isinstance(engine, LowCommEngine) else None


def install_trainer_hooks() -> None:
    """Wrap ``Trainer.log``, ``save_model`` and ``_maybe_log_save_evaluate`` once, if the
    Trainer is loaded (idempotent). Communication they add: the final ``save_model`` flushes the
    optimizer (:meth:`~ds_lowcomm.optimizer.LowCommOptimizer.flush`), and each step's end polls
    the preemption guard (:meth:`~ds_lowcomm.integration.preemption.PreemptionGuard.poll`)."""
    module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or getattr(trainer_cls.log, "ds_lowcomm_wrapped", False):
        return
    original_log, original_save = trainer_cls.log, trainer_cls.save_model
    original_step_end = trainer_cls._maybe_log_save_evaluate

    @functools.wraps(original_log)
    def log(self, logs, *args, **kwargs):
        engine = _engine(self)
        if engine is not None and "loss" in logs:  # training entries only
            logs.update(trainer_metrics(engine))
        return original_log(self, logs, *args, **kwargs)

    @functools.wraps(original_save)
    def save_model(self, output_dir=None, _internal_call=False, *args, **kwargs):
        engine = _engine(self)
        if engine is not None and not _internal_call:
            # The user's final export: install the update still in flight (acco, demo overlap).
            # Checkpoints (_internal_call) keep it pending in the optimizer state instead, so
            # saving never changes the training trajectory.
            engine.optimizer.flush()
        return original_save(self, output_dir, _internal_call, *args, **kwargs)

    @functools.wraps(original_step_end)
    def _maybe_log_save_evaluate(self, *args, **kwargs):
        engine = _engine(self)
        guard = getattr(self, "_ds_lowcomm_preemption", None)
        if (guard is None and engine is not None and engine.lowcomm_config.save_on_preemption
                and threading.current_thread() is threading.main_thread()):  # (signals reach the main thread only)
            from ds_lowcomm.integration.preemption import PreemptionGuard

            guard = self._ds_lowcomm_preemption = PreemptionGuard(engine.optimizer.topology.control.group)
            self.add_callback(_close_guard_at_train_end(self, guard))
        if guard is not None and guard.poll():
            self.control.should_save = True  # saved by the call below, as the Trainer's own checkpoint
            self.control.should_training_stop = True
        result = original_step_end(self, *args, **kwargs)
        if guard is not None and guard.agreed:
            _leave(self, engine, guard)
        return result

    log.ds_lowcomm_wrapped = save_model.ds_lowcomm_wrapped = _maybe_log_save_evaluate.ds_lowcomm_wrapped = True
    trainer_cls.log, trainer_cls.save_model = log, save_model
    trainer_cls._maybe_log_save_evaluate = _maybe_log_save_evaluate


def _close_guard_at_train_end(trainer, guard):
    """A callback that closes ``guard`` when training ends, and lets a later ``train`` call make
    its own: the ``train`` call that built the engine was already running when the hooks were
    installed, so the end of its loop is reached through the Trainer's callbacks. (A ``train``
    that raises never gets there: its guard keeps the handlers until the process ends.)"""
    from transformers import TrainerCallback

    class CloseGuard(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            guard.close()
            if trainer.__dict__.get("_ds_lowcomm_preemption") is guard:
                del trainer._ds_lowcomm_preemption

    return CloseGuard()


def _leave(trainer, engine, guard) -> None:
    """After the preemption checkpoint: one line, the engine and process groups torn down on every
    rank (no rank may die in a destructor while another still waits), exit 128 + the signal."""
    import os

    import torch.distributed as dist

    step = trainer.state.global_step
    where = os.path.join(trainer._get_output_dir(None), f"checkpoint-{step}")
    guard.close()
    if dist.get_rank() == 0:
        print(f"{guard.name}: stopped after step {step}; saved {where}; exit code {guard.exit_code} "
              f"(restart with resume_from_checkpoint)", file=sys.stderr, flush=True)
    engine.destroy()
    dist.destroy_process_group()
    raise SystemExit(guard.exit_code)
