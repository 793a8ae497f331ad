"""Preemption: a SIGTERM or SIGUSR1 ends training after the current step, with a checkpoint.

A preemption notice (a cloud's spot reclaim, ``torchrun`` stopping its workers, SLURM's warning
with ``--signal=USR1@...``) reaches every rank, but not at the same moment. :class:`PreemptionGuard`
records the signal in its handler (nothing else runs there) and the ranks agree on it at a step
boundary: each :meth:`PreemptionGuard.poll` starts a 4-byte all-reduce (MAX) of this rank's signal
over a gloo group of CPU tensors and reads the one it started at the previous call, so the ranks
learn of a signal at the same step and the all-reduce's latency hides behind a step of compute.
The loop then saves and leaves with :attr:`PreemptionGuard.exit_code`, 128 + the signal's number
(143 for SIGTERM), which restart policies (torchrun's ``--max-restarts``, a scheduler's requeue)
treat as a failure to restart, unlike 0. A second signal ends the process at once, as without the
guard (a rank stuck in a collective would never reach the step boundary).

``examples/train.py`` and the Hugging Face Trainer (:func:`ds_lowcomm.integration.hf.install_trainer_hooks`)
use it unless ``lowcomm.save_on_preemption`` is false.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    """Catches :data:`SIGNALS` from construction until :meth:`close` (construct it on the main
    thread: Python runs signal handlers there).

    Args:
        group: a gloo process group over every rank (None: a single process, no all-reduce).
    """

    def __init__(self, group=None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard: construct it on the main thread (signal handlers run there)")
        self.group = group
        self.signum = 0  # the first signal this rank received
        self.agreed = 0  # the signal every rank has learnt of (0: none yet)
        self._pending = None  # (work, tensor) of the all-reduce started at the last poll
        self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}

    def _handler(self, signum, frame) -> None:
        if not self.signum:
            self.signum = signum
            return
        # A second signal: whoever sent it will not wait for the step (a rank stuck in a
        # collective never reaches it); it ends the process as it would have without the guard.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def poll(self) -> int:
        """Collective, once per step on every rank: the signal every rank has learnt of by the
        previous call (0: none), from a 4-byte all-reduce started then; starts the next one."""
        if self.agreed:
            return self.agreed
        if self.group is None:
            self.agreed = self.signum
            return self.agreed
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self.agreed = int(flag.item())  # a CPU tensor: no device sync
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return self.agreed

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal's number: how a shell reports a process that signal ended."""
        return 128 + self.agreed

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.agreed).name if self.agreed else None

    def close(self) -> None:
        """Wait for the all-reduce in flight (every rank started it) and restore the handlers that
        were there before: from then on a signal has its usual effect. A signal this rank caught
        in the last step, too late for the ranks to agree on, is not acted on (training has
        finished, and every rank goes on to the script's end alike); the rank says so in one
        line. Idempotent."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        if self._previous and self.signum and not self.agreed:
            print(f"ds_lowcomm: {signal.Signals(self.signum).name} came in the last step, too late for the ranks' last "
                  f"check; training has finished, so it is not acted on (a new signal has its usual effect)",
                  file=sys.stderr, flush=True)
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}  # closed: a second close changes nothing
