"""CommWorker: where an asynchronous mode's rounds are issued (a synchronous mode runs its round
on the training thread, :func:`ds_lowcomm.shard.step.step_now`).

``submit(round)`` returns a :class:`Ticket`, a :class:`concurrent.futures.Future` resolved when
the round's ``run()`` is over; ``poll``/``wait`` ask it (and order CUDA streams). Rounds run in
submission order, so every rank issues the same collectives in the same order whatever its own
timing. Where they run depends on whether the groups' collectives block the host:

- **inline** (CUDA, with groups whose collectives return once enqueued: NCCL's): ``submit`` runs
  the round at once on the submitting thread, onto a side stream. Every collective of a rank is
  then issued from the thread that drives training (or autograd's, in a backward hook, while the
  training thread waits for it): one issuing thread per device, the condition under which NCCL
  orders several communicators' work (``NCCL_LAUNCH_ORDER_IMPLICIT``), and no second Python
  thread competing for the GIL with the training thread's launches. Enqueueing a round costs
  its kernel launches (a few dozen: its verdicts stay on the device) and never waits for the GPU.
- **a thread** (CPU, and gloo on CUDA, whose collectives block the calling thread): one
  background thread runs the rounds, on CUDA on its side stream; gloo releases the GIL while it
  blocks, so the training thread computes meanwhile.

On CUDA the side stream first waits for an event recorded on the training stream at submit time
(the round's inputs are ready) and records a done event once the round is enqueued. Nothing here
makes the host wait for the GPU: the ticket resolves when the round has been *enqueued*,
:meth:`CommWorker.poll` asks the done event whether the GPU has finished it, and
:meth:`CommWorker.wait` makes the training stream wait on the event (kernels queued after it run
after the round; the host goes on queueing). Buffers are allocated once by the mode and reused,
so no ``record_stream`` is needed.

Stats: ``round_seconds`` (host time in ``run()``: on CPU the communication; on CUDA its
enqueueing), ``host_wait_seconds`` (training thread blocked) and, on CUDA,
``device_wait_seconds``: the training stream held by :meth:`CommWorker.wait` until the round's done
event, timed by two events around the stream's wait (the first completes when the compute queued
before it has, the second when the round has too) and read once both have completed, never
waited for.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as concurrent_wait
from typing import Optional

import torch

from ds_lowcomm.comm.collectives import CommStats
from ds_lowcomm.comm.round import Round


class Ticket(Future):
    """A submitted round: resolved (result None) when its ``run()`` returned, or with the error
    it raised. A round restored from a checkpoint is a :meth:`completed` ticket."""

    def __init__(self, rnd: Round) -> None:
        super().__init__()
        self.round = rnd
        self.ready_event = None  # CUDA: inputs ready on the training stream
        self.done_event = None   # CUDA: outputs ready on the side stream

    @classmethod
    def completed(cls, rnd: Round) -> "Ticket":
        """A ticket for a round whose ``run()`` is already over (e.g. restored from a checkpoint)."""
        ticket = cls(rnd)
        ticket.set_result(None)
        return ticket


class CommWorker:
    """Runs rounds in submission order: ``inline`` on the submitting thread onto a side stream
    (CUDA only), else on one background thread (module doc)."""

    def __init__(self, stats: CommStats, device: torch.device, inline: bool = False) -> None:
        self.stats = stats
        self.cuda = device.type == "cuda"
        if inline and not self.cuda:
            raise ValueError("CommWorker: inline rounds need CUDA (a side stream to enqueue them on); "
                             f"on {device} a round blocks, so it runs on the worker's thread")
        self.inline = inline
        self.device = device
        self._queue: "queue.Queue[Optional[Ticket]]" = queue.Queue()
        self._device_waits: "list[tuple]" = []  # (before, after) timing events not yet read
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._thread: Optional[threading.Thread] = None
        if not inline:
            self._thread = threading.Thread(target=self._loop, name="ds_lowcomm-comm", daemon=True)
            self._thread.start()

    def submit(self, rnd: Round) -> Ticket:
        """Issue ``rnd.run()`` onto the side stream now (inline), or queue it for the thread. Call
        ``rnd.pack()`` first. Never waits for the device, nor for a round."""
        ticket = Ticket(rnd)
        if self.cuda:
            ticket.ready_event = torch.cuda.Event()
            ticket.ready_event.record()
            ticket.done_event = torch.cuda.Event()
        if self.inline:
            self._on_side_stream(ticket)
        else:
            self._queue.put(ticket)
        return ticket

    def poll(self, ticket: Ticket) -> bool:
        """True once the round has run, on CUDA once the GPU has finished it (its done event);
        raises the round's error if it failed. Never blocks."""
        if not ticket.done():
            return False
        ticket.result()
        return ticket.done_event is None or ticket.done_event.query()

    def wait(self, ticket: Ticket) -> None:
        """Block until the round has run (on CUDA: been enqueued on the side stream, which for a
        round that reads a device value in ``run()`` means the GPU has reached that read), then
        order the training stream after it. No host read of the device of its own."""
        if not ticket.done():
            t0 = time.perf_counter()
            concurrent_wait([ticket])
            self.stats.host_wait_seconds += time.perf_counter() - t0
        ticket.result()
        if ticket.done_event is not None:
            stream = torch.cuda.current_stream()
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(ticket.done_event)
            after.record(stream)
            self._device_waits.append((before, after))
            self.count_device_waits()

    def count_device_waits(self) -> None:
        """Add the device-side waits whose timing events have completed to
        ``stats.device_wait_seconds``, in order. Never blocks (queries the events)."""
        while self._device_waits and self._device_waits[0][1].query():
            before, after = self._device_waits.pop(0)
            self.stats.device_wait_seconds += before.elapsed_time(after) / 1000.0

    def close(self) -> None:
        """Let queued rounds finish, then stop the thread. On CUDA also wait until the GPU has
        finished them: the buffers they write were allocated on the training stream (no
        ``record_stream``), so freeing them with a round still running would hand its memory back."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.cuda:
            self.stream.synchronize()

    def _loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if self.cuda:
                self._on_side_stream(ticket)
            else:
                self._execute(ticket)

    def _on_side_stream(self, ticket: Ticket) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ticket.ready_event)
            self._execute(ticket, stream=self.stream)

    def _execute(self, ticket: Ticket, stream=None) -> None:
        t0 = time.perf_counter()
        error = None
        try:
            ticket.round.run()
            if stream is not None:  # no synchronize: the consumer's stream waits on the event
                ticket.done_event.record(stream)
        except BaseException as err:  # re-raised on the training thread by poll/wait
            error = err
        self.stats.rounds += 1
        self.stats.round_seconds += time.perf_counter() - t0
        if error is None:
            ticket.set_result(None)
        else:
            ticket.set_exception(error)
