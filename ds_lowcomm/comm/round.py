"""A Round: the unit of communication of every mode.

A round moves through three calls, on two threads::

    pack()     training thread, at a gradient-accumulation boundary: take what the round sends
               (hand over a buffer, or copy it when accumulation must go on on top of it) and the
               hyperparameters in force now
    run()      the comm worker's thread (or the training thread, for a synchronous mode): the
               collectives and the sharded optimizer step; writes the next parameters where
               install() will find them
    install()  training thread, at a later boundary (or at once for a synchronous mode): make the
               round's result the model's parameters

``zero1`` runs the three back to back (``ds_lowcomm.shard.step.step_now``); ``acco`` overlaps
``run()`` with the next micro-batches.
"""
from __future__ import annotations

import abc
from typing import Callable, List, Optional

import torch


class Round(abc.ABC):
    """One round of communication. Subclasses define what is sent and how the result is used."""

    @abc.abstractmethod
    def pack(self) -> None:
        """Training thread: capture the inputs. Must not communicate."""

    @abc.abstractmethod
    def run(self) -> None:
        """Issue the collectives and compute the result (on the comm worker's thread when the mode
        is asynchronous)."""

    @abc.abstractmethod
    def install(self) -> None:
        """Training thread: apply the result to the model. Must not communicate."""


class StepRound(Round):
    """A round that carries an optimizer step, and so a verdict on its gradient.

    ``grad_norm`` is the norm of the reduced gradient; ``skipped`` says it was non-finite and the
    update was not applied; ``nonfinite_ranks`` names, when known, the global ranks whose own
    gradient sums were non-finite. ``loss_scale`` and ``step_number`` are captured at pack time.

    The verdict is computed on the device. ``run()`` ends with :meth:`stage`, which copies it to
    host memory without making the host wait (pinned memory and an event on CUDA); the host reads
    it with :meth:`read_verdict` once :meth:`verdict_ready` says the copy has landed, so a round
    in flight never stalls the training thread or the comm worker. ``records_step``: the verdict
    is a step's (an acco estimate round's is not: only its counts are read); ``on_verdict(round)``,
    when set, runs when the read verdict of the installed round reaches the optimizer (a mode's
    pacing reads the counts there).
    """

    records_step = True

    def __init__(self) -> None:
        self.grad_norm: float = float("nan")
        self.skipped = False
        self.nonfinite_ranks: List[int] = []
        self.loss_scale = 1.0
        self.step_number = 0
        #: when set, the round's result is this change to the parameters the model held when the
        #: round was launched (installed by adding it), not the parameters themselves
        self.delta: Optional[torch.Tensor] = None
        self.on_verdict: Optional[Callable[["StepRound"], None]] = None
        self._staged: Optional[torch.Tensor] = None
        self._staged_event = None

    def stage(self, verdict: torch.Tensor) -> None:
        """End of ``run()``: start copying ``verdict`` (a 1-D device tensor) to the host. On CUDA
        into pinned memory on the current stream, then an event: the host never waits here. On
        the CPU the tensor is its own host copy."""
        if verdict.device.type == "cuda":
            host = torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True)
            host.copy_(verdict, non_blocking=True)
            self._staged_event = torch.cuda.Event()
            self._staged_event.record()
            self._staged = host
        else:
            self._staged, self._staged_event = verdict, None

    def verdict_ready(self) -> bool:
        """Whether :meth:`read_verdict` can read without waiting for the device (nothing staged,
        the CPU, or the copy's event has completed). Never blocks."""
        return self._staged_event is None or self._staged_event.query()

    def read_verdict(self, wait: bool = False) -> None:
        """Read the staged verdict into this round (:meth:`apply_verdict`); a no-op once read,
        or for a round restored from a checkpoint. ``wait``: the caller accepts a host wait for
        the copy (a synchronous step's one read, a checkpoint's); without it, call only when
        :meth:`verdict_ready`."""
        if self._staged is None:
            return
        if not wait and not self.verdict_ready():
            raise RuntimeError("read_verdict: the verdict's copy has not landed; ask verdict_ready() first")
        if self._staged_event is not None:
            self._staged_event.synchronize()  # completed already unless ``wait``
        values, self._staged, self._staged_event = self._staged.tolist(), None, None
        self.apply_verdict(values)

    def apply_verdict(self, values: List[float]) -> None:
        """Subclasses: take the host copy of what :meth:`stage` was given."""

    def capture_step(self, loss_scale: float, steps_taken: int) -> None:
        """At pack time: the fp16 loss scale the gradients carry, and the step this round makes."""
        self.loss_scale = loss_scale
        self.step_number = steps_taken + 1

    def verdict(self) -> dict:
        """What a checkpoint of a finished, not yet installed round keeps of it."""
        return {"grad_norm": self.grad_norm, "skipped": self.skipped,
                "nonfinite_ranks": list(self.nonfinite_ranks), "step_number": self.step_number}

    def restore_verdict(self, saved: dict) -> None:
        self.grad_norm = saved["grad_norm"]
        self.skipped = saved.get("skipped", False)
        self.nonfinite_ranks = list(saved.get("nonfinite_ranks", ()))
        self.step_number = saved.get("step_number", 0)
