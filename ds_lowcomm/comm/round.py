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
from typing import List, Optional

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
    """

    def __init__(self) -> None:
        self.grad_norm: float = float("nan")
        self.skipped = False
        self.nonfinite_ranks: List[int] = []
        self.loss_scale = 1.0
        self.step_number = 0
        #: when set, the round's result is this change to the parameters the model held when the
        #: round was launched (installed by adding it), not the parameters themselves
        self.delta: Optional[torch.Tensor] = None

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
