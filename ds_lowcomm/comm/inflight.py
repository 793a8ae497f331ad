"""InFlight: the one round an overlapped mode has in flight (acco, demo with overlap).

Megatron's ``start_*/finish_*`` overlap as one component: :meth:`launch` submits a packed round
to the comm worker, whose ticket is a :class:`concurrent.futures.Future`; :meth:`ready` asks it
without blocking; :meth:`install` waits for it and makes the round's result (the padded buffer the
round all-gathers into) the model's parameters. For a checkpoint, :meth:`settle` waits without
installing, :meth:`rebase` replaces the parameters under a pending round and
:meth:`verdict` describes the finished round; :meth:`restore` re-creates it as a
completed future, so the next :meth:`install` installs it as if it had just run.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_lowcomm.comm.round import StepRound
from ds_lowcomm.comm.worker import CommWorker, Ticket


#: elements re-based at a time (a few MB of fp32 temporaries, never a model-sized one)
REBASE_CHUNK = 1 << 20


class InFlight:
    """At most one round in flight, whose result lands in ``result`` and is installed into
    ``params`` (both padded flat buffers of the model's dtype)."""

    def __init__(self, worker: CommWorker, params: torch.Tensor, result: torch.Tensor) -> None:
        self.worker, self.params, self.result = worker, params, result
        self.ticket: Optional[Ticket] = None

    @property
    def round(self) -> Optional[StepRound]:
        """The round in flight, or finished and not installed; None when there is none."""
        return None if self.ticket is None else self.ticket.round

    def launch(self, rnd: StepRound) -> None:
        """Submit ``rnd`` (packed) to the worker. The previous round must be installed."""
        if self.ticket is not None:
            raise RuntimeError("a round is still in flight: install it before launching the next")
        self.ticket = self.worker.submit(rnd)

    def ready(self) -> bool:
        """Whether there is no round, or the round has run (raises its error). Never blocks."""
        return self.ticket is None or self.worker.poll(self.ticket)

    def settle(self) -> None:
        """Wait for the round to have run, without installing it (on CUDA: enqueued, the
        training stream ordered after it, so what the training stream reads next, a copy to the
        host included, sees its results), and read its verdict (on CUDA a host wait for the
        device: a checkpoint's, a flush's; never in a step)."""
        if self.ticket is not None:
            self.worker.wait(self.ticket)
            self.ticket.round.read_verdict(wait=True)

    def install(self) -> Optional[StepRound]:
        """Wait for the round, copy its result into the model's parameters (or add it, when the
        round's result is a ``delta``) and report its verdict (``round.install()``); returns the
        round (None when there was none)."""
        if self.ticket is None:
            return None
        self.worker.wait(self.ticket)
        rnd, self.ticket = self.ticket.round, None
        if rnd.delta is not None:  # a change to the parameters held since the launch
            self.params.add_(rnd.delta)
        else:
            self.params.copy_(self.result)
        rnd.install()
        return rnd

    @torch.no_grad()
    def rebase(self, full: torch.Tensor) -> None:
        """Make the unpadded ``full`` the model's parameters, the round staying pending (acco's
        flush): a change the round gathered is re-taken from ``full``, chunk by chunk, so its
        install still gives the round's result (the change rounded once more)."""
        self.settle()
        n = full.numel()
        delta = None if self.ticket is None else self.ticket.round.delta
        if delta is not None:
            for a in range(0, n, REBASE_CHUNK):
                b = min(n, a + REBASE_CHUNK)
                delta[a:b] = self.params[a:b] + delta[a:b].float() - full[a:b]
        self.params[:n].copy_(full)

    def drop(self) -> None:
        """Forget the round (a load replaces the state it was computed from)."""
        self.ticket = None

    def verdict(self) -> Optional[dict]:
        """What a checkpoint keeps of the finished round (after :meth:`settle`), or None."""
        return None if self.ticket is None else self.ticket.round.verdict()

    def restore(self, rnd: StepRound, saved: dict, params: torch.Tensor) -> None:
        """Re-create a finished, not installed round from its :meth:`verdict` and its result's
        unpadded parameters ``params``: the next :meth:`install` installs them."""
        rnd.restore_verdict(saved)
        self.result.zero_()
        self.result[: params.numel()].copy_(params.to(self.result.dtype))
        self.ticket = Ticket.completed(rnd)
