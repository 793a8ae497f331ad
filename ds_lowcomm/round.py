"""A Round: the unit of communication of every mode.

A round moves through three calls, on two threads::

    pack()     training thread, at a gradient-accumulation boundary: take what the round sends
               (hand over a buffer, or copy it when accumulation must go on on top of it) and the
               hyperparameters in force now
    run()      communication worker: the collectives and the sharded optimizer step; writes the
               next parameters where install() will find them
    install()  training thread, at a later boundary (or at once for a synchronous mode): make the
               round's result the model's parameters

``zero1`` runs the three back to back; ``acco`` overlaps ``run()`` with the next micro-batches.
"""
from __future__ import annotations

import abc


class Round(abc.ABC):
    """One round of communication. Subclasses define what is sent and how the result is used."""

    @abc.abstractmethod
    def pack(self) -> None:
        """Training thread: capture the inputs. Must not communicate."""

    @abc.abstractmethod
    def run(self) -> None:
        """Communication worker: issue the collectives and compute the result."""

    @abc.abstractmethod
    def install(self) -> None:
        """Training thread: apply the result to the model. Must not communicate."""
