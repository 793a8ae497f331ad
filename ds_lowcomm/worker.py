"""CommWorker: where rounds run, the only issuer of collectives during training.

It runs a :class:`~ds_lowcomm.round.Round`'s ``run()`` and times it: ``round_seconds`` is time
communication was in flight, ``wait_seconds`` the time the training thread was blocked on it.
This worker executes rounds inline on the training thread (synchronous modes: the whole round is
exposed, ``wait_seconds == round_seconds``); an asynchronous worker (side CUDA stream, or a host
thread with gloo on CPU) keeps the same ``submit``/``wait`` contract.
"""
from __future__ import annotations

import time

from ds_lowcomm.comm import CommStats
from ds_lowcomm.round import Round


class CommWorker:
    """Executes rounds in submission order; ``wait(r)`` returns once ``r.run()`` has finished."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats

    def submit(self, rnd: Round) -> None:
        """Start ``rnd.run()``. Inline: returns when it is done; its time counts as waited."""
        t0 = time.perf_counter()
        rnd.run()
        dt = time.perf_counter() - t0
        self.stats.rounds += 1
        self.stats.round_seconds += dt
        self.stats.wait_seconds += dt

    def wait(self, rnd: Round) -> None:
        """Block until ``rnd`` has run (already true for inline execution)."""

    def close(self) -> None:
        """Finish outstanding rounds and release resources."""
